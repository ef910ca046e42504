"""Iteration-level scheduler: waiting / running / swapped queues over a BlockManager.

Pure and deterministic: reads time only from the injected Clock. Standard library and
pydantic only; never torch.

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

from collections.abc import Callable

from engine.block_manager import BlockManager
from engine.clock import Clock
from engine.config import SchedulerConfig
from engine.errors import InvariantError
from engine.outputs import ModelOutput, SchedulerOutput
from engine.preemption import Preemptor
from engine.request import PreemptionCause, Request, RequestStatus
from engine.request_queue import RequestQueues
from engine.scheduler_policy import UrgencyKey, is_decode, queue_key, urgency_key
from engine.scheduler_stats import SchedulerStats
from engine.scheduler_step import StepPlan


class Scheduler:
    """Decides, once per engine step, which requests run how many tokens, and what to swap.

    Order each step: running decodes, then running (chunked) prefills, then swapped and
    waiting requests merged by ``queue_key`` (a swapped request resumes before a new admission
    of equal effective priority). Admission stops at the first request that cannot be placed
    (head-of-line), so nothing less urgent takes the room a more urgent request waits for.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, clock: Clock) -> None:
        """Create an empty scheduler.

        Args:
            config: budgets and policy.
            block_manager: the KV block pools (owned by this scheduler from now on).
            clock: the only source of time.
        """
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self._queues = RequestQueues()
        self._finished_request_ids: list[str] = []  # finished since the last schedule()
        self._next_seq_no = 0
        self._stats = SchedulerStats()
        self._preemptor = Preemptor(config, block_manager, self._queues, self._stats)

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

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None (unknown or already finished)."""
        return self._queues.requests.get(request_id)

    def add_request(self, request: Request) -> None:
        """Queue a new request as WAITING; assign its seq_no and start its aging clock.

        A request that could never fit in the device pool is finished at once with
        FINISHED_ERROR (its id appears in the next output's ``finished_request_ids``).

        Raises:
            ValueError: a request with this id is already unfinished here.
        """
        self._queues.add(request)
        request.seq_no = self._next_seq_no
        self._next_seq_no += 1
        request.waiting_since_s = self.clock.now()
        if self.block_manager.num_blocks_for(request.max_total_tokens) > self.block_manager.num_gpu_blocks:
            self._finish_with_error(request)

    def schedule(self) -> SchedulerOutput:
        """Plan one step within every budget; preempt when blocks or priority require it.

        Returns:
            What to run (chunks), swap (block pairs), and who was preempted or finished.
        """
        plan = StepPlan.start(self.config, self._stats.num_steps, self.clock.now())
        self._preemptor.mark_demoted()
        self._schedule_running(plan)
        for request in sorted(self._queues.swapped + self._queues.waiting, key=self._queue_key(plan)):
            if request.request_id in plan.preempted_request_ids:
                break  # memory is short: admit nothing behind a request just preempted
            if request.status is RequestStatus.SWAPPED:
                is_placed = self._schedule_swapped(request, plan)
            else:
                is_placed = self._schedule_waiting(request, plan)
            if not is_placed:
                break  # head-of-line: nothing less urgent may take the room it waits for
        self._stats.num_steps += 1
        finished_request_ids, self._finished_request_ids = self._finished_request_ids, []
        return plan.build_output(self._queues.requests, self.block_manager, finished_request_ids)

    def update(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> list[Request]:
        """Apply one executed step: advance computed tokens and append sampled tokens.

        Does not decide stopping; the engine calls :meth:`finish_request` for that.
        Chunks of requests finished since ``schedule()`` are skipped.

        Returns:
            The requests that received new tokens, in chunk order.

        Raises:
            InvariantError: the output does not match the plan (wrong position, missing sample).
        """
        now_s = self.clock.now()
        updated: list[Request] = []
        for chunk in scheduler_output.chunks:
            request = self._queues.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens != chunk.start_position:
                raise InvariantError(f"{chunk.request_id}: chunk at {chunk.start_position}, "
                                     f"computed {request.num_computed_tokens}")
            if is_decode(request):
                request.num_steps_since_admitted += 1
            request.num_computed_tokens += chunk.num_tokens
            new_token_ids = model_output.sampled_token_ids.get(chunk.request_id, [])
            if bool(new_token_ids) != chunk.needs_sample:
                raise InvariantError(f"{chunk.request_id}: needs_sample={chunk.needs_sample}, "
                                     f"got {len(new_token_ids)} tokens")
            if new_token_ids:
                request.output_token_ids.extend(new_token_ids)
                if request.first_token_time_s is None:
                    request.first_token_time_s = now_s
                updated.append(request)
        return updated

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request: drop it from its queue and free its blocks in both pools.

        Unknown or already finished ids are ignored (abort is idempotent).

        Raises:
            ValueError: ``status`` is not a finished status.
        """
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished status")
        request = self._queues.remove(request_id)
        if request is None:
            return
        self.block_manager.free(request_id)
        request.status = status
        request.finished_time_s = self.clock.now()
        self._finished_request_ids.append(request_id)

    def stats(self) -> dict[str, int | float]:
        """Queue lengths, block usage per pool, and the cumulative counters of SchedulerStats."""
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_swapped": self.num_swapped,
            **self.block_manager.usage(),
            **self._stats.as_dict(),
        }

    def check_invariants(self) -> None:
        """Raise InvariantError unless queues, statuses and block ownership agree."""
        self.block_manager.check_invariants()
        self._queues.check_invariants(self.block_manager, self.config.max_num_seqs)

    # ----------------------------------------------------------------- the step's phases

    def _schedule_running(self, plan: StepPlan) -> None:
        """Give every running request its next tokens: decodes first, then chunked prefills."""
        by_urgency = sorted(self._queues.running, key=self._urgency_key(plan))
        decodes = [r for r in by_urgency if is_decode(r)]
        prefills = [r for r in by_urgency if not is_decode(r)]
        for request in decodes + prefills:
            if request.status is RequestStatus.RUNNING:  # not preempted earlier in this loop
                self._schedule_running_request(request, plan)

    def _schedule_running_request(self, request: Request, plan: StepPlan) -> None:
        """Schedule one running request, preempting others (MEMORY) if its blocks run out."""
        num_tokens = plan.num_tokens_for(request)
        if num_tokens == 0:
            return
        while (num_fit := min(num_tokens, self._num_free_slots(request))) == 0:
            victim = self._preemptor.pick_memory_victim(request, plan)
            if victim is None:  # alone and still out of blocks: it can never fit
                self._finish_with_error(request)
                return
            self._preemptor.preempt(victim, PreemptionCause.MEMORY, plan)
            if victim is request:
                return
        # NOTE: a prefill chunk shrinks to the free slots instead of preempting anyone.
        self._append_slots(request, request.num_computed_tokens + num_fit)
        plan.add(request, num_fit)

    def _schedule_swapped(self, request: Request, plan: StepPlan) -> bool:
        """Swap a request back in and schedule its next tokens; False if it cannot be placed."""
        num_tokens = plan.num_tokens_for(request)
        if num_tokens == 0:
            return False
        num_needed_tokens = request.num_computed_tokens + num_tokens
        if not self._preemptor.make_room(request, self.block_manager.num_blocks_for(num_needed_tokens), plan):
            return self._finish_if_never_fits(request, plan)
        mapping = self.block_manager.swap_in(request.request_id)
        if mapping is None:
            raise InvariantError(f"swap-in of {request.request_id} failed after room was made")
        plan.swap_in.extend(mapping)
        self._stats.num_swap_ins += 1
        self._stats.num_swapped_in_blocks += len(mapping)
        self._admit(request, num_tokens, plan)
        return True

    def _schedule_waiting(self, request: Request, plan: StepPlan) -> bool:
        """Admit a waiting request with its first chunk; False if it cannot be placed."""
        num_tokens = plan.num_tokens_for(request)
        if num_tokens == 0:
            return False
        # NOTE: the watermark spares blocks for running decodes; with nothing running it would only block.
        num_reserved_blocks = self.config.watermark_blocks if self._queues.running else 0
        num_blocks = self.block_manager.num_blocks_for(num_tokens) + num_reserved_blocks
        if not self._preemptor.make_room(request, num_blocks, plan):
            return self._finish_if_never_fits(request, plan)
        self._admit(request, num_tokens, plan)
        return True

    # --------------------------------------------------------------------------- helpers

    def _admit(self, request: Request, num_tokens: int, plan: StepPlan) -> None:
        """Move a placed request to RUNNING, allocate its chunk's slots and schedule the chunk."""
        self._append_slots(request, request.num_computed_tokens + num_tokens)
        self._queues.move(request, RequestStatus.RUNNING, plan.index)
        request.num_steps_since_admitted = 0
        request.is_demoted = False
        if request.first_scheduled_time_s is None:
            request.first_scheduled_time_s = plan.now_s
        plan.admitted_request_ids.add(request.request_id)
        plan.add(request, num_tokens)

    def _append_slots(self, request: Request, num_tokens: int) -> None:
        if self.block_manager.append_slots(request.request_id, num_tokens) is None:
            raise InvariantError(f"no blocks for {request.request_id} after room was checked")

    def _num_free_slots(self, request: Request) -> int:
        """Tokens the request can add to its device table, counting free blocks."""
        num_blocks = len(self.block_manager.get_block_ids(request.request_id))
        num_blocks += self.block_manager.num_free_gpu_blocks
        return num_blocks * self.block_manager.block_size - request.num_computed_tokens

    def _finish_if_never_fits(self, request: Request, plan: StepPlan) -> bool:
        """If nothing else holds device blocks, the request can never fit: finish it with an error."""
        if self._queues.running or plan.swap_in:
            return False
        self._finish_with_error(request)
        return True

    def _finish_with_error(self, request: Request) -> None:
        self._stats.num_finished_errors += 1
        self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)

    def _urgency_key(self, plan: StepPlan) -> Callable[[Request], UrgencyKey]:
        return lambda r: urgency_key(r, plan.now_s, self.config.aging_interval_s)

    def _queue_key(self, plan: StepPlan) -> Callable[[Request], tuple[int, int, float, int]]:
        return lambda r: queue_key(r, plan.now_s, self.config.aging_interval_s)
