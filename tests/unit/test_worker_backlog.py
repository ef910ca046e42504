"""What a worker's heartbeat says of its predicted work (worker/backlog.py): nothing with prediction off; the jobs
with the most backlog, at most MAX_JOBS of them; the mean length of a request of no job from the engine's
prediction, else from the worker's own results."""

from __future__ import annotations

from tokenmill.engine.core.stats import GroupBacklog, LengthStats
from tokenmill.protocol.heartbeat import MAX_JOBS, JobBacklog
from tokenmill.worker.backlog import PredictedBacklog, predicted_backlog


def test_prediction_off_says_nothing() -> None:
    assert predicted_backlog(LengthStats(), num_tokens=500, num_finished=5) == PredictedBacklog(None, None, {})


def test_jobs_with_the_most_backlog_are_listed_with_the_engines_mean_length() -> None:
    groups = {f"job-{i}": GroupBacklog(num_requests=1, backlog_tokens=float(i), mean_length=None)
              for i in range(MAX_JOBS + 8)}
    groups["big"] = GroupBacklog(num_requests=3, backlog_tokens=900.0, mean_length=100.0)
    groups["small"] = GroupBacklog(num_requests=1, backlog_tokens=500.0, mean_length=300.0)
    length = LengthStats(is_on=True, num_estimates=50, backlog_tokens=2000.0, group_backlog=groups, mean_length=120.0)
    predicted = predicted_backlog(length, num_tokens=10, num_finished=1)
    assert predicted.backlog_tokens == 2000.0
    assert len(predicted.jobs) == MAX_JOBS
    assert predicted.jobs["big"] == JobBacklog(num_requests=3, backlog_tokens=900.0, mean_length=100.0)
    assert "job-39" in predicted.jobs and "job-0" not in predicted.jobs  # the least backlog left out
    assert predicted.mean_length == 120.0


def test_without_job_history_the_mean_is_the_workers_own_results() -> None:
    length = LengthStats(is_on=True, num_estimates=5, backlog_tokens=80.0)  # no history yet
    assert predicted_backlog(length, num_tokens=600, num_finished=4) == PredictedBacklog(80.0, 150.0, {})
    assert predicted_backlog(length, num_tokens=0, num_finished=0) == PredictedBacklog(80.0, None, {})
