"""Iteration-level scheduler: waiting / running / swapped queues over a BlockManager.

Pure and deterministic: reads time only from the injected Clock. Standard library and
pydantic only; never torch. It holds the engine's one registry of live requests.

Hysteresis rule (``min_resident_steps``): a request is *protected* during the step it is
admitted or resumed and the next ``min_resident_steps - 1`` steps. Protected requests are never
chosen for PRIORITY or STARVATION preemption. MEMORY preemption (a running request R needs
blocks for its next tokens) only takes requests that are demoted or less urgent than R:
an unprotected one if any; else, so that running decodes always make progress, a protected
one; else R itself yields its blocks. It never evicts a more urgent request for R, and R is
the victim only when no other request qualifies. A request alone that still cannot grow can
never fit and is finished with FINISHED_ERROR.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from typing import Literal

from tokenmill.engine.config import SchedulerConfig
from tokenmill.engine.core.clock import Clock
from tokenmill.engine.core.kv_budget import PredictedKvBudget
from tokenmill.engine.core.length_predictor import LengthPredictor
from tokenmill.engine.core.preemption import PreemptionPolicy
from tokenmill.engine.core.request import ParallelGroup, PreemptionCause, Request, RequestStatus, find_stop
from tokenmill.engine.core.request_queue import RequestQueues
from tokenmill.engine.core.scheduler_policy import (
    AdmissionKey,
    admission_key,
    effective_priority,
    is_decode,
    running_order_key,
    urgency_key,
)
from tokenmill.engine.core.speculation import DraftRoom, Speculator
from tokenmill.engine.core.stats import EngineStats, GroupBacklog, LengthStats, SchedulerCounters, SpeculationCounters
from tokenmill.engine.core.step_io import ModelOutput, ScheduledChunk, SchedulerOutput
from tokenmill.engine.core.step_plan import StepPlan
from tokenmill.engine.errors import InvariantError
from tokenmill.engine.kv.block_manager import BlockManager
from tokenmill.engine.kv.prefix_cache import PrefixCache, PrefixStats
from tokenmill.protocol.outcomes import ErrorCode

logger = logging.getLogger(__name__)

# schedule_ahead: while requests wait or a speculator may draft, a full schedule() runs at least every this many steps
# (priority aging, the long-output limit and the speculator act there; arrivals and resumptions get one at once)
FULL_SCHEDULE_EVERY = 8
# the input of a chunk planned ahead until the engine writes in the token the step before samples (never embedded)
PLACEHOLDER_TOKEN_ID = -1
# which prompt blocks the scheduler collects for publishing (Scheduler's ``collects_prompt_blocks``)
PromptBlockCollection = Literal["none", "computed", "reused"]


class Scheduler:
    """Decides, once per engine step, which requests run how many tokens, and what to swap;
    then applies the step's sampled tokens and decides who stopped.

    Order each step: running decodes, then running (chunked) prefills, then swapped and
    waiting requests merged by ``admission_key`` (a swapped request resumes before a new admission
    of equal effective priority). Admission stops at the first request that cannot be placed
    (head-of-line), so nothing less urgent takes the room a more urgent request waits for.

    Args:
        config: budgets and policy.
        block_manager: the KV block pools (owned by this scheduler from now on).
        clock: the only source of time.
        eos_token_ids: the model's end-of-sequence ids (see :func:`engine.core.request.find_stop`).
        max_model_len: the model's context length; None = unbounded.
        prefix_cache: an index of cached full blocks over ``block_manager``'s device pool (new
            requests start after the blocks it already holds); None = every prompt is computed.
        speculator: proposes draft tokens for decodes, run with what the step's budget and the
            free blocks leave once every real token is scheduled; None = no speculative decoding.
        length_predictor: predicts output lengths (engine/core/length_predictor.py); with its config's ``budget_kv``
            admission keeps the predicted peak KV within the pool (engine/core/kv_budget.py), and its
            ``ordering`` orders waiting requests inside a priority level. None = neither.
        collects_prompt_blocks: which prompt blocks :meth:`take_new_prompt_blocks` hands out, for something that
            publishes them (the fleet cache, engine/core/fleet_cache.py): "computed" = each one the prefix cache
            indexes, "reused" = those an admission finds in the prefix cache (a second request uses them: shared),
            "none" = none (nothing publishes them).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, clock: Clock,
                 eos_token_ids: frozenset[int] = frozenset(), max_model_len: int | None = None,
                 prefix_cache: PrefixCache | None = None, speculator: Speculator | None = None,
                 length_predictor: LengthPredictor | None = None,
                 collects_prompt_blocks: PromptBlockCollection = "none") -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.prefix_cache = prefix_cache
        self.speculator = speculator
        self.length_predictor = length_predictor
        self._kv_budget = None
        if length_predictor is not None and length_predictor.config.budget_kv:
            self._kv_budget = PredictedKvBudget(block_manager.num_gpu_blocks, block_manager.block_size,
                                                length_predictor.current, length_predictor.config.tail_quantile)
        self.counters = SchedulerCounters()
        # NOTE: the queues keep the waiting and swapped requests in admission order as they come and go. First come,
        # first served (the default), a request's key stays while it waits; by predicted length, the kept keys are
        # made anew when a waiting request's prediction may have moved (_keep_length_order)
        aging_interval_s = config.aging_interval_s
        self._is_fcfs = length_predictor is None or length_predictor.config.ordering == "fcfs"
        self._length_sign = 1.0  # shortest first (1) or longest (-1), as the kept length keys were made
        self._length_keys_until = 0  # the predictor's history size from which a kept length key may be stale
        self._queues = RequestQueues(
            (lambda r: admission_key(r, aging_interval_s)) if self._is_fcfs else self._length_admission_key,
            is_key_fixed=self._is_fcfs, running_key=lambda r: running_order_key(r, aging_interval_s))
        self._finished: list[Request] = []  # finished since the last take_finished()
        self._groups: dict[str, ParallelGroup] = {}  # n > 1 requests that forked, until every sample finished
        self._next_seq_no = 0
        # the predicted-KV budget's pacing of long admissions (_is_paced): the last paced request, the output tokens
        # it should have before the next, and the step by which pacing ends anyway
        self._paced_after: tuple[Request, float, float] | None = None
        self._policy = PreemptionPolicy(config, block_manager, self._queues)
        # prompt blocks to publish since the last take_new_prompt_blocks() (as collects_prompt_blocks says)
        self.collects_prompt_blocks = collects_prompt_blocks
        self._new_prompt_blocks: list[tuple[Request, int, int]] = []
        # schedule_ahead: whether a request arrived since the last full schedule(), and that schedule's step
        self._needs_full_schedule = False
        self._last_full_schedule = 0

    @property
    def num_waiting(self) -> int:
        return len(self._queues.waiting)

    @property
    def num_running(self) -> int:
        return len(self._queues.running)

    @property
    def num_swapped(self) -> int:
        return len(self._queues.swapped)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or swapped."""
        return bool(self._queues.requests)

    def is_live(self, request_id: str) -> bool:
        """Whether the id names an unfinished request, or an n > 1 request with unfinished samples."""
        return request_id in self._queues.requests or request_id in self._groups

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None (unknown or already finished)."""
        return self._queues.requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a new request as WAITING; assign its seq_no and start its aging clock.

        A request that could never fit in the device pool is finished at once with
        FINISHED_ERROR (it comes out of the next :meth:`take_finished`).

        Raises:
            ValueError: a request with this id is already unfinished here.
        """
        if self.is_live(request.request_id):
            raise ValueError(f"request {request.request_id!r} is already queued")
        if request.is_fork_pending and request.num_prompt_tokens == 1:  # nothing to share: fork at once
            self._add_samples(request, self._fork(request, is_running=False))
            return
        self._queues.add(request)
        self._needs_full_schedule = True
        request.seq_no = self._next_seq_no
        self._next_seq_no += 1
        request.waiting_since_s = self.clock.now()
        if self.block_manager.num_blocks_for(request.max_total_tokens) > self.block_manager.num_gpu_blocks:
            self._finish_with_error(request)
        elif self.length_predictor is not None:
            self.length_predictor.current(request)

    def schedule(self) -> SchedulerOutput:
        """Plan one step within every budget; preempt when blocks or priority require it.

        Returns:
            What to run (chunks, with what the runner needs to sample), swap (block pairs),
            and who was preempted.
        """
        plan = StepPlan.start(self.config, self.counters.num_steps, self.clock.now())
        self._needs_full_schedule = False
        self._last_full_schedule = self.counters.num_steps
        # NOTE: only an n > 1 request before its fork takes more than one seat: none running, none to look for
        if self._queues.num_running_seats > len(self._queues.running):
            for parent in [r for r in self._queues.running if r.is_fork_pending]:
                if parent.num_computed_tokens == parent.num_schedulable_tokens:
                    self._add_samples(parent, self._fork(parent, is_running=True), plan.index)
        for request in self._policy.requests_to_demote():
            request.is_demoted = True
        self._schedule_running(plan)
        if not self._is_fcfs:
            self._keep_length_order()
        for request in self._queues.in_admission_order():
            if request.request_id in plan.preempted_request_ids:
                break  # memory is short: admit nothing behind a request just preempted
            if request.status is RequestStatus.SWAPPED:
                if plan.backfill_steps is not None:
                    break  # only new requests backfill
                is_placed = self._schedule_swapped(request, plan)
            else:
                if not self._policy.may_seat(request, plan.now_s):
                    # NOTE: the batch is full and nobody may yield: the checks below (its prefix match, O(prompt))
                    # would run every step a backlog waits, to place nothing
                    break
                if request.is_fetching_kv:
                    continue  # NOTE: its prompt blocks are on their way from the fleet's store
                if self._is_paced(request, plan):
                    if plan.num_paced_skips_left > 0:
                        plan.num_paced_skips_left -= 1
                        continue  # NOTE: it waits for its turn; the requests behind it may run
                    break
                if not self._kv_budget_allows(request, plan):
                    if plan.num_backfill_checks_left > 0:
                        plan.num_backfill_checks_left -= 1
                        continue
                    break
                hit = self._prefix_hit(request)
                if self._waits_for_inflight_prefix(request, hit[1], plan):
                    continue  # it takes those blocks from the cache next step instead of computing them too
                is_placed = self._schedule_waiting(request, hit, plan)
                if is_placed and self._kv_budget is not None:
                    num_tokens = self._kv_budget.pacing_tokens(request)
                    if num_tokens >= 1:
                        self._paced_after = (request, num_tokens, plan.index + num_tokens)
            if not is_placed:
                break  # head-of-line: nothing less urgent may take the room it waits for
        if self.speculator is not None:
            self._schedule_drafts(plan, self.speculator)
        self.counters.num_steps += 1
        return plan.build_output(self._queues.requests, self.block_manager)

    def schedule_ahead(self, inflight: SchedulerOutput) -> SchedulerOutput | None:
        """Plan the step after ``inflight`` while that step still runs on the device (async scheduling).

        Every request of ``inflight`` decodes the token after the one ``inflight`` samples for it; that token is not
        known yet, so the chunk carries a placeholder (``takes_last_token``) that the engine fills on its device
        thread just before the forward. Only the steady state of a decoding batch is planned ahead; anything that
        needs what ``inflight`` returns, or a decision of the full :meth:`schedule`, gives None, and the engine
        lands ``inflight`` and schedules as usual:

        - arrivals and resumptions (a request added since the last full schedule, a swapped one, free seats
          while requests wait), demotions, and a full schedule every :data:`FULL_SCHEDULE_EVERY` steps while
          requests wait (priority aging, the long-output limit);
        - a running request ``inflight`` does not hold, one whose chunk there has drafts (a draft needs the tokens
          before it: while the speculator drafts, steps are scheduled in full; a step planned ahead drafts nothing,
          and with a speculator a request's first decode and a full schedule every :data:`FULL_SCHEDULE_EVERY` steps
          ask it again) or samples nothing, an ``n > 1`` request before its fork;
        - a request whose sampling reads its own tokens on the device thread (penalties, a grammar);
        - a step that would need a copy-on-write, a preemption, or more blocks or budget than there is.

        A request the in-flight token may end still runs ahead if only its text can say so (EOS, stop ids and
        strings): that step's token is dropped when the request is found finished (``update`` skips the chunks of
        finished requests) and nothing past the stop is emitted. One that the in-flight token ends for sure
        (``max_tokens``, the model's context) is left out.
        """
        queues = self._queues
        if (self._needs_full_schedule or queues.swapped or not inflight.chunks
                or len(inflight.chunks) != len(queues.running)):
            return None
        is_full_schedule_due = self.counters.num_steps - self._last_full_schedule >= FULL_SCHEDULE_EVERY
        if self.speculator is not None and is_full_schedule_due:
            return None  # NOTE: the full schedule asks the speculator; while it drafts, steps are not planned ahead
        if queues.waiting and (is_full_schedule_due or self._policy.has_room(0, 0, 0)
                               or any(r.is_demoted for r in queues.running) or self._policy.requests_to_demote()):
            return None
        plan = StepPlan.start(self.config, self.counters.num_steps, self.clock.now())
        if len(inflight.chunks) > min(plan.num_tokens_left, plan.num_decode_tokens_left):
            return None
        bm = self.block_manager
        ahead: list[tuple[Request, int]] = []
        num_new_blocks = 0
        for chunk in inflight.chunks:
            request = queues.requests.get(chunk.request_id)
            if (request is None or request.status is not RequestStatus.RUNNING or not chunk.needs_sample
                    or chunk.num_draft_tokens or request.is_fork_pending
                    or request.num_computed_tokens != chunk.start_position):
                return None
            params = request.sampling_params
            if params.has_penalties or params.is_structured:
                return None
            if self.speculator is not None and chunk.num_output_tokens == 0:
                return None  # NOTE: its first decode is scheduled in full, so the speculator gets to draft for it
            position = chunk.start_position + chunk.num_tokens  # where the token in flight goes
            if bm.num_copies_on_write(request.request_id, position):
                return None
            is_context_full = self.max_model_len is not None and request.num_tokens + 1 >= self.max_model_len
            if request.num_output_tokens + 1 >= request.max_tokens or is_context_full:
                continue  # the token in flight is its last
            num_new_blocks += bm.num_new_blocks(request.request_id, position + 1)
            ahead.append((request, position))
        if num_new_blocks > bm.num_free_gpu_blocks:
            return None
        chunks: list[ScheduledChunk] = []
        for request, position in ahead:
            if bm.append_slots(request.request_id, position + 1) is None:
                raise InvariantError(f"no blocks for {request.request_id} after room was checked")
            chunks.append(ScheduledChunk(
                request_id=request.request_id, token_ids=[PLACEHOLDER_TOKEN_ID], start_position=position,
                block_ids=bm.block_table(request.request_id), needs_sample=True,
                sampling_params=request.sampling_params, num_output_tokens=request.num_output_tokens + 1,
                sampling_state=request.sampling_state, takes_last_token=True,
            ))
        self.counters.num_steps += 1
        self.counters.num_steps_ahead += 1
        return SchedulerOutput(chunks=chunks)

    def update(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> list[Request]:
        """Apply one executed step: advance computed tokens, append sampled tokens, and finish
        the requests whose new token ends them (:func:`engine.core.request.find_stop`).

        Chunks of requests finished since ``schedule()`` are skipped.

        Returns:
            The requests that received new tokens, in chunk order (finished ones included).

        Raises:
            InvariantError: the output does not match the plan (wrong position, missing sample).
        """
        now_s = self.clock.now()
        updated: list[Request] = []
        requests, sampled_token_ids, running = self._queues.requests, model_output.sampled_token_ids, \
            RequestStatus.RUNNING
        prefix_cache, block_size = self.prefix_cache, self.block_manager.block_size
        outcomes: list[tuple[Request, int, int]] = []  # the verified drafts': (request, drafted, accepted)
        for chunk in scheduler_output.chunks:
            request = requests.get(chunk.request_id)
            if request is None or request.status is not running:
                continue
            if request.num_computed_tokens != chunk.start_position:
                raise InvariantError(f"{chunk.request_id}: chunk at {chunk.start_position}, "
                                     f"computed {request.num_computed_tokens}")
            if is_decode(request):
                request.num_steps_since_admitted += 1
            new_token_ids = sampled_token_ids.get(chunk.request_id, [])
            num_accepted = 0
            num_drafts = chunk.num_draft_tokens
            if num_drafts:
                # NOTE: the runner kept what accept_drafts allows: 1 to k + 1 tokens, all but the last the draft's
                # (the chunk's last k tokens)
                num_accepted = len(new_token_ids) - 1
                first_draft = len(chunk.token_ids) - num_drafts
                if not 0 <= num_accepted <= num_drafts or \
                        new_token_ids[:-1] != chunk.token_ids[first_draft:first_draft + num_accepted]:
                    raise InvariantError(f"{chunk.request_id}: kept {new_token_ids} of draft {chunk.draft_token_ids}")
                request.num_computed_tokens += 1 + num_accepted
                if num_accepted < num_drafts:
                    # NOTE: only verified tokens reach the prefix cache; the rejected drafts' slots go back.
                    self.block_manager.trim(request.request_id, request.num_computed_tokens)
                request.draft_token_ids = []
                outcomes.append((request, num_drafts, num_accepted))
            else:
                if len(new_token_ids) != int(chunk.needs_sample):
                    raise InvariantError(f"{chunk.request_id}: needs_sample={chunk.needs_sample}, "
                                         f"got {len(new_token_ids)} tokens")
                request.num_computed_tokens += len(chunk.token_ids)
            # NOTE: only when a block filled up
            if prefix_cache is not None and request.num_computed_tokens // block_size > len(request.prefix_entry_ids):
                # NOTE: the tokens from the first block not indexed yet, and the verified ones not appended yet: not the
                # whole context, whose copy would grow with it
                first_token = len(request.prefix_entry_ids) * self.block_manager.block_size
                known_token_ids = request.token_slice(first_token, request.num_tokens) + new_token_ids[:num_accepted]
                block_ids = self.block_manager.get_block_ids(request.request_id)
                indexed = prefix_cache.register(known_token_ids, block_ids, request.prefix_entry_ids,
                                                request.num_computed_tokens, first_token)
                if self.collects_prompt_blocks == "computed" and indexed:
                    num_prompt_blocks = request.num_prompt_tokens // self.block_manager.block_size
                    self._new_prompt_blocks.extend((request, i, block_ids[i]) for i in indexed
                                                   if i < num_prompt_blocks)
            if new_token_ids:
                self._append_tokens(request, new_token_ids, model_output.logprobs.get(chunk.request_id), now_s)
                updated.append(request)
        if outcomes and self.speculator is not None:
            self.speculator.observe(outcomes)
        return updated

    def finish_request(self, request_id: str, status: RequestStatus, error_code: ErrorCode | None = None,
                       error_message: str | None = None) -> None:
        """Finish a request: drop it from its queue and free its blocks in both pools.

        Unknown or already finished ids are ignored (abort is idempotent).

        Raises:
            ValueError: ``status`` is not a finished status.
        """
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished status")
        group = self._groups.get(request_id)
        if group is not None:  # the caller's id of an n > 1 request: every live sample
            live = [r for r in self._queues.requests.values() if r.group is group]
            for sample in live:
                self.finish_request(sample.request_id, status, error_code, error_message)
            return
        request = self._queues.remove(request_id)
        if request is None:
            return
        self.block_manager.free(request_id)
        request.status = status
        request.error_code, request.error_message = error_code, error_message
        request.finished_time_s = self.clock.now()
        request.draft_token_ids = []
        if self.speculator is not None:
            self.speculator.finished(request)
        if self.length_predictor is not None:
            if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self.length_predictor.observe(request)
            else:
                self.length_predictor.forget(request)
        self._finished.append(request)
        if request.group is not None:
            request.group.finished.append(request)
            if request.group.is_finished:
                del self._groups[request.group.request_id]

    def has_finished(self) -> bool:
        """Whether requests finished since the last :meth:`take_finished`."""
        return bool(self._finished)

    def take_new_prompt_blocks(self) -> list[tuple[Request, int, int]]:
        """``(request, block index, device block id)`` of the prompt blocks to publish since the last call (as
        :attr:`collects_prompt_blocks` says): verified and full."""
        blocks, self._new_prompt_blocks = self._new_prompt_blocks, []
        return blocks

    def take_finished(self) -> list[Request]:
        """The requests finished since the last call, in the order they finished."""
        finished, self._finished = self._finished, []
        return finished

    def stats(self) -> EngineStats:
        """Queue lengths, block usage per pool, and the cumulative counters."""
        bm = self.block_manager
        return EngineStats(
            num_running=self.num_running, num_waiting=self.num_waiting, num_swapped=self.num_swapped,
            num_used_gpu_blocks=bm.num_gpu_blocks - bm.num_free_gpu_blocks, num_gpu_blocks=bm.num_gpu_blocks,
            num_used_cpu_blocks=bm.num_cpu_blocks - bm.num_free_cpu_blocks, num_cpu_blocks=bm.num_cpu_blocks,
            counters=dataclasses.replace(self.counters,
                                         cause_to_num_preemptions=dict(self.counters.cause_to_num_preemptions)),
            prefix=dataclasses.replace(self.prefix_cache.stats) if self.prefix_cache else PrefixStats(),
            num_cached_blocks=self.prefix_cache.num_cached_blocks if self.prefix_cache else 0,
            speculation=self.speculator.counters.copy() if self.speculator else SpeculationCounters(),
            length=self._length_stats(),
        )

    def _length_stats(self) -> LengthStats:
        """The predictor's counters and errors, and the predicted output tokens still to come: in all and per
        length group (its live requests, and the mean length it predicts for a new one)."""
        predictor = self.length_predictor
        if predictor is None:
            return LengthStats()
        backlog = 0.0
        group_to_counts: dict[str, list[float]] = {}
        for request in self._queues.requests.values():
            tokens = predictor.current(request).mean_remaining(request.num_output_tokens) * request.num_seats
            backlog += tokens
            group = request.length_state.group
            if group is not None:
                counts = group_to_counts.setdefault(group, [0, 0.0])
                counts[0] += request.num_seats
                counts[1] += tokens
        error, baseline_error = predictor.errors()
        return LengthStats(
            is_on=True, num_observed=predictor.num_observed, num_estimates=predictor.num_estimates,
            num_outlived=predictor.num_outlived, num_deferred_admissions=self.counters.num_deferred_admissions,
            backlog_tokens=backlog,
            group_backlog={group: GroupBacklog(int(num), tokens, predictor.group_mean_length(group))
                           for group, (num, tokens) in group_to_counts.items()},
            mean_length=predictor.group_mean_length(None),
            log_error=error, max_tokens_log_error=baseline_error,
        )

    def check_invariants(self) -> None:
        """Raise InvariantError unless queues, statuses and block ownership agree, and the running requests are kept
        in urgency order (``urgency_key`` now)."""
        self.block_manager.check_invariants()
        self._queues.check_invariants(self.block_manager, self.config.max_num_seqs)
        now_s, aging_interval_s = self.clock.now(), self.config.aging_interval_s
        if self._queues.running_in_order() != sorted(self._queues.running,
                                                      key=lambda r: urgency_key(r, now_s, aging_interval_s)):
            raise InvariantError("the running requests are not kept in urgency order")
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants()

    # ----------------------------------------------------------------- the step's phases

    def _schedule_running(self, plan: StepPlan) -> None:
        """Give every running request its next tokens: decodes first, then chunked prefills."""
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self._queues.running_in_order():  # NOTE: urgency order, kept (running_order_key)
            (decodes if is_decode(request) else prefills).append(request)
        slots = [(request.request_id, request.num_computed_tokens) for request in decodes]
        needing = self._fits_without_preemption(slots, plan)
        if needing is not None:
            self._schedule_decodes(decodes, needing, plan)
            decodes = []
        for request in decodes + prefills:
            if request.status is RequestStatus.RUNNING:  # not preempted earlier in this loop
                self._schedule_running_request(request, plan)

    def _fits_without_preemption(self, slots: list[tuple[str, int]], plan: StepPlan) -> list[tuple[str, int]] | None:
        """Whether every decode (``(request id, position)`` each) gets its token this step with no one preempted:
        the budgets hold them all and the free blocks cover every new block they need (one where a block is full,
        one where a shared block is copied first). Then the per-request checks of
        :meth:`_schedule_running_request` cannot fail, and :meth:`_schedule_decodes` skips them (the steady state
        of a running batch).

        Returns:
            The slots that need a block (``BlockManager.blocks_for_decodes``) when all fit; None when they do not.
        """
        if not slots or len(slots) > min(plan.num_tokens_left, plan.num_decode_tokens_left):
            return None
        num_blocks, needing = self.block_manager.blocks_for_decodes(slots)
        return needing if num_blocks <= self.block_manager.num_free_gpu_blocks else None

    def _schedule_decodes(self, decodes: list[Request], needing: list[tuple[str, int]], plan: StepPlan) -> None:
        """Schedule each decode's next token, in order (:meth:`_fits_without_preemption` said they all fit, and which
        of them need a block)."""
        for request_id, position, source, destination in self.block_manager.grow_for_decodes(needing):
            plan.copies[request_id] = (position, source, destination)
        plan.add_decodes(decodes)

    def _schedule_running_request(self, request: Request, plan: StepPlan) -> None:
        """Schedule one running request, preempting others (MEMORY) if its blocks run out.

        A shared block the chunk writes into (a forked sample's last prompt block) is copied first.
        """
        num_tokens = plan.num_tokens_for(request)
        if num_tokens == 0:
            return
        while True:
            num_copies = self.block_manager.num_copies_on_write(request.request_id, request.num_computed_tokens)
            num_fit = min(num_tokens, self._num_free_slots(request) - num_copies * self.block_manager.block_size)
            if num_fit > 0:
                break
            victim = self._policy.memory_victim(request, plan)
            if victim is None:  # alone and still out of blocks: it can never fit
                self._finish_with_error(request)
                return
            self._preempt(victim, PreemptionCause.MEMORY, plan)
            if victim is request:
                return
        copy_pairs = self.block_manager.copy_on_write(request.request_id, request.num_computed_tokens) or []
        for source, destination in copy_pairs:
            plan.copies[request.request_id] = (request.num_computed_tokens, source, destination)
        # NOTE: a prefill chunk shrinks to the free slots instead of preempting anyone.
        self._note_inflight_prefix(request, plan)
        self._append_slots(request, request.num_computed_tokens + num_fit)
        plan.add(request, num_fit)

    def _schedule_swapped(self, request: Request, plan: StepPlan) -> bool:
        """Swap a request back in and schedule its next tokens; False if it cannot be placed."""
        num_tokens = plan.num_tokens_for(request)
        if num_tokens == 0:
            return False
        # NOTE: its host table may hold a block more than its computed tokens need (preempted after
        # a chunk was planned); all of it comes back.
        num_blocks = max(self.block_manager.num_blocks_for(request.num_computed_tokens + num_tokens),
                         len(self.block_manager.get_host_block_ids(request.request_id)))
        if not self._make_room(request, num_blocks, plan):
            return self._finish_if_never_fits(request, plan)
        if not self.block_manager.can_swap_in(request.request_id):
            raise InvariantError(f"no room to swap {request.request_id} in after room was made")
        mapping = self.block_manager.swap_in(request.request_id) or []
        plan.swap_in.extend(mapping)
        self.counters.num_swap_ins += 1
        self.counters.num_swapped_in_blocks += len(mapping)
        self._admit(request, num_tokens, plan)
        return True

    def _schedule_waiting(self, request: Request, hit: tuple[list[int], list[int]], plan: StepPlan) -> bool:
        """Admit a waiting request with its first chunk, after ``hit``, the blocks (and entries) the
        prefix cache already holds for it; False if it cannot be placed."""
        hit_block_ids, hit_entry_ids = hit
        num_hit_tokens = len(hit_block_ids) * self.block_manager.block_size
        num_tokens = plan.num_tokens_for(request, start=num_hit_tokens)
        if num_tokens == 0:
            return False
        # NOTE: the watermark spares blocks for running decodes; with nothing running it would only block.
        num_reserved_blocks = self.config.watermark_blocks if self._queues.running else 0
        num_new_blocks = self.block_manager.num_blocks_for(num_hit_tokens + num_tokens) - len(hit_block_ids)
        num_blocks = num_new_blocks + self.block_manager.num_unused(hit_block_ids) + num_reserved_blocks
        if not self._make_room(request, num_blocks, plan):
            return self._finish_if_never_fits(request, plan)
        # NOTE: a victim may have held hit blocks, now unused: taking them uses room counted as free.
        if self.block_manager.num_free_gpu_blocks < num_new_blocks + self.block_manager.num_unused(hit_block_ids):
            return False
        if self.prefix_cache is not None:
            self.block_manager.share(request.request_id, hit_block_ids)
            request.num_computed_tokens, request.prefix_entry_ids = num_hit_tokens, hit_entry_ids
            request.num_cached_prompt_tokens = num_hit_tokens
            self.prefix_cache.count_query(request.num_schedulable_tokens, num_hit_tokens)
            if self.collects_prompt_blocks == "reused":
                num_prompt_blocks = request.num_prompt_tokens // self.block_manager.block_size
                self._new_prompt_blocks.extend((request, i, block_id) for i, block_id in enumerate(hit_block_ids)
                                               if i < num_prompt_blocks)
        self._admit(request, num_tokens, plan)
        return True

    def _note_inflight_prefix(self, request: Request, plan: StepPlan) -> None:
        """Remember the block a prefill scheduled this step registers next (its first uncached one)."""
        if self.prefix_cache is None or is_decode(request):
            return
        key = self.prefix_cache.next_key(request.all_token_ids, request.prefix_entry_ids,
                                         request.num_schedulable_tokens)
        if key is not None:
            plan.inflight_block_keys.add(key)

    def _waits_for_inflight_prefix(self, request: Request, hit_entry_ids: list[int], plan: StepPlan) -> bool:
        """True when the first block a waiting request misses is being computed by another prefill
        this step: admitted now it would compute the same tokens a second time; a step later it
        finds them cached (requests that arrive together with one long shared prompt).

        NOTE: it waits only while such a prefill is scheduled, so it never waits on a request that
        was preempted or finished.
        """
        if self.prefix_cache is None or not plan.inflight_block_keys:
            return False
        key = self.prefix_cache.next_key(request.all_token_ids, hit_entry_ids, request.num_schedulable_tokens - 1)
        return key is not None and key in plan.inflight_block_keys

    def _prefix_hit(self, request: Request) -> tuple[list[int], list[int]]:
        """The cached blocks (and their entries) the request's leading tokens already have."""
        if self.prefix_cache is None:
            return [], []
        # NOTE: match leaves the last of the tokens it gets uncached: one token is always computed.
        return self.prefix_cache.match(request.all_token_ids[: request.num_schedulable_tokens])

    def _fork(self, parent: Request, is_running: bool) -> list[Request]:
        """The samples of an n > 1 request: each starts where the parent's cache ends (sharing its
        blocks when running) and computes the last prompt token itself, sampling its own tokens."""
        params = parent.sampling_params
        group = ParallelGroup(parent.request_id, params.n)
        self._groups[parent.request_id] = group
        samples = []
        for index in range(params.n):
            sample = Request(ParallelGroup.sample_id(parent.request_id, index), parent.prompt_token_ids,
                             params.for_sample(index), parent.arrival_time_s, parent.priority,
                             num_computed_tokens=parent.num_computed_tokens, group=group, sample_index=index,
                             prefix_entry_ids=list(parent.prefix_entry_ids),
                             first_scheduled_time_s=parent.first_scheduled_time_s,
                             length_state=parent.length_state.for_sample())
            if is_running:
                self.block_manager.fork(parent.request_id, sample.request_id)
            samples.append(sample)
        return samples

    def _add_samples(self, parent: Request, samples: list[Request], step_index: int = 0) -> None:
        """Put the samples where the parent was (running, or waiting) and drop the parent."""
        admitted_step = self._queues.request_to_admitted_step.get(parent.request_id)
        if self._queues.remove(parent.request_id) is not None:
            self.block_manager.free(parent.request_id)
        if self.length_predictor is not None:
            self.length_predictor.forget(parent)
        for sample in samples:
            sample.seq_no = self._next_seq_no
            self._next_seq_no += 1
            sample.waiting_since_s = parent.waiting_since_s if parent.seq_no >= 0 else self.clock.now()
            if admitted_step is not None:
                self._queues.add_running(sample, admitted_step)
            else:
                self._queues.add(sample)

    def _schedule_drafts(self, plan: StepPlan, speculator: Speculator) -> None:
        """Draft tokens for the step's decodes, with what is left once every real token is scheduled:
        the budget's tokens and the free device blocks (above the watermark). A draft never takes room
        a prefill, an admission or a resumption could use, and never preempts anyone."""
        if min(plan.num_tokens_left, plan.num_decode_tokens_left) <= 0:
            return
        requests, prefill_request_ids = self._queues.requests, plan.prefill_request_ids
        max_model_len = self.max_model_len
        candidates: list[tuple[Request, int]] = []
        num_decodes = 0
        for request_id, num_tokens in plan.request_to_num_tokens.items():
            if request_id in prefill_request_ids:
                continue
            num_decodes += 1  # NOTE: a chunk the plan does not count as a prefill is a decode (StepPlan.add)
            if num_tokens != 1:
                continue
            request = requests[request_id]
            params = request.sampling_params
            if not params.speculative:
                continue
            # NOTE: a draft never runs past max_tokens or the context: its last token's successor is the bonus.
            # (max_tokens read from the parameters, resolved at admission: Request.max_tokens without the call; were it
            # not, the stop rule raises, and no draft is planned here)
            num_output = len(request.output_token_ids)
            bound = (params.max_tokens or 0) - num_output - 1
            if max_model_len is not None:
                context_left = max_model_len - len(request.prompt_token_ids) - num_output
                if context_left < bound:
                    bound = context_left
            if bound > 0:
                candidates.append((request, bound))
        if not candidates:
            return
        room = DraftRoom(min(plan.num_tokens_left, plan.num_decode_tokens_left),
                         self.config.max_num_batched_tokens - plan.num_tokens_left, num_decodes)
        try:
            drafts = speculator.draft(candidates, room)
        except Exception:
            logger.warning("the speculator failed; this step runs without drafts", exc_info=True,
                           extra={"event": "speculator_failed"})
            return
        bm = self.block_manager
        block_size, watermark_blocks = bm.block_size, self.config.watermark_blocks
        num_tokens_left = min(plan.num_tokens_left, plan.num_decode_tokens_left)
        planned_ids: list[str] = []  # the drafts planned: each request's id and its draft tokens
        planned_tokens: list[int] = []
        for request, _ in candidates:
            request_id = request.request_id
            draft = drafts.get(request_id)
            if not draft:
                continue
            num_computed = request.num_computed_tokens
            # NOTE: the slots its table holds past its decode token; free blocks (above the watermark) only when the
            # draft needs more
            num_own_slots = bm.num_device_blocks(request_id) * block_size - num_computed - 1
            num_tokens = len(draft)
            if num_tokens > num_tokens_left:
                num_tokens = num_tokens_left
            if num_tokens > num_own_slots:
                spare_blocks = max(0, bm.num_free_gpu_blocks - watermark_blocks)
                num_tokens = min(num_tokens, num_own_slots + spare_blocks * block_size)
                if num_tokens > 0:
                    self._append_slots(request, num_computed + 1 + num_tokens)
            if num_tokens <= 0:
                continue
            request.draft_token_ids = draft if num_tokens == len(draft) else draft[:num_tokens]
            planned_ids.append(request_id)
            planned_tokens.append(num_tokens)
            num_tokens_left -= num_tokens
        plan.add_drafts(planned_ids, planned_tokens)

    # --------------------------------------------------------------------------- helpers

    def _append_tokens(self, request: Request, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                       now_s: float) -> None:
        """Append a step's new tokens up to the first that ends the request, and finish it there."""
        stop = find_stop(request, token_ids, self.eos_token_ids, self.max_model_len)
        if stop is not None:
            token_ids = token_ids[:stop[0] + 1]
        request.output_token_ids.extend(token_ids)
        self.counters.num_generated_tokens += len(token_ids)
        if logprobs:
            request.logprobs.extend(logprobs[:len(token_ids)])
        if request.first_token_time_s is None:
            request.first_token_time_s = now_s
        if stop is not None:
            self.finish_request(request.request_id, stop[1])

    def _make_room(self, request: Request, num_blocks: int, plan: StepPlan) -> bool:
        """Preempt whom the policy names so that ``num_blocks`` and a sequence slot are free."""
        victims = self._policy.victims_for_room(request, num_blocks, plan)
        if victims is None:
            return False
        for victim in victims:
            cause = PreemptionCause.STARVATION if victim.is_demoted else PreemptionCause.PRIORITY
            self._preempt(victim, cause, plan)
        return True

    def _preempt(self, victim: Request, cause: PreemptionCause, plan: StepPlan) -> None:
        """Take the victim's device blocks: swap to the host pool if it has room, else recompute."""
        plan.remove(victim.request_id)
        _, copy_source, copy_destination = plan.copies.pop(victim.request_id, (0, -1, -1))
        is_swap = self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(victim.request_id)
        if is_swap:
            mapping = self.block_manager.swap_out(victim.request_id) or []
            # NOTE: a copy-on-write planned this step never runs for a victim (swap-out comes
            # first): its host block takes the content from the shared source instead.
            plan.swap_out.extend((copy_source if d == copy_destination else d, h) for d, h in mapping)
            self.counters.num_swap_outs += 1
            self.counters.num_swapped_out_blocks += len(mapping)
            self._queues.move(victim, RequestStatus.SWAPPED)
        else:
            self.counters.num_recompute_preemptions += 1
            self.counters.num_recomputed_tokens += victim.num_computed_tokens
            self.block_manager.free(victim.request_id)
            victim.num_computed_tokens = 0
            victim.prefix_entry_ids = []
            self._queues.move(victim, RequestStatus.WAITING)
        if cause is PreemptionCause.STARVATION:
            victim.waiting_since_s = plan.now_s  # NOTE: it had its turn; it ages again from now
        victim.is_demoted = False
        victim.num_preemptions += 1
        self.counters.cause_to_num_preemptions[cause] += 1
        plan.preempted_request_ids.append(victim.request_id)

    def _admit(self, request: Request, num_tokens: int, plan: StepPlan) -> None:
        """Move a placed request to RUNNING, allocate its chunk's slots and schedule the chunk."""
        self._append_slots(request, request.num_computed_tokens + num_tokens)
        self._queues.move(request, RequestStatus.RUNNING, plan.index)
        request.num_steps_since_admitted = 0
        request.is_demoted = False
        if request.first_scheduled_time_s is None:
            request.first_scheduled_time_s = plan.now_s
            if self.length_predictor is not None:
                self.length_predictor.started(request)
                request.length_state.admitted_estimate = self.length_predictor.current(request)
        plan.admitted_request_ids.add(request.request_id)
        self._note_inflight_prefix(request, plan)
        plan.add(request, num_tokens)

    def _append_slots(self, request: Request, num_tokens: int) -> None:
        if not self.block_manager.can_append_slots(request.request_id, num_tokens):
            raise InvariantError(f"no blocks for {request.request_id} after room was checked")
        self.block_manager.append_slots(request.request_id, num_tokens)

    def _num_free_slots(self, request: Request) -> int:
        """Tokens the request can add to its device table, counting free blocks."""
        num_blocks = self.block_manager.num_device_blocks(request.request_id)
        num_blocks += self.block_manager.num_free_gpu_blocks
        return num_blocks * self.block_manager.block_size - request.num_computed_tokens

    def _finish_if_never_fits(self, request: Request, plan: StepPlan) -> bool:
        """If nothing else holds device blocks, the request can never fit: finish it with an error."""
        if self._queues.running or plan.swap_in:
            return False
        self._finish_with_error(request)
        return True

    def _finish_with_error(self, request: Request) -> None:
        self.counters.num_finished_errors += 1
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR, ErrorCode.INTERNAL,
                            "the scheduler could not place this request in the KV cache")

    def _keep_length_order(self) -> None:
        """Where the length config orders admission by predicted length inside a level: the kept keys made anew
        when one may be stale, i.e. the order's direction changed (``auto``: longest first while one job's requests
        alone wait, else shortest) or the history grew to where a waiting request's prediction is redone
        (``LengthPredictor.stable_until``; until then ``current`` gives each the estimate its key was made from)."""
        predictor = self.length_predictor
        if predictor is None:
            raise InvariantError("ordering by predicted length needs the length predictor")
        ordering = predictor.config.ordering
        if ordering == "auto":
            groups = self._queues.waiting_groups
            # NOTE: one job's requests alone: its makespan is what its owner waits for; mixed: completion times.
            ordering = "longest" if len(groups) == 1 and None not in groups else "shortest"
        sign = 1.0 if ordering == "shortest" else -1.0
        if sign != self._length_sign or predictor.num_observed >= self._length_keys_until:
            self._length_sign, self._length_keys_until = sign, sys.maxsize
            self._queues.rekey()

    def _length_admission_key(self, request: Request) -> AdmissionKey:
        """A waiting or swapped request's admission key ordered by predicted length inside its level (the queues make
        it when they first read the request, or after :meth:`_keep_length_order` asked them to)."""
        predictor = self.length_predictor
        assert predictor is not None  # NOTE: _keep_length_order's
        estimate = predictor.current(request)
        self._length_keys_until = min(self._length_keys_until, predictor.stable_until(request))
        # NOTE: a template the history does not know yet runs a few rows first, so that its lengths are learnt:
        # predicted from the job's other answers, its rows would otherwise queue behind every known one.
        length_order = -math.inf if request.length_state.exploring else \
            self._length_sign * estimate.median_remaining(request.num_output_tokens)
        return admission_key(request, self.config.aging_interval_s, length_order)

    def _is_paced(self, request: Request, plan: StepPlan) -> bool:
        """Whether a long request waits for its turn: the last long admission has generated fewer output tokens
        than its pacing interval (``PredictedKvBudget.pacing_tokens``: long requests started together end
        together, in waves that leave the pool half empty on average), and the pool is the limit (with it, the
        committed requests' predicted peak would pass half the pool). Never the only request; never longer than
        the interval counted in steps (at least a token each while that request runs), so a paced request that
        was preempted, or finished early, holds nothing back."""
        budget = self._kv_budget
        if budget is None or not self._queues.running or self._paced_after is None:
            return False
        last, num_tokens, last_step = self._paced_after
        if last.is_finished or last.num_output_tokens >= num_tokens or plan.index >= last_step:
            self._paced_after = None
            return False
        if budget.pacing_tokens(request) < 1:
            return False
        peak_blocks = budget.predicted_peak_blocks([*self._committed_before(request, plan), request])
        if peak_blocks <= budget.num_pool_blocks / 2:
            return False
        self.counters.num_deferred_admissions += 1
        return True

    def _kv_budget_allows(self, request: Request, plan: StepPlan) -> bool:
        """Whether the predicted-KV budget lets a waiting request in this step (always without one).

        The first request it holds back gets a reservation: the steps until the committed requests, finishing
        as predicted, leave it room. Behind it, only requests predicted to be done by then (their prefill steps
        and their remaining length at the budget's quantile) may be admitted, and only if they fit too: they
        use room the held-back request cannot use yet, without delaying it (EASY backfilling), so the pool
        stays used while a long request waits for room.
        """
        budget = self._kv_budget
        if budget is None or self.length_predictor is None:
            return True
        committed = self._committed_before(request, plan)
        if plan.backfill_steps is not None:
            estimate = self.length_predictor.current(request)
            num_prefill_steps = -(-(request.num_tokens - request.num_computed_tokens) // plan.max_prefill_chunk)
            if num_prefill_steps + estimate.high_remaining(request.num_output_tokens) > plan.backfill_steps:
                return False
            return budget.admits(request, committed)
        if budget.admits(request, committed):
            return True
        self.counters.num_deferred_admissions += 1
        plan.backfill_steps = budget.steps_until_admitted(request, committed)
        plan.num_backfill_checks_left = self.config.max_num_seqs
        return False

    def _committed_before(self, request: Request, plan: StepPlan) -> list[Request]:
        """Running requests whose room ``request`` could not take: all of them, or with priority preemption on,
        those at least as urgent as it (the less urgent ones yield their room to it).

        No swapped request: the admission loop reaches a waiting request only once every swapped request ahead
        of it in admission order came back (it runs now) or the loop stopped; one still swapped is behind it
        (aged, demoted or predicted longer) and comes back after it. Counting it would also hold the waiting
        one back on a plan in which it runs, while it cannot come back behind a held-back request: with
        nothing running, nothing would ever be admitted again."""
        committed = self._queues.running
        if not self.config.enable_priority_preemption:
            return committed
        level = effective_priority(request, plan.now_s, self.config.aging_interval_s)
        return [r for r in committed
                if effective_priority(r, plan.now_s, self.config.aging_interval_s) <= level]
