"""The engine's speculator (the core's :class:`Speculator`): asks its proposers for drafts, chooses
each request's draft length by the goodput rule (engine/spec/draft_length.py), and keeps the counts.

Proposers are tried in order for each request, a later one only where the earlier ones proposed
nothing: ``auto`` is the tokens a structured request's grammar forces, then n-gram matches of two or
more tokens (the request's own tokens, then the suffix pool of earlier outputs), then single-token
matches (the same two sources), where ``ngram_min`` is 1. Each proposer keeps its own acceptance per
request: a single-token match is a weaker guess than a long one, and its misses must neither shorten
the long matches' drafts nor stop them. At a small batch a draft token costs a few percent of a step
(the step is bound by reading the weights), so even the weaker guesses pay there; the goodput rule
drops them where the step is bound by compute.
Standard library only; a draft model's proposer (engine/spec/draft_model.py) comes in through
the same :class:`Proposer` interface.

The speculator runs on every decoding request every step, so its host time per request is kept small: a
request the goodput rule could not give a draft to (its acceptance at or under what a first draft token
must buy on the device's cost) is not proposed for, and the proposers' own time is measured, for the rule
to charge a request's first draft token with it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from types import ModuleType
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
    drafting_pays,
)
from tokenmill.engine.spec.ngram import SCAN_TOKENS, LazyNgramIndex, NgramLookup, native_index
from tokenmill.engine.spec.suffix_pool import SuffixPool

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DraftState:
    """What the speculator keeps on a request (``Request.draft_state``)."""

    acceptance: dict[str, Acceptance] = field(default_factory=dict)  # proposer name -> its drafts' acceptance
    # the proposer of its latest proposal: that of the draft it ran, if it ran one (proposed the same step), and that
    # proposer's acceptance for it (what the draft's outcome updates)
    proposer: str | None = None
    proposed_with: Acceptance | None = None
    ngram: NgramLookup | None = None

    def acceptance_of(self, proposer: str, step: int) -> Acceptance:
        """The proposer's acceptance for this request, made at ``step`` (the speculator's) on first use."""
        acceptance = self.acceptance.get(proposer)
        if acceptance is None:
            acceptance = self.acceptance[proposer] = Acceptance(drafted_at_step=step)
        return acceptance


class Proposer(Protocol):
    """Proposes draft tokens: ``propose`` gets ``(request, its tokens, most draft tokens)`` triples."""

    name: str  # in the stats and metrics; each proposer of a speculator has its own

    def propose(self, wanted: list[tuple[Request, Sequence[int], int]]) -> dict[str, list[int]]: ...

    def finished(self, request: Request) -> None: ...


class NgramProposer:
    """Prompt lookup over each request's own tokens (engine/spec/ngram.py), matches of ``min_n`` or more tokens.

    Args:
        index_min_n: the shortest n-gram the request's index holds (the least ``min_n`` of the tiers).
        native: the C++ index (engine/spec/ngram.py :func:`native_index`), proposing for the batch in one call;
            None: :class:`LazyNgramIndex` per request (the reference, the same drafts).
    """

    def __init__(self, name: str, min_n: int, max_n: int, index_min_n: int, native: ModuleType | None = None) -> None:
        self.name = name
        self.min_n, self.max_n, self.index_min_n = min_n, max_n, index_min_n
        self.native = native

    def propose(self, wanted: list[tuple[Request, Sequence[int], int]]) -> dict[str, list[int]]:
        native = self.native
        if native is not None:
            indexes = []
            for request, _, _ in wanted:
                state = request.draft_state
                if state.__class__ is not DraftState:
                    state = draft_state(request)
                index = state.ngram
                if index is None:
                    index = state.ngram = native.NgramIndex(self.index_min_n, self.max_n)
                indexes.append(index)
            drafts: dict[str, list[int]] = native.propose_batch(wanted, indexes, self.min_n)
            return drafts
        drafts = {}
        min_n = self.min_n
        for request, _, num_tokens in wanted:  # NOTE: the index copies the request's lists, not its view
            state = request.draft_state
            if state.__class__ is not DraftState:
                state = draft_state(request)
            index = state.ngram
            if index is None:
                # NOTE: a request that cannot outgrow SCAN_TOKENS searches its tokens; a longer one indexes them
                searches = request.max_total_tokens <= SCAN_TOKENS
                index = state.ngram = LazyNgramIndex(self.index_min_n, self.max_n, SCAN_TOKENS if searches else 0)
            draft = index.propose(request.prompt_token_ids, request.output_token_ids, num_tokens, min_n)
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def finished(self, request: Request) -> None:
        """Nothing to keep: the index lived on the request."""


class SuffixPoolProposer:
    """Continuations of this engine's earlier outputs (engine/spec/suffix_pool.py), matches of ``min_n``
    or more tokens.

    Args:
        learns: whether a finished request's output is added to the pool (one proposer per pool does
            it; a single-token tier reads the pool its longer tier fills).
    """

    def __init__(self, name: str, pool: SuffixPool, min_n: int, learns: bool = True) -> None:
        self.name = name
        self.pool = pool
        self.min_n = min_n
        self.learns = learns

    def propose(self, wanted: list[tuple[Request, Sequence[int], int]]) -> dict[str, list[int]]:
        drafts = {}
        for request, token_ids, num_tokens in wanted:
            draft = self.pool.propose(token_ids, num_tokens, self.min_n)
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def finished(self, request: Request) -> None:
        if self.learns:
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
        self._stepped_at_s: float | None = None  # when the last observe_step came
        self._drafts_since_step = 0  # draft calls since then
        self._num_steps = 0  # draft calls (steps that had requests to draft for) since the engine started
        self.counters = SpeculationCounters(drafts_by_length=[0] * (num_speculative_tokens + 1),
                                            drafts_by_num_kept=[0] * (num_speculative_tokens + 1))

    def draft(self, candidates: list[tuple[Request, int]], room: DraftRoom) -> dict[str, list[int]]:
        self._drafts_since_step += 1
        self._num_steps += 1
        step = self._num_steps
        threshold = self.cost.draft_threshold(room.num_scheduled_tokens, room.num_decodes)
        pending = candidates  # (request, bound) of the requests without a draft yet, in urgency order
        proposed: dict[str, list[int]] = {}  # request id -> its draft
        # each proposed draft's length and its acceptance rate, in the order of ``proposed``
        lengths: list[int] = []
        rates: list[float] = []
        most, floor = self.num_speculative_tokens, self.min_acceptance
        first_asked: list[tuple[Request, Sequence[int], int]] | None = None  # whom the first proposer to ask asked
        asked_ids: set[str] | None = None  # whom any proposer asked, made once a second one asks
        started_s = time.perf_counter()
        for proposer in self.proposers:
            if not pending:
                break  # NOTE: every request has its draft: the later proposers have nothing to add
            name = proposer.name
            wanted: list[tuple[Request, Sequence[int], int]] = []
            acceptances: list[Acceptance] = []  # each wanted request's acceptance for this proposer, and its state
            states: list[DraftState] = []
            # Most draft tokens the proposer may offer each request: none where the goodput rule could not take its
            # first (its acceptance rate at or under ``threshold``, StepCost.draft_threshold), none while its
            # drafts for it are accepted under the floor, except a short probe now and then.
            for request, bound in pending:
                state = request.draft_state
                if state.__class__ is not DraftState:
                    state = draft_state(request)
                acceptance = state.acceptance.get(name) or state.acceptance_of(name, step)
                rate = acceptance.rate
                if rate <= threshold and threshold > 0.0:
                    continue
                num_tokens = bound if bound < most else most
                if rate < floor:
                    if step - acceptance.drafted_at_step < PROBE_EVERY_STEPS:
                        continue
                    num_tokens = min(num_tokens, PROBE_TOKENS)
                wanted.append((request, request.token_view, num_tokens))
                acceptances.append(acceptance)
                states.append(state)
            if not wanted:
                continue
            if first_asked is None:
                first_asked = wanted
            else:
                if asked_ids is None:
                    asked_ids = {request.request_id for request, _, _ in first_asked}
                asked_ids.update(request.request_id for request, _, _ in wanted)
            found = proposer.propose(wanted)
            if not found:
                continue
            for (request, _, _), acceptance, state in zip(wanted, acceptances, states, strict=True):
                draft = found.get(request.request_id)
                if draft:
                    proposed[request.request_id] = draft
                    lengths.append(len(draft))
                    rates.append(acceptance.rate)
                    state.proposer, state.proposed_with = name, acceptance
            pending = [item for item in pending if item[0].request_id not in found] if len(found) < len(pending) else []
        num_asked = len(asked_ids) if asked_ids is not None else len(first_asked) if first_asked is not None else 0
        if num_asked:
            self.cost.observe_proposals(num_asked, time.perf_counter() - started_s)
        if not proposed:
            self.counters.draft_length_counts[0] = self.counters.draft_length_counts.get(0, 0) + len(candidates)
            return {}
        # NOTE: the goodput rule's lengths (engine/spec/draft_length.py); where it takes every proposed token (the
        # common case), the drafts run as proposed, with no pass to make lengths or cut drafts
        chosen = choose_draft_lengths(proposed, lengths, rates, room.num_tokens_left, room.num_scheduled_tokens,
                                      room.num_decodes, self.cost)
        if chosen is None:
            drafts = proposed
        else:
            drafts = {}
            for request_id, length in chosen.items():
                draft = proposed[request_id]
                drafts[request_id] = draft if length == len(draft) else draft[:length]
        if drafts and self.cost.switches_path and not drafting_pays(
                {request_id: len(draft) for request_id, draft in drafts.items()}, dict(zip(proposed, rates)),
                room.num_scheduled_tokens, room.num_decodes, self.cost):
            drafts = {}
        counts = self.counters.draft_length_counts
        if len(drafts) < len(candidates):
            counts[0] = counts.get(0, 0) + len(candidates) - len(drafts)
        if drafts:
            for length, num_drafts in Counter(map(len, drafts.values())).items():
                counts[length] = counts.get(length, 0) + num_drafts
        return drafts

    def observe(self, outcomes: list[tuple[Request, int, int]]) -> None:
        step = self._num_steps
        # NOTE: per draft only its acceptance's update and where its proposer changes (most of a step's drafts come
        # from one); the counters are summed over the lists by builtins
        runs: list[tuple[str, int]] = []  # (proposer, index of its first outcome) of each run of one proposer
        last_name: str | None = None
        for index, (request, num_drafted, num_accepted) in enumerate(outcomes):
            state = request.draft_state
            if state.__class__ is not DraftState:
                state = draft_state(request)
            name = state.proposer or ""
            (state.proposed_with or state.acceptance_of(name, step)).observe(num_drafted, num_accepted, step)
            if name != last_name:
                last_name = name
                runs.append((name, index))
        counters = self.counters
        drafted, accepted = list(map(itemgetter(1), outcomes)), list(map(itemgetter(2), outcomes))
        for num_drafted, num_drafts in Counter(drafted).items():
            counters.drafts_by_length[num_drafted] += num_drafts
        for num_accepted, num_drafts in Counter(accepted).items():
            counters.drafts_by_num_kept[num_accepted] += num_drafts
        drafted_by_proposer, accepted_by_proposer = counters.draft_tokens_by_proposer, \
            counters.accepted_tokens_by_proposer
        for (name, start), (_, end) in zip(runs, [*runs[1:], ("", len(outcomes))]):
            num_drafted, num_accepted = sum(drafted[start:end]), sum(accepted[start:end])
            drafted_by_proposer[name] = drafted_by_proposer.get(name, 0) + num_drafted
            accepted_by_proposer[name] = accepted_by_proposer.get(name, 0) + num_accepted
            counters.num_draft_tokens += num_drafted
            counters.num_accepted_tokens += num_accepted
        counters.num_drafts += len(outcomes)

    def observe_step(self, num_tokens: int, seconds: float, path: str, drafted: bool) -> None:
        now_s = time.perf_counter()
        if self._drafts_since_step == 1 and self._stepped_at_s is not None:
            # NOTE: from the previous step's forward to this one's: one whole step (one draft call between), so
            # its wall time less this forward is the engine's host time per step
            self.cost.observe_host(now_s - self._stepped_at_s - seconds)
        self._stepped_at_s, self._drafts_since_step = now_s, 0
        self.cost.observe(num_tokens, seconds, path, drafted)
        self.counters.step_fixed_s, self.counters.step_per_token_s = self.cost.fixed_s, self.cost.per_token_s

    def finished(self, request: Request) -> None:
        for proposer in self.proposers:
            proposer.finished(request)


def build_speculator(config: SpeculativeConfig, draft: Proposer | None = None,
                     forced: Proposer | None = None) -> DraftSpeculator | None:
    """The speculator ``[engine.speculative]`` asks for; None when ``method = "off"``.

    Args:
        draft: the draft model's proposer, for ``method = "draft"`` (the caller loads the model).
        forced: the grammar-forced proposer (engine/spec/grammar_drafts.py), tried first for
            structured requests with ``auto`` and ``draft``; None: a model without structured output.
    """
    if config.method == "off":
        return None
    proposers: list[Proposer] = []
    pool: SuffixPool | None = None
    if forced is not None and config.method in ("auto", "draft"):
        proposers.append(forced)
    tiers = ngram_tiers(config.ngram_min, config.ngram_max)
    native = None
    if config.method in ("ngram", "auto"):
        native = native_index() if config.ngram_index == "auto" else None
        logger.info("speculation %s: the n-gram lookup runs in %s", config.method,
                    "C++" if native is not None else "Python")
    for min_n in tiers:
        suffix = "-1" if min_n < tiers[0] else ""  # NOTE: the single-token tier after longer matches
        if config.method in ("ngram", "auto"):
            proposers.append(NgramProposer("ngram" + suffix, min_n, config.ngram_max, config.ngram_min, native))
        if config.method in ("suffix", "auto"):
            if pool is None:
                pool = SuffixPool(config.ngram_min, config.ngram_max, config.num_speculative_tokens,
                                  config.suffix_pool_tokens)
            proposers.append(SuffixPoolProposer("suffix" + suffix, pool, min_n, learns=not suffix))
    if config.method == "draft":
        if draft is None:
            raise ValueError("method 'draft' needs the draft model's proposer")
        proposers.append(draft)
    return DraftSpeculator(proposers, config.num_speculative_tokens, config.min_acceptance)


def ngram_tiers(ngram_min: int, ngram_max: int) -> list[int]:
    """The shortest match of each lookup tier, longest first: matches of two or more tokens, then (where
    ``ngram_min`` is 1) single tokens; a config without room for both has one tier."""
    if ngram_min == 1 and ngram_max >= 2:
        return [2, 1]
    return [ngram_min]
