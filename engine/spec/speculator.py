"""The engine's speculator (the core's :class:`Speculator`): asks its proposers for drafts, chooses
each request's draft length by the goodput rule (engine/spec/draft_length.py), and keeps the counts.

Proposers are tried in order for each request, a later one only where the earlier ones proposed
nothing: ``auto`` is the tokens a structured request's grammar forces, then the request's own n-gram
lookup, then the suffix pool of earlier outputs.
Standard library only; a draft model's proposer (engine/model/draft_proposer.py) comes in through
the same :class:`Proposer` interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.engine.config import SpeculativeConfig
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.speculation import DraftRoom
from tokenmill.engine.core.stats import SpeculationCounters
from tokenmill.engine.spec.draft_length import (
    PROBE_EVERY_STEPS,
    PROBE_TOKENS,
    Acceptance,
    StepCost,
    choose_draft_lengths,
)
from tokenmill.engine.spec.ngram import NgramIndex
from tokenmill.engine.spec.suffix_pool import SuffixPool


@dataclass
class DraftState:
    """What the speculator keeps on a request (``Request.draft_state``)."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    ngram: NgramIndex | None = None


class Proposer(Protocol):
    """Proposes draft tokens: ``propose`` gets ``(request, its tokens, most draft tokens)`` triples."""

    def propose(self, wanted: list[tuple[Request, list[int], int]]) -> dict[str, list[int]]: ...

    def finished(self, request: Request) -> None: ...


class NgramProposer:
    """Prompt lookup over each request's own tokens (engine/spec/ngram.py)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, wanted: list[tuple[Request, list[int], int]]) -> dict[str, list[int]]:
        drafts = {}
        for request, token_ids, num_tokens in wanted:
            state = draft_state(request)
            if state.ngram is None:
                state.ngram = NgramIndex(self.min_n, self.max_n)
            draft = state.ngram.propose(token_ids, num_tokens)
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def finished(self, request: Request) -> None:
        """Nothing to keep: the index lived on the request."""


class SuffixPoolProposer:
    """Continuations of this engine's earlier outputs (engine/spec/suffix_pool.py)."""

    def __init__(self, pool: SuffixPool) -> None:
        self.pool = pool

    def propose(self, wanted: list[tuple[Request, list[int], int]]) -> dict[str, list[int]]:
        drafts = {}
        for request, token_ids, num_tokens in wanted:
            draft = self.pool.propose(token_ids, num_tokens)
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def finished(self, request: Request) -> None:
        self.pool.add(request.prompt_token_ids, request.output_token_ids)


def draft_state(request: Request) -> DraftState:
    """The request's speculator state, made on first use."""
    if not isinstance(request.draft_state, DraftState):
        request.draft_state = DraftState()
    return request.draft_state


class DraftSpeculator:
    """Drafts from its proposers, sized by cost (implements the core's ``Speculator``).

    Args:
        proposers: tried in order per request.
        num_speculative_tokens: most draft tokens per request per step.
        min_acceptance: the acceptance floor (a request under it only probes now and then).
    """

    def __init__(self, proposers: list[Proposer], num_speculative_tokens: int, min_acceptance: float) -> None:
        self.proposers = proposers
        self.num_speculative_tokens = num_speculative_tokens
        self.min_acceptance = min_acceptance
        self.cost = StepCost()
        self.counters = SpeculationCounters(drafted_by_position=[0] * num_speculative_tokens,
                                            accepted_by_position=[0] * num_speculative_tokens)

    def draft(self, candidates: list[tuple[Request, int]], room: DraftRoom) -> dict[str, list[int]]:
        wanted: list[tuple[Request, list[int], int]] = []
        for request, bound in candidates:
            state = draft_state(request)
            state.acceptance.steps_since_draft += 1
            num_tokens = min(bound, self.num_speculative_tokens)
            if state.acceptance.rate < self.min_acceptance:
                num_tokens = min(num_tokens, PROBE_TOKENS) if state.acceptance.steps_since_draft >= PROBE_EVERY_STEPS \
                    else 0
            if num_tokens > 0:
                wanted.append((request, request.all_token_ids, num_tokens))
        proposed: dict[str, list[int]] = {}
        for proposer in self.proposers:
            missing = [w for w in wanted if w[0].request_id not in proposed]
            if not missing:
                break
            proposed.update(proposer.propose(missing))
        by_id = {request.request_id: request for request, _ in candidates}
        lengths = choose_draft_lengths(
            [(request_id, len(draft), draft_state(by_id[request_id]).acceptance.rate)
             for request_id, draft in proposed.items()],
            room.num_tokens_left, room.num_scheduled_tokens, room.num_decodes, self.cost)
        counts = self.counters.draft_length_counts
        for request, _ in candidates:
            length = lengths.get(request.request_id, 0)
            counts[length] = counts.get(length, 0) + 1
        return {request_id: proposed[request_id][:length] for request_id, length in lengths.items()}

    def observe(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        draft_state(request).acceptance.observe(num_drafted, num_accepted)
        counters = self.counters
        counters.num_drafts += 1
        counters.num_draft_tokens += num_drafted
        counters.num_accepted_tokens += num_accepted
        for position in range(num_drafted):
            counters.drafted_by_position[position] += 1
        for position in range(num_accepted):
            counters.accepted_by_position[position] += 1

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)
        self.counters.step_fixed_s, self.counters.step_per_token_s = self.cost.fixed_s, self.cost.per_token_s

    def finished(self, request: Request) -> None:
        for proposer in self.proposers:
            proposer.finished(request)


def build_speculator(config: SpeculativeConfig, draft: Proposer | None = None,
                     forced: Proposer | None = None) -> DraftSpeculator | None:
    """The speculator ``[engine.speculative]`` asks for; None when ``method = "off"``.

    Args:
        draft: the draft model's proposer, for ``method = "draft"`` (the caller loads the model).
        forced: the grammar-forced proposer (engine/sample/grammar_drafts.py), tried first for
            structured requests with ``auto`` and ``draft``; None: a model without structured output.
    """
    if config.method == "off":
        return None
    proposers: list[Proposer] = []
    if forced is not None and config.method in ("auto", "draft"):
        proposers.append(forced)
    if config.method in ("ngram", "auto"):
        proposers.append(NgramProposer(config.ngram_min, config.ngram_max))
    if config.method in ("suffix", "auto"):
        pool = SuffixPool(config.ngram_min, config.ngram_max, config.num_speculative_tokens,
                          config.suffix_pool_tokens)
        proposers.append(SuffixPoolProposer(pool))
    if config.method == "draft":
        if draft is None:
            raise ValueError("method 'draft' needs the draft model's proposer")
        proposers.append(draft)
    return DraftSpeculator(proposers, config.num_speculative_tokens, config.min_acceptance)
