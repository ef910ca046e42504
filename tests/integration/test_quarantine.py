"""A request that kills its worker (a crash no engine can contain) is quarantined on redelivery:
it runs alone, so it never takes an innocent request along a second time, and the death it causes while
alone is charged to it: it is dead-lettered without running again. A poison that arrives alone kills one
worker; one batched with others at most two (it once took five, and ten innocents with them)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time

import redis

from tests.worker_helpers import enqueue, start_worker_process, wait_serving
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import decode_result

MAX_DELIVERIES = 3
# NOTE: the echo model's test hook: a step that runs a prompt containing POISON exits the process
MODEL = "echo:crash_on=POISON,step_delay_s=0.01"
FAST = {"TOKENMILL_WORKER__HEARTBEAT_INTERVAL_S": "0.1", "TOKENMILL_WORKER__STALE_AFTER_S": "0.5",
        "TOKENMILL_WORKER__MAX_DELIVERIES": str(MAX_DELIVERIES)}


def _start(redis_url: str, prefix: str, name: str) -> subprocess.Popen[bytes]:
    return start_worker_process(redis_url, prefix, name, model=MODEL, env=FAST)


def _supervise(redis_url: str, redis_client: redis.Redis, key_prefix: str, ids: list[str],
               names: tuple[str, ...]) -> tuple[list[tuple[str, int]], list[int]]:
    """Run workers until every id is answered; a worker that dies is restarted under its name (its backlog is
    then its own pending list; another worker may reclaim it first). Returns the deaths and the exit codes."""
    keys = Keys(key_prefix)
    workers = {name: _start(redis_url, key_prefix, name) for name in names}
    deaths: list[tuple[str, int]] = []
    deadline = time.monotonic() + 120
    try:
        while sum(redis_client.exists(keys.result(rid)) for rid in ids) < len(ids):
            assert time.monotonic() < deadline, f"not every request answered; deaths {deaths}"
            for name, process in workers.items():
                if process.poll() is not None:
                    deaths.append((name, process.returncode))
                    workers[name] = _start(redis_url, key_prefix, name)
            time.sleep(0.05)
    finally:
        for name, process in workers.items():
            with contextlib.suppress(AssertionError):  # NOTE: stopped anyway; its exit code then says so
                wait_serving(redis_client, keys, name, process)  # one just restarted may still be loading
            process.send_signal(signal.SIGTERM)
        codes = [_wait_or_kill(process) for process in workers.values()]
    return deaths, codes


def _wait_or_kill(process: subprocess.Popen[bytes]) -> int:
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()  # NOTE: never leave a worker behind; the test then fails on its exit code
        process.wait()
        return -9


def test_a_poison_batched_with_others_kills_two_workers_at_most_and_takes_no_innocent_along(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    good = [enqueue(redis_client, keys, prompt=f"good request {i:02d}") for i in range(10)]
    poison = enqueue(redis_client, keys, prompt="a POISON request")
    good += [enqueue(redis_client, keys, prompt=f"good request {i:02d}") for i in range(10, 20)]
    deaths, codes = _supervise(redis_url, redis_client, key_prefix, [*good, poison], ("w1", "w2"))
    results = {rid: decode_result(redis_client.get(keys.result(rid))) for rid in good}  # type: ignore[arg-type]
    assert all(result.status == "ok" for result in results.values()), [r for r in results.values() if not r.ok]
    poisoned = decode_result(redis_client.get(keys.result(poison)))  # type: ignore[arg-type]
    assert poisoned.error is not None and poisoned.error.code == "max_deliveries", poisoned
    [(_, dead)] = redis_client.xrange(keys.dead)
    assert dead[b"reason"].startswith(b"max_deliveries: its worker died while running it alone"), dead
    # the first death took the requests batched with the poison (unless it ran alone already); the poison then
    # ran alone and killed one more, which charged it: never a third
    assert 1 <= len(deaths) <= 2 and all(code == 1 for _, code in deaths), deaths
    assert codes == [0, 0]


def test_a_poison_that_arrives_alone_is_dead_lettered_after_one_death(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    poison = enqueue(redis_client, keys, prompt="a POISON request")
    deaths, codes = _supervise(redis_url, redis_client, key_prefix, [poison], ("w1",))
    poisoned = decode_result(redis_client.get(keys.result(poison)))  # type: ignore[arg-type]
    assert poisoned.error is not None and poisoned.error.code == "max_deliveries", poisoned
    assert "its worker died while running it alone" in poisoned.error.message
    assert len(deaths) == 1 and codes == [0], deaths
    good = enqueue(redis_client, keys, prompt="after it")  # and the queue runs on
    _supervise(redis_url, redis_client, key_prefix, [good], ("w2",))
    assert decode_result(redis_client.get(keys.result(good))).status == "ok"  # type: ignore[arg-type]
