"""Typed engine statistics: the scheduler's cumulative counters and one snapshot of the engine.

Standard library only. The worker reads these fields (heartbeats, Prometheus).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.engine.core.fleet_cache import FleetCacheStats
from tokenmill.engine.core.request import PreemptionCause
from tokenmill.engine.kv.prefix_cache import PrefixStats


@dataclass
class SchedulerCounters:
    """Counters since the scheduler was created; all only ever grow."""

    num_steps: int = 0  # steps planned (schedule() and schedule_ahead() calls that planned one)
    num_steps_ahead: int = 0  # of those, planned while the step before still ran (schedule_ahead)
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
    num_generated_tokens: int = 0  # output tokens appended to requests (draft tokens only once kept)
    num_deferred_admissions: int = 0  # admissions the predicted-KV budget held back or paced (one per step)

    @property
    def num_preemptions(self) -> int:
        return sum(self.cause_to_num_preemptions.values())


@dataclass
class SpeculationCounters:
    """Speculative decoding since the engine started (engine/spec/); all zero with it off."""

    num_drafts: int = 0  # (request, step) pairs that ran draft tokens
    num_draft_tokens: int = 0  # draft tokens run through the model
    num_accepted_tokens: int = 0  # of them, kept (the bonus token after each draft not counted)
    # [k]: drafts that ran k tokens / whose first k tokens (and no more) were kept; the by-position counts follow
    drafts_by_length: list[int] = field(default_factory=list)
    drafts_by_num_kept: list[int] = field(default_factory=list)
    draft_length_counts: dict[int, int] = field(default_factory=dict)  # length chosen -> (request, step) pairs
    # proposer name (grammar, ngram, suffix, ngram-1, suffix-1, draft) -> draft tokens it proposed that ran / were kept
    draft_tokens_by_proposer: dict[str, int] = field(default_factory=dict)
    accepted_tokens_by_proposer: dict[str, int] = field(default_factory=dict)
    step_fixed_s: float = 0.0  # the step cost model: t(T) = step_fixed_s + step_per_token_s * T
    step_per_token_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Kept draft tokens over draft tokens run (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Draft tokens kept per draft (each draft also yields one token of the model's own)."""
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def drafted_by_position(self) -> list[int]:
        """[i]: drafts with a token at position i + 1."""
        return _at_least(self.drafts_by_length)

    @property
    def accepted_by_position(self) -> list[int]:
        """[i]: drafts whose token i + 1 was kept."""
        return _at_least(self.drafts_by_num_kept)

    def copy(self) -> SpeculationCounters:
        """A snapshot: the lists and the dict copied too."""
        return dataclasses.replace(self, drafts_by_length=list(self.drafts_by_length),
                                   drafts_by_num_kept=list(self.drafts_by_num_kept),
                                   draft_length_counts=dict(self.draft_length_counts),
                                   draft_tokens_by_proposer=dict(self.draft_tokens_by_proposer),
                                   accepted_tokens_by_proposer=dict(self.accepted_tokens_by_proposer))

    def acceptance_by_position(self) -> list[float]:
        """Per draft position, the fraction of drafts that reached it whose token there was kept."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]


def _at_least(counts: list[int]) -> list[int]:
    """``[i]``: the sum of ``counts[i + 1:]`` (how many drafts reached position i + 1)."""
    reached, total = [], 0
    for count in reversed(counts[1:]):
        total += count
        reached.append(total)
    return reached[::-1]


@dataclass(frozen=True)
class GroupBacklog:
    """One length group's (a job's) requests inside the engine, as the length predictor sees them."""

    num_requests: int  # live (waiting, running, swapped) requests of the group, samples counted
    backlog_tokens: float  # predicted output tokens they still generate (mean)
    mean_length: float | None  # predicted mean output length of a new request of the group; None: no history


@dataclass(frozen=True)
class LengthStats:
    """Output-length prediction (engine/core/length_predictor.py); all zero / empty with it off."""

    is_on: bool = False  # the engine predicts lengths ([engine.length] predict)
    num_observed: int = 0  # finished requests learnt from
    num_estimates: int = 0  # estimates made (first ones and re-estimates)
    num_outlived: int = 0  # re-estimates of requests that generated past their estimate's median or mean
    num_deferred_admissions: int = 0  # admissions the predicted-KV budget held back or paced (one per step)
    backlog_tokens: float = 0.0  # predicted output tokens every live request still generates (mean)
    group_backlog: dict[str, GroupBacklog] = field(default_factory=dict)  # per length group
    mean_length: float | None = None  # predicted mean output length of a new request of no group; None: no history
    log_error: float | None = None  # median |log predicted - log actual| over recent finished requests
    max_tokens_log_error: float | None = None  # the same for planning with max_tokens (the baseline)


@dataclass(frozen=True)
class EngineStats:
    """The engine at one moment: queues, KV pools, totals, and the scheduler's counters."""

    num_running: int = 0  # requests holding device blocks
    num_waiting: int = 0  # requests with no KV anywhere (new, or to recompute)
    num_swapped: int = 0  # requests whose KV sits in the host pool
    num_used_gpu_blocks: int = 0
    num_gpu_blocks: int = 0  # device pool size, in blocks
    num_used_cpu_blocks: int = 0
    num_cpu_blocks: int = 0  # host (swap) pool size, in blocks
    kv_block_bytes: int = 0  # bytes of one block, all layers, keys and values
    num_generated_tokens: int = 0  # tokens sampled since the engine started
    num_cached_blocks: int = 0  # device blocks whose content the prefix cache indexes
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    prefix: PrefixStats = field(default_factory=PrefixStats)
    speculation: SpeculationCounters = field(default_factory=SpeculationCounters)
    length: LengthStats = field(default_factory=LengthStats)
    fleet: FleetCacheStats = field(default_factory=FleetCacheStats)

    @property
    def gpu_usage(self) -> float:
        """Used fraction of the device pool (0.0 for an empty pool)."""
        return self.num_used_gpu_blocks / self.num_gpu_blocks if self.num_gpu_blocks else 0.0

    @property
    def cpu_usage(self) -> float:
        """Used fraction of the host pool (0.0 for an empty pool)."""
        return self.num_used_cpu_blocks / self.num_cpu_blocks if self.num_cpu_blocks else 0.0

    @property
    def swap_out_bytes(self) -> int:
        return self.counters.num_swapped_out_blocks * self.kv_block_bytes

    @property
    def swap_in_bytes(self) -> int:
        return self.counters.num_swapped_in_blocks * self.kv_block_bytes
