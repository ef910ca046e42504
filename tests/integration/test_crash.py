"""Worker processes killed mid-run (SIGKILL) or stopped (SIGTERM): nothing lost, nothing answered twice."""

from __future__ import annotations

import signal
import subprocess
import time

import redis

from tests.worker_helpers import enqueue, start_worker_process, wait_result
from tokenmill.producer.keys import Keys
from tokenmill.producer.schema import decode_result
from tokenmill.worker.heartbeat import read_heartbeats

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
    assert read_heartbeats(redis_client, keys)["victim"].is_stale(time.time(), 1.0)


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


def test_same_name_restarts_dead_letter_an_entry_after_max_deliveries(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    """A supervisor restarting a worker under a fixed name that dies holding an entry: the backlog
    path counts deliveries like reclaim does (it looped forever: delivery count 7, no dead letter)."""
    keys = Keys(key_prefix)
    request_id = enqueue(redis_client, keys, prompt="held until the worker is killed")
    env = {"TOKENMILL_WORKER__MAX_DELIVERIES": "3"}
    for delivery in (1, 2, 3):
        worker = start_worker_process(redis_url, key_prefix, "fixed", model="echo:step_delay_s=60", env=env)
        deadline = time.monotonic() + 30
        while _deliveries(redis_client, keys.lane(0)) != [delivery]:
            assert time.monotonic() < deadline, _deliveries(redis_client, keys.lane(0))
            time.sleep(0.02)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=5)
    last = start_worker_process(redis_url, key_prefix, "fixed", model="echo:step_delay_s=60", env=env)
    try:
        result = wait_result(redis_client, keys, request_id, timeout_s=30)
    finally:
        last.send_signal(signal.SIGTERM)
        assert last.wait(timeout=20) == 0
    assert result.error is not None and result.error.code == "max_deliveries", result
    [(_, dead)] = redis_client.xrange(keys.dead)
    assert dead[b"reason"] == b"max_deliveries: delivered 4 times"
    assert _deliveries(redis_client, keys.lane(0)) == []
