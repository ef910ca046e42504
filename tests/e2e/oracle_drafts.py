"""A draft proposer that knows each prompt's greedy continuation (from a reference run), for tests of speculative
decoding on tiny random models, which seldom repeat themselves for the n-gram lookup."""

from __future__ import annotations

from collections.abc import Sequence

from tests.tiny_models import VOCAB_SIZE
from tokenmill.engine.core.request import Request


class OracleDrafts:
    """Drafts the known greedy continuation of each prompt, with every ``wrong_every``-th output
    position replaced by a wrong token (0 = never), so drafts are kept in full, in part or not at all."""

    name = "oracle"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong_every: int) -> None:
        self.continuations = continuations
        self.wrong_every = wrong_every

    def propose(self, wanted: list[tuple[Request, Sequence[int], int]]) -> dict[str, list[int]]:
        drafts = {}
        for request, _, num_tokens in wanted:
            start = request.num_output_tokens
            truth = self.continuations[tuple(request.prompt_token_ids)][start:start + num_tokens]
            drafts[request.request_id] = [
                (t + 1) % VOCAB_SIZE if self.wrong_every and (start + i) % self.wrong_every == self.wrong_every - 1
                else t for i, t in enumerate(truth)]
        return {request_id: draft for request_id, draft in drafts.items() if draft}

    def finished(self, request: Request) -> None:
        pass
