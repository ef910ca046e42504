"""The dashboard's arithmetic, without Redis: per-minute rates from counters and from sparse counter samples, the
worker's counter batching, a job's prediction error, and the SVG charts."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.producer.bulk.record import prediction_error
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.rates import RateCounter, field
from tokenmill.serve.dashboard import charts, series


def test_counts_per_minute_become_rates_per_second_the_current_minute_by_its_elapsed_part() -> None:
    now_s = 100 * 60 + 30.0  # half-way through minute 100
    minutes = series.window(now_s)
    assert minutes[0] == 40 and minutes[-1] == 100 and len(minutes) == 61
    replies: list[Any] = [{} for _ in minutes]
    replies[-2] = {b"o|lane:1": b"120", b"t|lane:1": b"6000", b"o|lane:2": b"60"}
    replies[-1] = {b"o|lane:1": b"30", b"garbage": b"x"}
    buckets = series.Buckets(minutes, replies, now_s)
    outs = buckets.rate("o")
    assert outs[-2] == 3.0 and outs[-1] == 1.0  # (120 + 60) / 60, and 30 in 30 s
    assert buckets.rate("o", ["lane:2"])[-2] == 1.0 and buckets.rate("t")[-2] == 100.0
    assert buckets.latest(outs) == pytest.approx((180 + 30) / 90)


def test_requests_in_spread_a_counters_samples_over_the_minutes_between_them() -> None:
    minutes = [10, 11, 12, 13]
    # 600 added between 10:00 and 12:00 (two minutes): 5/s in both; nothing sampled after 12:00 until 12:30
    rates = series.spread([(600_000, 1000), (720_000, 1600), (750_000, 1600)], minutes)
    assert rates[0] == pytest.approx(5.0) and rates[1] == pytest.approx(5.0)
    assert rates[2] == 0.0 and rates[3] is None  # no pair covers minute 13


def test_in_rate_sums_lanes_and_reads_samples_from_the_minute_hashes() -> None:
    now_s = 12 * 60 + 59.0
    minutes = series.window(now_s)
    replies: list[Any] = [{} for _ in minutes]
    replies[-2] = {field("a", "s1").encode(): b"660000:100", field("a", "s2").encode(): b"660000:0"}
    buckets = series.Buckets(minutes, replies, now_s, {"s1": (720_000, 160), "s2": (720_000, 60)})
    assert buckets.in_rate()[-2] == pytest.approx(2.0)  # 60 + 60 in 60 s
    assert buckets.in_rate(["s1"])[-2] == pytest.approx(1.0)
    assert buckets.in_rate()[0] is None


class FakePipe:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail = fail

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, args))

    def execute(self) -> list[Any]:
        if self.fail:
            raise ConnectionError("gone")
        return []


class FakeClient:
    def __init__(self, pipe: FakePipe) -> None:
        self.pipe = pipe

    def pipeline(self, transaction: bool = False) -> FakePipe:
        return self.pipe


def test_a_worker_sends_its_counts_at_most_once_a_second_by_the_servers_minute() -> None:
    clock = [1000.0]
    counter = RateCounter(Keys("p"), "w1", clock=lambda: clock[0])
    counter.sync_clock(60 * 500 + 10.0)  # the server's time: minute 500
    counter.add("p:default:lane:1", 7)
    counter.add("p:default:lane:1", 3)
    pipe = FakePipe()
    counter.flush(FakeClient(pipe))
    assert ("hincrby", ("p:default:rate:500", "o|p:default:lane:1", 2)) in pipe.calls
    assert ("hincrby", ("p:default:rate:500", "t|p:default:lane:1", 10)) in pipe.calls
    assert ("hincrby", ("p:default:wrate:500", "o|w1", 2)) in pipe.calls
    assert ("expire", ("p:default:rate:500", 7320)) in pipe.calls
    counter.add("p:default:lane:1", 1)
    again = FakePipe()
    counter.flush(FakeClient(again))
    assert again.calls == []  # within the second
    failing = FakePipe(fail=True)
    clock[0] += 1.0
    with pytest.raises(ConnectionError):
        counter.flush(FakeClient(failing))
    later = FakePipe()
    counter.flush(FakeClient(later), force=True)
    assert ("hincrby", ("p:default:rate:500", "o|p:default:lane:1", 1)) in later.calls  # kept for the retry


def test_a_jobs_prediction_error_checks_each_snapshot_against_what_followed() -> None:
    assert prediction_error([], 0, 100.0) is None
    # predicted 1000 left at 0 tokens; 600 made since and 500 predicted now: 1100 real, 1000 said
    assert prediction_error([(0.0, 0, 1000.0)], 600, 500.0) == pytest.approx(100 / 1100)
    assert prediction_error([(0.0, 0, 1000.0), (1.0, 500, 500.0)], 1000, 0.0) == pytest.approx(0.0)


def test_charts_are_plain_svg_and_label_units() -> None:
    assert charts.compact(None) == "-" and charts.compact(1234.0, "/s") == "1.2k/s" and charts.compact(0.25) == "0.25"
    chart = str(charts.line_chart([None, 1.0, 2.0, None, 3.0], title="t <x>", unit="/s"))
    assert chart.count("<polyline") == 1 and "t &lt;x&gt;" in chart and "peak 3/s" in chart
    assert "no data yet" in str(charts.line_chart([None, None], title="t", unit=""))
    assert "<svg" in str(charts.sparkline([0.0, 1.0]))
