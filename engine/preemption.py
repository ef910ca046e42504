"""Preemption for the scheduler: who yields device blocks, hysteresis, swap-or-recompute.

Standard library only. Rules (also in engine/scheduler.py):

* PRIORITY / STARVATION (``make_room``): a waiting or swapped request that cannot be placed
  may preempt unprotected running requests that are demoted (long-output limit) or strictly
  less urgent by effective priority; demoted ones go first, then the least urgent.
* MEMORY (``pick_memory_victim``): see the hysteresis rule in engine/scheduler.py; a victim
  is always demoted or less urgent than the request that needs the blocks, so memory
  preemption never ping-pongs between two requests.
* A victim is swapped to the host pool when mode is "swap" and the host pool has room,
  otherwise its KV is dropped and it is recomputed later (never an error).
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import PreemptionCause, Request, RequestStatus
from engine.request_queue import RequestQueues
from engine.scheduler_policy import choose_victim, room_victims, urgency_key
from engine.scheduler_stats import SchedulerStats
from engine.scheduler_step import StepPlan


class Preemptor:
    """Chooses and preempts victims; shares the scheduler's queues, blocks and counters."""

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, queues: RequestQueues, stats: SchedulerStats
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self._queues = queues
        self.stats = stats

    def make_room(self, request: Request, num_blocks: int, plan: StepPlan) -> bool:
        """Ensure ``num_blocks`` free device blocks and a sequence slot for ``request``.

        Preempts protected-free running requests that are demoted (cause STARVATION) or, with
        priority preemption on, strictly less urgent (cause PRIORITY) -- but only if enough of
        them together make the room; otherwise nobody is preempted.
        """
        if self.has_room(num_blocks, 0, 0):
            return True
        if plan.swap_in and self.config.preemption_mode == "swap":
            # NOTE: a swap-out now could reuse host blocks a swap-in of this step still reads.
            return False
        victims: list[Request] = []
        num_freed_blocks = 0
        unprotected = [r for r in self._queues.running if not self.is_protected(r, plan)]
        for victim in room_victims(unprotected, request, plan.now_s, self.config.aging_interval_s,
                                   enable_priority_preemption=self.config.enable_priority_preemption):
            if self.has_room(num_blocks, num_freed_blocks, len(victims)):
                break
            victims.append(victim)
            num_freed_blocks += len(self.block_manager.get_block_ids(victim.request_id))
        if not self.has_room(num_blocks, num_freed_blocks, len(victims)):
            return False
        for victim in victims:
            cause = PreemptionCause.STARVATION if victim.is_demoted else PreemptionCause.PRIORITY
            self.preempt(victim, cause, plan)
        return True

    def pick_memory_victim(self, request: Request, plan: StepPlan) -> Request | None:
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

    def preempt(self, victim: Request, cause: PreemptionCause, plan: StepPlan) -> None:
        """Take the victim's device blocks: swap to the host pool if it has room, else recompute."""
        plan.remove(victim.request_id)
        mapping = None
        if self.config.preemption_mode == "swap":
            mapping = self.block_manager.swap_out(victim.request_id)
        if mapping is not None:
            plan.swap_out.extend(mapping)
            self.stats.num_swap_outs += 1
            self.stats.num_swapped_out_blocks += len(mapping)
            self._queues.move(victim, RequestStatus.SWAPPED)
        else:
            self.stats.num_recompute_preemptions += 1
            self.stats.num_recomputed_tokens += victim.num_computed_tokens
            self.block_manager.free(victim.request_id)
            victim.num_computed_tokens = 0
            self._queues.move(victim, RequestStatus.WAITING)
        if cause is PreemptionCause.STARVATION:
            victim.waiting_since_s = plan.now_s  # NOTE: it had its turn; it ages again from now
        victim.is_demoted = False
        victim.num_preemptions += 1
        self.stats.cause_to_num_preemptions[cause] += 1
        plan.preempted_request_ids.append(victim.request_id)

    def mark_demoted(self) -> None:
        """Long-output limit: while others wait, flag requests that decoded too long as victims."""
        limit = self.config.max_consecutive_decode_steps
        if limit == 0 or not (self._queues.waiting or self._queues.swapped):
            return
        for request in self._queues.running:
            if request.num_steps_since_admitted > limit:
                request.is_demoted = True

    def is_protected(self, request: Request, plan: StepPlan) -> bool:
        """Hysteresis: (re)admitted this step or fewer than min_resident_steps steps ago."""
        num_resident_steps = plan.index - self._queues.request_to_admitted_step[request.request_id]
        return num_resident_steps < max(1, self.config.min_resident_steps)

    def has_room(self, num_blocks: int, num_freed_blocks: int, num_freed_seqs: int) -> bool:
        has_blocks = self.block_manager.num_free_gpu_blocks + num_freed_blocks >= num_blocks
        return has_blocks and len(self._queues.running) - num_freed_seqs < self.config.max_num_seqs

