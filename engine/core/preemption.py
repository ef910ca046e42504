"""Preemption policy of the scheduler: who yields device blocks, and hysteresis. It reads the
scheduler's queues and blocks and changes nothing; the scheduler carries its decisions out.

Standard library only. Rules (also in engine/core/scheduler.py):

* PRIORITY / STARVATION (``victims_for_room``): a waiting or swapped request that cannot be placed
  may preempt unprotected running requests that are demoted (long-output limit) or strictly
  less urgent by effective priority; demoted ones go first, then the least urgent.
* MEMORY (``memory_victim``): see the hysteresis rule in engine/core/scheduler.py; a victim
  is always demoted or less urgent than the request that needs the blocks, so memory
  preemption never ping-pongs between two requests.
* The scheduler swaps a victim to the host pool when mode is "swap" and the host pool has
  room, otherwise drops its KV to recompute it later (never an error).
"""

from __future__ import annotations

from operator import attrgetter

from tokenmill.engine.config import SchedulerConfig
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.request_queue import RequestQueues
from tokenmill.engine.core.scheduler_policy import (
    choose_victim,
    effective_priority,
    most_lenient_running_priority,
    room_victims,
    urgency_key,
)
from tokenmill.engine.core.step_plan import StepPlan
from tokenmill.engine.kv.block_manager import BlockManager

_IS_DEMOTED = attrgetter("is_demoted")
_NUM_STEPS_SINCE_ADMITTED = attrgetter("num_steps_since_admitted")


class PreemptionPolicy:
    """Answers "who yields?" for the scheduler; read-only over its queues and block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, queues: RequestQueues) -> None:
        self.config = config
        self.block_manager = block_manager
        self._queues = queues

    def victims_for_room(self, request: Request, num_blocks: int, plan: StepPlan) -> list[Request] | None:
        """Who must yield so that ``num_blocks`` device blocks and a sequence slot are free for ``request``.

        Candidates are unprotected running requests that are demoted (cause STARVATION) or, with
        priority preemption on, strictly less urgent (cause PRIORITY), preferred victim first.

        Returns:
            The victims (empty when the room is already there), or None when even all of the
            candidates together would not make the room: then nobody is preempted.
        """
        seats = request.num_seats
        if self.has_room(num_blocks, 0, 0, seats):
            return []
        if plan.swap_in and self.config.preemption_mode == "swap":
            # NOTE: a swap-out now could reuse host blocks a swap-in of this step still reads.
            return None
        if not self._may_yield_to(request, plan.now_s):
            return None  # NOTE: no candidate at all: what the scan below would find, without it
        victims: list[Request] = []
        num_freed_blocks = 0
        unprotected = [r for r in self._queues.running if not self.is_protected(r, plan)]
        for victim in room_victims(unprotected, request, plan.now_s, self.config.aging_interval_s,
                                   enable_priority_preemption=self.config.enable_priority_preemption):
            if self.has_room(num_blocks, num_freed_blocks, sum(v.num_seats for v in victims), seats):
                break
            victims.append(victim)
            num_freed_blocks += self.block_manager.num_exclusive_blocks(victim.request_id)
        num_freed_seats = sum(v.num_seats for v in victims)
        return victims if self.has_room(num_blocks, num_freed_blocks, num_freed_seats, seats) else None

    def may_seat(self, request: Request, now_s: float) -> bool:
        """Whether ``request`` could take running slots this step: they are free, or a running request may yield
        (:meth:`_may_yield_to`). False says no less urgent request can either (none behind it in admission order is
        more urgent)."""
        return self._queues.num_running_seats + request.num_seats <= self.config.max_num_seqs or \
            self._may_yield_to(request, now_s)

    def _may_yield_to(self, request: Request, now_s: float) -> bool:
        """Whether some running request may be a candidate for ``request``'s room: one is demoted, or (priority
        preemption on) the least urgent one is less urgent than it.

        NOTE: a necessary condition, read without a Python pass over the running requests (one in C for the demoted
        flags, and the running order's last key): while a backlog waits behind a full batch, the head of it asks
        every step, and the scan (hysteresis, effective priorities, a sort) cost a busy echo worker 1,100 opcodes
        per result to find nobody. The running keys are current for requests that are not demoted (a key changes
        only with a demotion's new aging start), and a demoted request answers yes before they are read."""
        if any(map(_IS_DEMOTED, self._queues.running)):
            return True
        least_urgent_key = self._queues.least_urgent_running_key()
        if not self.config.enable_priority_preemption or least_urgent_key is None:
            return False
        aging_interval_s = self.config.aging_interval_s
        return most_lenient_running_priority(least_urgent_key, now_s, aging_interval_s) > \
            effective_priority(request, now_s, aging_interval_s)

    def memory_victim(self, request: Request, plan: StepPlan) -> Request | None:
        """MEMORY victim for ``request``, which needs device blocks for its next tokens.

        Rule (hysteresis included): among the other running requests that are demoted or less
        urgent than ``request``, the preferred unprotected one; if all of those are protected,
        the preferred protected one (running decodes must progress); if there are none,
        ``request`` itself yields. None only if ``request`` runs alone (it can never fit).
        """
        others = [r for r in self._queues.running if r is not request]
        if not others:
            return None
        key = urgency_key(request, plan.now_s, self.config.aging_interval_s)
        lower = [r for r in others if r.is_demoted or urgency_key(r, plan.now_s, self.config.aging_interval_s) > key]
        unprotected = [r for r in lower if not self.is_protected(r, plan)]
        return choose_victim(unprotected or lower or [request], plan.now_s, self.config.aging_interval_s)

    def requests_to_demote(self) -> list[Request]:
        """Long-output limit: while others wait, running requests that decoded too long."""
        limit = self.config.demote_after_decode_steps
        if limit == 0 or not (self._queues.waiting or self._queues.swapped):
            return []
        running = self._queues.running
        if max(map(_NUM_STEPS_SINCE_ADMITTED, running), default=0) <= limit:
            return []  # NOTE: the common answer, in C (asked every step while a backlog waits)
        return [r for r in running if r.num_steps_since_admitted > limit]

    def is_protected(self, request: Request, plan: StepPlan) -> bool:
        """Hysteresis: (re)admitted this step or fewer than min_resident_steps steps ago."""
        num_resident_steps = plan.index - self._queues.request_to_admitted_step[request.request_id]
        return num_resident_steps < max(1, self.config.min_resident_steps)

    def has_room(self, num_blocks: int, num_freed_blocks: int, num_freed_seats: int, num_seats: int = 1) -> bool:
        """Whether ``num_blocks`` and ``num_seats`` running slots are free once victims go."""
        has_blocks = self.block_manager.num_free_gpu_blocks + num_freed_blocks >= num_blocks
        return has_blocks and \
            self._queues.num_running_seats - num_freed_seats + num_seats <= self.config.max_num_seqs
