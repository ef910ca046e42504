"""Bad input is answered (or dead-lettered), never dropped; retries, dead letters and leases."""

from __future__ import annotations

import time

import msgpack
import redis

from tests.worker_helpers import enqueue, make_settings, running_worker, wait_result
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys


def _raw(client: redis.Redis, keys: Keys, data: object, version: object = 1) -> None:
    payload = data if isinstance(data, bytes) else msgpack.packb(data)
    client.xadd(keys.lane(0), {"d": payload, "v": version})  # type: ignore[dict-item]


def test_every_bad_input_gets_its_error_code(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, engine={"model": {"max_model_len": 64}})
    keys = settings.queue.keys
    _raw(redis_client, keys, b"\xc1 not msgpack")
    _raw(redis_client, keys, {"id": "bad-version", "prompt": "x"}, version=99)
    _raw(redis_client, keys, {"id": "no-prompt"})
    _raw(redis_client, keys, {"id": "bad-params", "prompt": "x", "params": {"max_tokens": 0}})
    long_id = enqueue(redis_client, keys, prompt="y" * 100)
    other_model = enqueue(redis_client, keys, model="gpt-9")
    with running_worker(settings):
        codes = {rid: wait_result(redis_client, keys, rid).error.code  # type: ignore[union-attr]
                 for rid in ("bad-version", "no-prompt", "bad-params", long_id, other_model)}
        fine = enqueue(redis_client, keys, prompt="fine", params={"max_tokens": 8})  # 4 + 8 fit in 64
        assert wait_result(redis_client, keys, fine).text == "fine"
    assert codes == {"bad-version": "unknown_version", "no-prompt": "validation", "bad-params": "validation",
                     long_id: "prompt_too_long", other_model: "model_not_served"}
    [(_, dead)] = redis_client.xrange(keys.dead)
    assert dead[b"reason"].startswith(b"undecodable") and dead[b"d"] == b"\xc1 not msgpack"
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0


def _deliver_to_ghost(client: redis.Redis, keys: Keys, times: int) -> None:
    """Deliver every lane-0 entry ``times`` times to consumers that never heartbeat."""
    client.xgroup_create(keys.lane(0), CONSUMER_GROUP, id="0", mkstream=True)
    client.xreadgroup(CONSUMER_GROUP, "ghost", {keys.lane(0): ">"})
    for _ in range(times - 1):
        ids = [p["message_id"] for p in client.xpending_range(keys.lane(0), CONSUMER_GROUP, "-", "+", 100)]
        client.xclaim(keys.lane(0), CONSUMER_GROUP, "ghost", 0, ids)
    time.sleep(0.6)  # past stale_after_s: the ghost counts as dead


def test_retry_then_dead_letter_after_max_deliveries(redis_url: str, redis_client: redis.Redis,
                                                     key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, max_deliveries=2)
    keys = settings.queue.keys
    retried = enqueue(redis_client, keys, prompt="again")
    _deliver_to_ghost(redis_client, keys, times=1)
    doomed = enqueue(redis_client, keys, prompt="doomed")
    redis_client.xreadgroup(CONSUMER_GROUP, "ghost", {keys.lane(0): ">"})
    redis_client.xclaim(keys.lane(0), CONSUMER_GROUP, "ghost", 0,
                        [redis_client.xrange(keys.lane(0))[-1][0]])
    time.sleep(0.6)
    with running_worker(settings):
        assert wait_result(redis_client, keys, retried).text == "again"
        failed = wait_result(redis_client, keys, doomed)
        deadline = time.monotonic() + 3
        while redis_client.xinfo_consumers(keys.lane(0), CONSUMER_GROUP)[0]["name"] == b"ghost":
            assert time.monotonic() < deadline, "dead consumer was not removed"
            time.sleep(0.05)
    assert (failed.status, failed.error.code) == ("error", "max_deliveries")  # type: ignore[union-attr]
    [(_, dead)] = redis_client.xrange(keys.dead)
    assert dead[b"reason"].startswith(b"max_deliveries") and b"d" in dead
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0


def test_live_workers_long_generation_is_never_reclaimed(redis_url: str, redis_client: redis.Redis,
                                                         key_prefix: str) -> None:
    slow = make_settings(redis_url, key_prefix, model="echo:step_delay_s=0.01")
    other = make_settings(redis_url, key_prefix)
    keys = slow.queue.keys
    with running_worker(slow):
        rid = enqueue(redis_client, keys, prompt="z" * 150)  # ~1.5 s, three times stale_after_s
        time.sleep(0.3)
        with running_worker(other):
            result = wait_result(redis_client, keys, rid, timeout_s=10)
    assert result.worker == slow.worker.name
    assert redis_client.llen(keys.done(rid)) == 1
