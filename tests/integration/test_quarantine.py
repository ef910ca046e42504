"""A request that kills its worker (a crash no engine can contain) is quarantined on redelivery:
it runs alone, so it never takes an innocent request along a second time, and it is dead-lettered
after ``max_deliveries`` deaths (issue 24: 5 workers died in turn and 10 innocents were dead-lettered)."""

from __future__ import annotations

import signal
import subprocess
import time

import redis

from tests.worker_helpers import enqueue, start_worker_process
from tokenmill.producer.keys import Keys
from tokenmill.producer.schema import decode_result

MAX_DELIVERIES = 3
# NOTE: the echo model's test hook: a step that runs a prompt containing POISON exits the process
MODEL = "echo:crash_on=POISON,step_delay_s=0.01"
FAST = {"TOKENMILL_WORKER__HEARTBEAT_INTERVAL_S": "0.1", "TOKENMILL_WORKER__STALE_AFTER_S": "0.5",
        "TOKENMILL_WORKER__MAX_DELIVERIES": str(MAX_DELIVERIES)}


def _start(redis_url: str, prefix: str, name: str) -> subprocess.Popen[bytes]:
    return start_worker_process(redis_url, prefix, name, model=MODEL, env=FAST)


def test_a_poison_that_kills_workers_never_takes_innocents_along_twice(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    good = [enqueue(redis_client, keys, prompt=f"good request {i:02d}") for i in range(10)]
    poison = enqueue(redis_client, keys, prompt="a POISON request")
    good += [enqueue(redis_client, keys, prompt=f"good request {i:02d}") for i in range(10, 20)]
    # NOTE: the supervisor: a worker that dies is restarted under its name (its backlog is then its
    # own pending list; another worker may reclaim it first)
    workers = {name: _start(redis_url, key_prefix, name) for name in ("w1", "w2")}
    deaths: list[tuple[str, int]] = []
    deadline = time.monotonic() + 120
    try:
        while sum(redis_client.exists(keys.result(rid)) for rid in [*good, poison]) < len(good) + 1:
            assert time.monotonic() < deadline, f"not every request answered; deaths {deaths}"
            for name, process in workers.items():
                if process.poll() is not None:
                    deaths.append((name, process.returncode))
                    workers[name] = _start(redis_url, key_prefix, name)
            time.sleep(0.05)
    finally:
        for process in workers.values():
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=20) for process in workers.values()]
    results = {rid: decode_result(redis_client.get(keys.result(rid))) for rid in good}  # type: ignore[arg-type]
    assert all(result.status == "ok" for result in results.values()), [r for r in results.values() if not r.ok]
    poisoned = decode_result(redis_client.get(keys.result(poison)))  # type: ignore[arg-type]
    assert poisoned.error is not None and poisoned.error.code == "max_deliveries", poisoned
    [(_, dead)] = redis_client.xrange(keys.dead)
    assert dead[b"reason"] == f"max_deliveries: delivered {MAX_DELIVERIES + 1} times".encode()
    # every death is one delivery of the poison: the first one took the requests batched with it,
    # none after it took another request along (they would have been delivered too often)
    assert len(deaths) == MAX_DELIVERIES and all(code == 1 for _, code in deaths), deaths
    assert codes == [0, 0]
