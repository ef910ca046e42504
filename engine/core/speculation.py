"""Speculative decoding as the core sees it: which tokens of a verified draft a request keeps, and the
interface the scheduler asks for drafts through (engine/spec/ holds the proposers and the policy).

A decoding request with draft tokens ``d1..dk`` runs one chunk ``[x, d1..dk]`` (``x`` its newest
token): one forward writes their KV and gives a next-token distribution after each of them. The
runner samples every one of those rows exactly as it samples a plain decode (the same sampler, the
same per-position seeds), and the request keeps the rows' tokens up to the first that differs from
the draft. For greedy rows this is the longest prefix whose argmax matches plus the bonus token; for
sampled rows it is rejection sampling of a deterministic draft: the draft token is accepted with
probability ``p(d)``, and a rejected position keeps a token drawn from ``p`` without ``d`` -- so
every kept token follows the target distribution, whatever the draft. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenmill.engine.core.request import Request
from tokenmill.engine.core.stats import SpeculationCounters


def accept_drafts(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """How many rows' tokens a request keeps: the sampled rows up to and including the first that is
    not the draft's token there (all ``k + 1`` when every draft token matched).

    Args:
        draft_token_ids: the ``k`` draft tokens the chunk ran.
        sampled_token_ids: the ``k + 1`` tokens sampled after ``x, d1, .., dk``.
    """
    if len(sampled_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"{len(sampled_token_ids)} sampled rows for {len(draft_token_ids)} draft tokens")
    for i, draft_token_id in enumerate(draft_token_ids):
        if sampled_token_ids[i] != draft_token_id:
            return i + 1
    return len(sampled_token_ids)


@dataclass(frozen=True)
class DraftRoom:
    """What the scheduler leaves for drafts this step, after every real token was scheduled."""

    num_tokens_left: int  # of max_num_batched_tokens
    num_scheduled_tokens: int  # tokens the step already runs
    num_decodes: int  # decoding requests in the step


class Speculator(Protocol):
    """Proposes draft tokens for the step's decodes and learns from what was accepted (engine/spec/)."""

    counters: SpeculationCounters  # what it drafted and what was kept, since the engine started

    def draft(self, candidates: list[tuple[Request, int]], room: DraftRoom) -> dict[str, list[int]]:
        """Draft tokens per request id, each at most its bound (``(request, most draft tokens)`` in
        urgency order); requests it does not name get none."""
        ...

    def observe(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """The verified outcome of a request's draft."""
        ...

    def observe_step(self, num_tokens: int, seconds: float, path: str, drafted: bool) -> None:
        """One executed decode step, as it lands: its tokens, its forward's seconds, how it ran (``ModelOutput.path``)
        and whether it carried drafts (the cost model). The time from one call to the next, where one :meth:`draft`
        came between, is a step's wall time: less the forward, the engine's host time per step."""
        ...

    def finished(self, request: Request) -> None:
        """A request left the engine (its output may feed drafts of later requests)."""
        ...
