"""What a worker says of its predicted work (the heartbeat's prediction fields, protocol/heartbeat.py): the
completion tokens its engine is predicted to still generate, in all and per job, and the mean completion length
a new request is predicted to have. Producers turn these into ETAs (producer/eta.py).

Reads the engine's stats (engine/core/stats.py), never the engine; standard library and protocol otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.core.stats import LengthStats
from tokenmill.protocol.heartbeat import MAX_JOBS, JobBacklog


@dataclass(frozen=True)
class PredictedBacklog:
    """The heartbeat's prediction fields; all None / empty with prediction off."""

    backlog_tokens: float | None = None
    mean_length: float | None = None
    jobs: dict[str, JobBacklog] = field(default_factory=dict)


def engine_backlog_tokens(length: LengthStats) -> float | None:
    """Completion tokens the engine is predicted to still generate; None with prediction off."""
    return length.backlog_tokens if length.is_on else None


def predicted_backlog(length: LengthStats, num_tokens: int, num_finished: int) -> PredictedBacklog:
    """The prediction fields of a heartbeat from the engine's latest length stats.

    Args:
        length: ``EngineStats.length`` after the last step.
        num_tokens: completion tokens of the results this worker produced since start.
        num_finished: those results.

    The mean length of a request of no job: the engine's prediction for one (every finished request's lengths),
    else the mean completion length of this worker's results since start, else None.
    """
    backlog = engine_backlog_tokens(length)
    if backlog is None:
        return PredictedBacklog()
    busiest = sorted(length.group_backlog.items(), key=lambda item: item[1].backlog_tokens, reverse=True)[:MAX_JOBS]
    jobs = {group: JobBacklog(num_requests=job.num_requests, backlog_tokens=job.backlog_tokens,
                              mean_length=job.mean_length) for group, job in busiest}
    mean_length = length.mean_length
    if mean_length is None and num_finished:
        mean_length = num_tokens / num_finished
    return PredictedBacklog(backlog, mean_length, jobs)
