"""Drafts from a smaller model that shares the target's tokenizer (``[engine.speculative] method =
"draft"``): greedy tokens from the draft model over the request's tokens, proposed through the same
interface as the draftless proposers (engine/spec/speculator.py).

The draft model keeps a Hugging Face ``DynamicCache`` per request with the tokens it has seen; each
step it crops the cache back to the longest prefix still true of the request (a rejected draft's
tokens go) and feeds only the rest, so a step costs the draft model ``k`` single-token forwards per
request. Requests are drafted one after another (no batching across requests): the method suits the
small batches where speculation pays most; the goodput rule sizes drafts by measured step cost, and
the draft model's time is part of the engine step it runs in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from tokenmill.engine.core.request import Request
from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.model.model_loader import LoadedModel
from tokenmill.engine.output.no_tokenizer import NoTokenizer


@dataclass
class _DraftCache:
    cache: DynamicCache
    token_ids: list[int] = field(default_factory=list)  # the tokens whose KV the cache holds


class DraftModelProposer:
    """Greedy drafts from ``draft`` for requests of ``target`` (a :class:`Proposer`).

    Raises:
        ModelLoadError: the two models' tokenizers differ (draft token ids would mean other text).
    """

    name = "draft"

    def __init__(self, draft: LoadedModel, target: LoadedModel) -> None:
        if not _same_vocabulary(draft, target):
            raise ModelLoadError(f"draft model {draft.source} does not share the tokenizer of {target.source}")
        self.draft = draft
        self._caches: dict[str, _DraftCache] = {}

    @torch.inference_mode()
    def propose(self, wanted: list[tuple[Request, Sequence[int], int]]) -> dict[str, list[int]]:
        drafts = {}
        for request, token_ids, num_tokens in wanted:
            drafts[request.request_id] = self._draft(request.request_id, token_ids, num_tokens)
        return drafts

    def finished(self, request: Request) -> None:
        self._caches.pop(request.request_id, None)

    def _draft(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        entry = self._caches.get(request_id)
        if entry is None:
            entry = self._caches[request_id] = _DraftCache(DynamicCache())
        keep = _common_prefix(entry.token_ids, token_ids, limit=len(token_ids) - 1)
        if keep < len(entry.token_ids):  # NOTE: a negative count (tokens to remove) means that in every transformers
            entry.cache.crop(keep - len(entry.token_ids))
        feed = token_ids[keep:]
        entry.token_ids = list(token_ids)
        draft: list[int] = []
        device = self.draft.device
        for _ in range(num_tokens):
            input_ids = torch.tensor([feed], device=device)
            logits = self.draft.model(input_ids=input_ids, past_key_values=entry.cache, use_cache=True).logits
            token_id = int(logits[0, -1].argmax())
            draft.append(token_id)
            feed = [token_id]
        entry.token_ids += draft[:-1]  # NOTE: the last draft token was not fed: its KV is not in the cache
        return draft


def _common_prefix(cached: list[int], token_ids: Sequence[int], limit: int) -> int:
    length = 0
    for a, b in zip(cached[:limit], token_ids[:limit]):
        if a != b:
            break
        length += 1
    return length


def _same_vocabulary(draft: LoadedModel, target: LoadedModel) -> bool:
    if isinstance(draft.tokenizer, NoTokenizer) or isinstance(target.tokenizer, NoTokenizer):
        return bool(draft.model.config.vocab_size == target.model.config.vocab_size)
    return bool(draft.tokenizer.get_vocab() == target.tokenizer.get_vocab())
