"""Cumulative scheduler counters (preemptions by cause, swaps, recomputation). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import PreemptionCause


@dataclass
class SchedulerStats:
    """Counters since the scheduler was created; all only ever grow."""

    num_steps: int = 0  # schedule() calls
    cause_to_num_preemptions: dict[PreemptionCause, int] = field(
        default_factory=lambda: {cause: 0 for cause in PreemptionCause}
    )  # preemptions per cause
    num_swap_outs: int = 0  # requests swapped out to the host pool
    num_swapped_out_blocks: int = 0  # device -> host block copies
    num_swap_ins: int = 0  # requests swapped back in
    num_swapped_in_blocks: int = 0  # host -> device block copies
    num_recompute_preemptions: int = 0  # preemptions that dropped the KV (recompute)
    num_recomputed_tokens: int = 0  # computed tokens whose KV was dropped and must be recomputed
    num_finished_errors: int = 0  # requests the scheduler itself finished with FINISHED_ERROR

    def as_dict(self) -> dict[str, int]:
        """Flat ``name -> count`` view for ``Scheduler.stats()``."""
        counts = {
            f"num_preemptions_{cause.value}": num for cause, num in self.cause_to_num_preemptions.items()
        }
        return {
            "num_steps": self.num_steps,
            "num_preemptions": sum(self.cause_to_num_preemptions.values()),
            **counts,
            "num_swap_outs": self.num_swap_outs,
            "num_swapped_out_blocks": self.num_swapped_out_blocks,
            "num_swap_ins": self.num_swap_ins,
            "num_swapped_in_blocks": self.num_swapped_in_blocks,
            "num_recompute_preemptions": self.num_recompute_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "num_finished_errors": self.num_finished_errors,
        }
