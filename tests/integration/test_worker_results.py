"""The atomic finish step: result stored before (and with) the ack; a second write changes nothing."""

from __future__ import annotations

import redis

from tokenmill.protocol.keys import CONSUMER_GROUP, DONE_TTL_S, Keys
from tokenmill.protocol.schema import GenerationResult, decode_result
from tokenmill.worker.messages import DeadLetter, Entry, Finish
from tokenmill.worker.results import FlushOutcome, ResultWriter


def _stored(outcomes: list[FlushOutcome]) -> list[int]:
    assert all(o.error is None for o in outcomes), outcomes
    return [int(o.is_stored) for o in outcomes]


def _delivered_entry(client: redis.Redis, keys: Keys) -> Entry:
    client.xgroup_create(keys.lane(0), CONSUMER_GROUP, id="0", mkstream=True)
    client.xadd(keys.lane(0), {"d": b"x", "v": 1})
    [(_, [(entry_id, fields)])] = client.xreadgroup(CONSUMER_GROUP, "c1", {keys.lane(0): ">"})  # type: ignore[misc]
    return Entry(keys.lane(0), entry_id.decode(), 0, dict(fields))


def test_result_and_ack_in_one_step(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    entry = _delivered_entry(redis_client, keys)
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 1
    writer = ResultWriter(redis_client, keys, result_ttl_s=60, token_ttl_s=30)
    assert _stored(writer.flush([Finish(GenerationResult(id="r1", status="ok", text="a"), entry)])) == [1]
    assert decode_result(redis_client.get(keys.result("r1"))).text == "a"  # type: ignore[arg-type]
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0
    assert 0 < redis_client.pttl(keys.result("r1")) <= 60_000
    assert 0 < redis_client.pttl(keys.done("r1")) <= DONE_TTL_S * 1000


def test_second_write_changes_nothing_and_notifies_once(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    reply = keys.reply("r")
    first, second = _delivered_entry(redis_client, keys), _delivered_entry_again(redis_client, keys)
    writer = ResultWriter(redis_client, keys, result_ttl_s=60, token_ttl_s=30)
    stored = _stored(writer.flush([Finish(GenerationResult(id="r1", status="ok", text="first"), first, reply, True),
                           Finish(GenerationResult(id="r1", status="ok", text="second"), second, reply, True)]))
    assert stored == [1, 0]
    assert decode_result(redis_client.get(keys.result("r1"))).text == "first"  # type: ignore[arg-type]
    assert redis_client.llen(keys.done("r1")) == 1
    assert redis_client.xlen(reply) == 1 and redis_client.xlen(keys.tokens("r1")) == 1
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0


def _delivered_entry_again(client: redis.Redis, keys: Keys) -> Entry:
    client.xadd(keys.lane(0), {"d": b"y", "v": 1})
    [(_, [(entry_id, fields)])] = client.xreadgroup(CONSUMER_GROUP, "c2", {keys.lane(0): ">"})  # type: ignore[misc]
    return Entry(keys.lane(0), entry_id.decode(), 0, dict(fields))


def test_finish_never_fails_half_way_on_keys_of_the_wrong_type(redis_client: redis.Redis, key_prefix: str) -> None:
    """A reply stream, done list or token stream that is not of its type is skipped, never an error;
    the result is stored and the entry acked either way (issue 8: WRONGTYPE left entries unacked)."""
    keys = Keys(key_prefix)
    entry = _delivered_entry(redis_client, keys)
    reply = keys.reply("taken")
    redis_client.set(reply, "not a stream")
    redis_client.set(keys.done("r1"), "not a list")
    redis_client.set(keys.tokens("r1"), "not a stream")
    writer = ResultWriter(redis_client, keys, result_ttl_s=60, token_ttl_s=30)
    assert _stored(writer.flush([Finish(GenerationResult(id="r1", status="ok", text="a"), entry, reply, True)])) == [1]
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0
    assert redis_client.get(reply) == b"not a stream"


def test_finish_acks_nothing_and_fails_nothing_when_the_group_is_gone(redis_client: redis.Redis,
                                                                       key_prefix: str) -> None:
    keys = Keys(key_prefix)
    entry = _delivered_entry(redis_client, keys)
    redis_client.xgroup_destroy(keys.lane(0), CONSUMER_GROUP)
    writer = ResultWriter(redis_client, keys, result_ttl_s=60, token_ttl_s=30)
    assert _stored(writer.flush([Finish(GenerationResult(id="r1", status="ok", text="a"), entry)])) == [1]
    assert redis_client.exists(keys.result("r1"))


def test_unencodable_result_is_answered_with_an_error(redis_client: redis.Redis, key_prefix: str) -> None:
    """A result whose metadata cannot be encoded becomes an ``internal`` error result for that id
    (issue 8: bytes that are not UTF-8 in metadata killed the writer thread)."""
    keys = Keys(key_prefix)
    entry = _delivered_entry(redis_client, keys)
    result = GenerationResult.model_construct(**{**GenerationResult(id="r1", status="ok").__dict__,
                                                  "metadata": {"b": b"\xff"}})
    writer = ResultWriter(redis_client, keys, result_ttl_s=60, token_ttl_s=30)
    assert _stored(writer.flush([Finish(result, entry)])) == [1]
    stored = decode_result(redis_client.get(keys.result("r1")))  # type: ignore[arg-type]
    assert stored.status == "error" and stored.error is not None and stored.error.code == "internal"


def test_dead_letter_keeps_the_entry_fields(redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    entry = _delivered_entry(redis_client, keys)
    writer = ResultWriter(redis_client, keys, result_ttl_s=60, token_ttl_s=30)
    assert _stored(writer.flush([DeadLetter(entry, "undecodable: garbage")])) == [0]
    [(_, fields)] = redis_client.xrange(keys.dead)
    assert fields[b"reason"] == b"undecodable: garbage" and fields[b"d"] == b"x"
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0
