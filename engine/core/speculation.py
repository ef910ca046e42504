"""Speculative decoding as the core sees it: the interface the scheduler asks for drafts through, and the room
a step leaves them. engine/spec/ holds everything else: the proposers, the goodput rule that sizes each draft,
and which tokens of a verified draft a request keeps (engine/spec/verification.py). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenmill.engine.core.request import Request
from tokenmill.engine.core.stats import SpeculationCounters


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

    def observe(self, outcomes: list[tuple[Request, int, int]]) -> None:
        """The verified outcomes of a step's drafts: ``(request, draft tokens run, of them accepted)`` each."""
        ...

    def observe_step(self, num_tokens: int, seconds: float, path: str, drafted: bool) -> None:
        """One executed decode step, as it lands: its tokens, its forward's seconds, how it ran (``ModelOutput.path``)
        and whether it carried drafts (the cost model). The time from one call to the next, where one :meth:`draft`
        came between, is a step's wall time: less the forward, the engine's host time per step."""
        ...

    def finished(self, request: Request) -> None:
        """A request left the engine (its output may feed drafts of later requests)."""
        ...
