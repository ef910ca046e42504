"""The atomic finish step: result stored before (and with) the ack; a second write changes nothing."""

from __future__ import annotations

import redis

from producer.keys import CONSUMER_GROUP, Keys
from producer.schema import GenerationResult, decode_result
from worker.messages import Entry, Finish
from worker.results import ResultWriter


def _delivered_entry(client: redis.Redis, keys: Keys) -> Entry:
    client.xgroup_create(keys.lane(0), CONSUMER_GROUP, id="0", mkstream=True)
    client.xadd(keys.lane(0), {"d": b"x", "v": 1})
    [(_, [(entry_id, fields)])] = client.xreadgroup(CONSUMER_GROUP, "c1", {keys.lane(0): ">"})  # type: ignore[misc]
    return Entry(keys.lane(0), entry_id.decode(), 0, dict(fields))


def test_result_and_ack_in_one_step(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    entry = _delivered_entry(redis_client, keys)
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 1
    writer = ResultWriter(redis_client, keys, result_ttl_s=60, done_ttl_s=30, token_ttl_s=30)
    assert writer.flush([Finish(GenerationResult(id="r1", status="ok", text="a"), entry)]) == [1]
    assert decode_result(redis_client.get(keys.result("r1"))).text == "a"  # type: ignore[arg-type]
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0
    assert 0 < redis_client.pttl(keys.result("r1")) <= 60_000
    assert 0 < redis_client.pttl(keys.done("r1")) <= 30_000


def test_second_write_changes_nothing_and_notifies_once(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    reply = f"{key_prefix}:reply"
    first, second = _delivered_entry(redis_client, keys), _delivered_entry_again(redis_client, keys)
    writer = ResultWriter(redis_client, keys, result_ttl_s=60, done_ttl_s=30, token_ttl_s=30)
    stored = writer.flush([Finish(GenerationResult(id="r1", status="ok", text="first"), first, reply, True),
                           Finish(GenerationResult(id="r1", status="ok", text="second"), second, reply, True)])
    assert stored == [1, 0]
    assert decode_result(redis_client.get(keys.result("r1"))).text == "first"  # type: ignore[arg-type]
    assert redis_client.llen(keys.done("r1")) == 1
    assert redis_client.xlen(reply) == 1 and redis_client.xlen(keys.tokens("r1")) == 1
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0


def _delivered_entry_again(client: redis.Redis, keys: Keys) -> Entry:
    client.xadd(keys.lane(0), {"d": b"y", "v": 1})
    [(_, [(entry_id, fields)])] = client.xreadgroup(CONSUMER_GROUP, "c2", {keys.lane(0): ">"})  # type: ignore[misc]
    return Entry(keys.lane(0), entry_id.decode(), 0, dict(fields))
