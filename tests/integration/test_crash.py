"""Worker processes killed mid-run (SIGKILL) or stopped (SIGTERM): nothing lost, nothing answered twice."""

from __future__ import annotations

import signal
import subprocess
import time

import redis

from tests.worker_helpers import enqueue, start_worker_process, wait_result
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import decode_result
from tokenmill.worker.heartbeat import read_heartbeats, read_workers

NUM_REQUESTS = 200


def _start_worker(redis_url: str, prefix: str, name: str, *extra: str) -> subprocess.Popen[bytes]:
    return start_worker_process(redis_url, prefix, name, "--max-waiting", "16", *extra,
                                model="echo:step_delay_s=0.004",
                                env={"TOKENMILL_ENGINE__SCHEDULER__MAX_NUM_SEQS": "16"})


def _signal_mid_run(redis_url: str, client: redis.Redis, prefix: str, name: str,
                    sig: signal.Signals) -> tuple[Keys, str, list[str], subprocess.Popen[bytes]]:
    """Queue ``NUM_REQUESTS``, start worker ``name`` and send it ``sig`` once 30 results are in.

    Returns:
        The keys, the reply stream, the request ids and the signalled worker.
    """
    keys = Keys(prefix)
    reply = keys.reply("crash")
    ids = [enqueue(client, keys, i % 3, prompt=f"request {i:03d} " * 2, reply_to=reply) for i in range(NUM_REQUESTS)]
    worker = _start_worker(redis_url, prefix, name)
    _wait_for_results(client, keys, ids, at_least=30, timeout_s=20)
    worker.send_signal(sig)
    return keys, reply, ids, worker


def _wait_for_results(client: redis.Redis, keys: Keys, ids: list[str], at_least: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(client.exists(keys.result(i)) for i in ids) < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} results after {timeout_s} s"
        time.sleep(0.05)


def _assert_exactly_once(client: redis.Redis, keys: Keys, ids: list[str], reply: str) -> None:
    for rid in ids:
        result = decode_result(client.get(keys.result(rid)))  # type: ignore[arg-type]
        assert result.status == "ok" and result.text.startswith("request")
    replied = [decode_result(f[b"d"]).id for _, f in client.xrange(reply)]
    assert sorted(replied) == sorted(ids), "reply stream has duplicates or gaps"
    assert all(client.xpending(lane, "workers")["pending"] == 0 for lane in keys.lanes)


def test_sigkill_mid_run_then_second_worker(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    keys, reply, ids, first = _signal_mid_run(redis_url, redis_client, key_prefix, "victim", signal.SIGKILL)
    first.wait(timeout=5)
    assert read_heartbeats(redis_client, keys)["victim"].state == "running"
    second = _start_worker(redis_url, key_prefix, "rescuer")  # reclaims once the victim's heartbeat is stale
    _wait_for_results(redis_client, keys, ids, at_least=NUM_REQUESTS, timeout_s=30)
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=10) == 0
    _assert_exactly_once(redis_client, keys, ids, reply)
    beats, now_s = read_workers(redis_client, keys)  # NOTE: the server's clock, as the workers judge it
    assert beats["victim"].is_stale(now_s, 1.0)


def test_sigterm_drains_and_exits_zero(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    keys, reply, ids, first = _signal_mid_run(redis_url, redis_client, key_prefix, "leaver", signal.SIGTERM)
    assert first.wait(timeout=10) == 0
    assert read_heartbeats(redis_client, keys)["leaver"].state == "stopped"
    started = time.monotonic()
    second = _start_worker(redis_url, key_prefix, "heir", "--burst")
    assert second.wait(timeout=30) == 0, second.stderr.read().decode() if second.stderr else ""
    assert time.monotonic() - started < 20
    _assert_exactly_once(redis_client, keys, ids, reply)


def _deliveries(client: redis.Redis, stream: str) -> list[int]:
    """The delivery count of each entry pending in ``stream`` (none before a worker made the group)."""
    try:
        rows = client.xpending_range(stream, "workers", "-", "+", 100)
    except redis.ResponseError:
        return []
    return [int(row["times_delivered"]) for row in rows]


def _wait_deliveries(client: redis.Redis, stream: str, expected: list[int], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _deliveries(client, stream) != expected:
        assert time.monotonic() < deadline, (_deliveries(client, stream), expected)
        time.sleep(0.02)


def test_same_name_restarts_charge_the_entry_a_worker_died_running_alone(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    """A supervisor restarting a worker under a fixed name: the backlog path finds what the earlier process ran
    alone when it died (worker/poison.py) and dead-letters it, runs the rest alone, and a clean stop charges
    nothing (before: the backlog looped forever, delivery count 7, no dead letter; then it took max_deliveries)."""
    keys = Keys(key_prefix)
    first = enqueue(redis_client, keys, prompt="held until the worker is killed")
    second = enqueue(redis_client, keys, prompt="held with it")

    def start() -> subprocess.Popen[bytes]:
        return start_worker_process(redis_url, key_prefix, "fixed", model="echo:step_delay_s=2",
                                    env={"TOKENMILL_WORKER__DRAIN_TIMEOUT_S": "1"})

    worker = start()  # reads both at once: it holds two, nothing is run alone
    _wait_deliveries(redis_client, keys.lane(0), [1, 1])
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=5)
    worker = start()  # both are suspects now: the first runs alone
    _wait_deliveries(redis_client, keys.lane(0), [2, 1])
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=5)
    worker = start()  # the first killed it running alone: dead-lettered; the second runs alone
    try:
        result = wait_result(redis_client, keys, first, timeout_s=60)
        _wait_deliveries(redis_client, keys.lane(0), [2])
    finally:
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
    assert result.error is not None and result.error.code == "max_deliveries", result
    [(_, dead)] = redis_client.xrange(keys.dead)
    assert dead[b"reason"] == b"max_deliveries: its worker died while running it alone (delivered 2 times)"
    last = start()  # the second was running alone at a clean stop: no charge, it runs alone again
    try:
        _wait_deliveries(redis_client, keys.lane(0), [3])
    finally:
        last.send_signal(signal.SIGTERM)
        assert last.wait(timeout=60) == 0
    assert redis_client.get(keys.result(second)) is None and redis_client.xlen(keys.dead) == 1
