"""A worker whose Redis is gone or refuses its writes: it reports unhealthy (the
``tokenmill_redis_healthy`` gauge, an ERROR line) and exits non-zero after ``redis_give_up_s``
instead of retrying forever, and on SIGTERM it never exits 0 having dropped results it could not
write: it tries for ``drain_timeout_s``, then exits 1 with their count, their entries left pending."""

from __future__ import annotations

import json
import threading
import uuid

import redis

from tests.processes import free_port
from tests.worker_helpers import (
    enqueue,
    make_settings,
    running_worker,
    wait_result,
    wait_until,
    worker_logs,
)
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys
from tokenmill.worker.runtime import Worker


def _events(logs: str) -> list[dict[str, object]]:
    return [line for line in map(json.loads, logs.splitlines()) if "event" in line]


def _run(worker: Worker) -> tuple[threading.Thread, list[int]]:
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(worker.run()), daemon=True)
    thread.start()
    return thread, codes


def test_with_redis_gone_for_good_the_worker_reports_unhealthy_then_exits_non_zero(private_redis_url: str) -> None:
    client = redis.Redis.from_url(private_redis_url)
    prefix = f"gone-{uuid.uuid4().hex[:6]}"
    settings = make_settings(private_redis_url, prefix, redis_give_up_s=4.0, metrics_port=free_port())
    keys = settings.queue.keys
    with worker_logs(as_json=True) as logs:
        worker = Worker(settings, handle_signals=False)
        assert worker.metrics is not None
        thread, codes = _run(worker)

        def healthy() -> float | None:
            assert worker.metrics is not None
            return worker.metrics.registry.get_sample_value("tokenmill_redis_healthy")

        assert wait_result(client, keys, enqueue(client, keys, prompt="before")).ok
        assert healthy() == 1.0
        try:
            client.shutdown(nosave=True)
        except redis.ConnectionError:
            pass  # NOTE: the server closes this connection as it goes
        wait_until(lambda: healthy() == 0.0, timeout_s=10)
        thread.join(timeout=30)
    assert not thread.is_alive() and codes == [1]
    events = [line["event"] for line in _events(logs.getvalue())]
    assert "redis_unhealthy" in events and "redis_gave_up" in events, events
    gave_up = next(line for line in _events(logs.getvalue()) if line["event"] == "redis_gave_up")
    assert gave_up["level"] == "ERROR"


def test_on_sigterm_results_that_cannot_be_written_make_a_non_zero_exit(private_redis_url: str) -> None:
    client = redis.Redis.from_url(private_redis_url)
    prefix = f"unwritten-{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    client.xgroup_create(keys.lane(0), CONSUMER_GROUP, id="0", mkstream=True)
    ids = [enqueue(client, keys, prompt=f"unwritten {i} " * 2) for i in range(3)]
    client.config_set("maxmemory-policy", "noeviction")
    settings = make_settings(private_redis_url, prefix, model="echo:step_delay_s=0.05",
                             drain_timeout_s=1.0)
    with worker_logs(as_json=True) as logs:
        worker = Worker(settings, handle_signals=False)
        thread, codes = _run(worker)
        wait_until(lambda: client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 3, timeout_s=10)
        client.config_set("maxmemory", "1")  # NOTE: every write is refused (OOM) from now on
        wait_until(lambda: worker._load.num_finished == 3, timeout_s=20)
        worker.stop()
        thread.join(timeout=30)
    client.config_set("maxmemory", "0")
    assert not thread.is_alive() and codes == [1]
    [lost] = [line for line in _events(logs.getvalue()) if line["event"] == "results_lost"]
    assert lost["count"] == 3 and lost["level"] == "ERROR"
    assert client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 3
    assert all(client.get(keys.result(rid)) is None for rid in ids)
    with running_worker(make_settings(private_redis_url, prefix)):  # reclaims them once the beat is stale
        assert all(wait_result(client, keys, rid, timeout_s=20).ok for rid in ids)
