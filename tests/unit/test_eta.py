"""The ETA rule (producer/eta.py) in plain numbers: a job's remaining tokens are what the engines still generate for
it plus its rows no engine holds at the predicted mean length; a queue's are the engines' backlogs plus its
undelivered entries at the fleet's mean; the ETA divides by the job's own rate when measured, else the fleet's."""

from __future__ import annotations

import time

import msgpack
import pytest

from tokenmill.producer.eta import Eta, JobMeter, format_duration, job_eta, live_beats, queue_eta
from tokenmill.protocol.heartbeat import STOPPED, Heartbeat, JobBacklog, encode_heartbeat

JOB = "tm:default:reply:bulk-job"


def _beat(name: str, tokens_per_s: float = 0.0, **fields: object) -> Heartbeat:
    return Heartbeat.model_validate({"name": name, "ts": time.time(), "tokens_per_s": tokens_per_s, **fields})


def test_a_job_adds_its_engine_backlog_and_its_rows_outside_at_the_workers_mean_length() -> None:
    beats = [_beat("w1", 300.0, jobs={JOB: JobBacklog(num_requests=3, backlog_tokens=600.0, mean_length=100.0),
                                      "other": JobBacklog(num_requests=9, backlog_tokens=9000.0, mean_length=1000.0)}),
             _beat("w2", 200.0, jobs={JOB: JobBacklog(num_requests=1, backlog_tokens=150.0, mean_length=200.0)})]
    eta = job_eta(beats, JOB, 14, finished_mean_length=7.0, job_tokens_per_s=None)
    # 10 rows outside the engines at (3 * 100 + 1 * 200) / 4 = 125 tokens; the fleet's 500 tok/s
    assert eta == Eta(backlog_tokens=600 + 150 + 10 * 125, tokens_per_s=500.0, eta_s=2000 / 500)


def test_a_job_falls_back_to_its_own_results_mean_and_prefers_its_own_rate() -> None:
    beats = [_beat("w1", 1000.0, jobs={JOB: JobBacklog(num_requests=2, backlog_tokens=80.0)})]  # no history yet
    eta = job_eta(beats, JOB, 12, finished_mean_length=50.0, job_tokens_per_s=40.0)
    assert eta == Eta(80 + 10 * 50, 40.0, 580 / 40)


def test_a_job_with_rows_outside_and_no_mean_length_has_no_eta() -> None:
    beats = [_beat("w1", 1000.0, jobs={JOB: JobBacklog(num_requests=2, backlog_tokens=80.0)})]
    assert job_eta(beats, JOB, 3, finished_mean_length=None, job_tokens_per_s=None) == Eta(None, 1000.0, None)
    # every row in an engine: the engines' backlog alone
    assert job_eta(beats, JOB, 2, finished_mean_length=None, job_tokens_per_s=None) == Eta(80.0, 1000.0, 0.08)


def test_a_job_no_worker_reports_counts_all_its_rows_and_nothing_generating_means_no_eta() -> None:
    assert job_eta([_beat("w1")], JOB, 4, finished_mean_length=25.0, job_tokens_per_s=None) == Eta(100.0, 0.0, None)
    assert job_eta([], JOB, 0, finished_mean_length=None, job_tokens_per_s=None) == Eta(0.0, 0.0, 0.0)


def test_a_queue_adds_the_engines_backlogs_and_its_undelivered_entries_at_the_fleets_mean() -> None:
    beats = [_beat("w1", 250.0, backlog_tokens=1000.0, mean_length=100.0),
             _beat("w2", 250.0, backlog_tokens=500.0, mean_length=300.0),
             _beat("old", 0.0, running=2, waiting=1)]  # an older release: predicts nothing, its 3 counted as entries
    eta = queue_eta(beats, num_undelivered=5)
    assert eta == Eta(1000 + 500 + (5 + 3) * 200, 500.0, 3100 / 500)
    assert queue_eta(beats, num_undelivered=None) == Eta(None, 500.0, None)  # Redis < 7: no lag


def test_a_queue_without_predictions_has_a_backlog_only_when_nothing_waits() -> None:
    assert queue_eta([_beat("old", 100.0, running=1)], num_undelivered=0) == Eta(None, 100.0, None)
    assert queue_eta([_beat("idle")], num_undelivered=0) == Eta(0.0, 0.0, 0.0)


def test_only_live_heartbeats_count() -> None:
    now = time.time()
    workers = {b"live": encode_heartbeat(_beat("live")), b"old": encode_heartbeat(Heartbeat(name="old", ts=now - 60)),
               b"stopped": encode_heartbeat(Heartbeat(name="stopped", ts=now, state=STOPPED)),
               b"garbage": msgpack.packb({"ts": "x"})}
    assert [beat.name for beat in live_beats(workers, now, 15.0)] == ["live"]


def test_the_meter_measures_the_recent_rate_once_it_has_run_long_enough() -> None:
    now = [100.0]
    meter = JobMeter(window_s=60.0, clock=lambda: now[0])
    assert meter.mean_length is None and meter.tokens_per_s() is None
    now[0] += 2.0
    meter.add(100)
    assert meter.mean_length == 100 and meter.tokens_per_s() is None, "2 s is too short to measure"
    now[0] += 8.0
    meter.add(300)
    assert meter.mean_length == 200 and meter.tokens_per_s() == pytest.approx(400 / 10)
    now[0] += 61.0  # both left the window: no recent rate (the fleet's stands in)
    assert meter.tokens_per_s() is None and meter.mean_length == 200
    meter.add(120)
    assert meter.tokens_per_s() == pytest.approx(120 / 60)


def test_what_people_read() -> None:
    assert format_duration(None) == "-" and format_duration(125.4) == "0:02:05"
    assert Eta(12345.4, 100.0, 123.45).as_dict() == {"backlog_tokens": 12345, "eta_s": 123.5}
    assert Eta(12345.4, 100.0, 123.45).describe() == "12,345 tok left, ETA 0:02:03"
    assert Eta(None, 0.0, None).describe() == "- tok left, ETA -"
