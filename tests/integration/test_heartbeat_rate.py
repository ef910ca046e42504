"""The heartbeat's tokens/s is the rate over the last heartbeat interval: a beat soon after another
(the one written at stop) does not divide a few tokens by a few milliseconds (it read ~10x the real
rate), and a stopped worker reports 0."""

from __future__ import annotations

import queue

import pytest
import redis

from tests.worker_helpers import make_settings
from tokenmill.protocol.keys import Keys
from tokenmill.worker import writer as writer_module
from tokenmill.worker.health import RedisHealth
from tokenmill.worker.heartbeat import STOPPED, read_heartbeats
from tokenmill.worker.state import Load
from tokenmill.worker.writer import Writer


def test_the_rate_is_taken_over_an_interval_and_zero_once_stopped(redis_url: str, redis_client: redis.Redis,
                                                                  key_prefix: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    now_s = [100.0]
    monkeypatch.setattr(writer_module.time, "monotonic", lambda: now_s[0])
    settings = make_settings(redis_url, key_prefix, heartbeat_interval_s=2.0, stale_after_s=10.0)
    load = Load()
    writer = Writer(redis_client, settings.queue, settings.worker, load, queue.Queue(), "echo", "echo", ["echo"],
                    RedisHealth(settings.worker.redis_give_up_s))

    def beat(after_s: float, tokens: int, state: str = "running") -> float:
        now_s[0] += after_s
        load.num_tokens += tokens
        writer.beat(state)
        return read_heartbeats(redis_client, Keys(key_prefix))[settings.worker.name].tokens_per_s

    assert beat(2.0, 200) == pytest.approx(100.0)
    assert beat(2.0, 100) == pytest.approx(50.0)
    assert beat(0.02, 10) == pytest.approx(50.0), "20 ms is no interval: the last rate stands"
    assert beat(1.98, 90) == pytest.approx(50.0), "the 10 tokens of the short beat count in the next interval"
    assert beat(0.01, 5, STOPPED) == 0.0
