"""The atomic finish step: result stored before (and with) the ack; a second write changes nothing."""

from __future__ import annotations

import redis

from tokenmill.protocol.keys import CONSUMER_GROUP, DONE_TTL_S, Keys
from tokenmill.protocol.schema import GenerationResult, decode_result
from tokenmill.worker.messages import DeadLetter, Entry, Finish
from tokenmill.worker.results import FINISH_BATCH, FlushOutcome, ResultWriter, Writable


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
    the result is stored and the entry acked either way."""
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
    """A result whose metadata cannot be encoded becomes an ``internal`` error result for that id."""
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


def _delivered_entries(client: redis.Redis, keys: Keys, num: int) -> list[Entry]:
    client.xgroup_create(keys.lane(0), CONSUMER_GROUP, id="0", mkstream=True)
    for i in range(num):
        client.xadd(keys.lane(0), {"d": f"x{i}".encode(), "v": 1})
    [(_, items)] = client.xreadgroup(CONSUMER_GROUP, "c1", {keys.lane(0): ">"}, count=num)  # type: ignore[misc]
    return [Entry(keys.lane(0), entry_id.decode(), 0, dict(fields)) for entry_id, fields in items]


def test_a_flush_of_several_batches_answers_each_entry_in_order(redis_client: redis.Redis, key_prefix: str) -> None:
    """Answers go FINISH_BATCH to a script call: every outcome is its own item's, a duplicate id is stored once,
    a dead letter among them keeps its fields, and every entry is acked and deleted."""
    keys = Keys(key_prefix)
    num = 2 * FINISH_BATCH + 10
    entries = _delivered_entries(redis_client, keys, num)
    items: list[Writable] = [Finish(GenerationResult(id=f"r{i}", status="ok", text=f"t{i}"), entry)
                             for i, entry in enumerate(entries[:-2])]
    items.append(Finish(GenerationResult(id="r0", status="ok", text="again"), entries[-2]))
    items.append(DeadLetter(entries[-1], "undecodable: garbage"))
    writer = ResultWriter(redis_client, keys, result_ttl_s=60, token_ttl_s=30)
    outcomes = writer.flush(items)
    assert [o.item for o in outcomes] == items
    assert _stored(outcomes) == [1] * (num - 2) + [0, 0]
    for i in range(num - 2):
        assert decode_result(redis_client.get(keys.result(f"r{i}"))).text == f"t{i}"  # type: ignore[arg-type]
    assert redis_client.llen(keys.done("r0")) == 1
    [(_, dead)] = redis_client.xrange(keys.dead)
    assert dead[b"d"] == f"x{num - 1}".encode() and dead[b"entry_id"] == entries[-1].entry_id.encode()
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0
    assert redis_client.xlen(keys.lane(0)) == 0


def test_a_flush_is_one_round_trip_and_scripts_come_back_after_a_flush(private_redis_url: str) -> None:
    """No SCRIPT EXISTS per flush (redis-py's pipeline asks it on every execute); a server that lost its scripts
    refuses that flush's answers (nothing written), and the next flush loads them again and writes."""
    client = redis.Redis.from_url(private_redis_url)
    keys = Keys("scripts")
    entries = _delivered_entries(client, keys, 4)
    writer = ResultWriter(client, keys, result_ttl_s=60, token_ttl_s=30)
    assert _stored(writer.flush([Finish(GenerationResult(id="r0", status="ok"), entries[0])])) == [1]
    client.config_resetstat()
    assert _stored(writer.flush([Finish(GenerationResult(id="r1", status="ok"), entries[1])])) == [1]
    stats = client.info("commandstats")
    assert "cmdstat_script" not in stats and stats["cmdstat_evalsha"]["calls"] == 1
    client.script_flush()
    refused = writer.flush([Finish(GenerationResult(id="r2", status="ok"), entries[2])])
    assert isinstance(refused[0].error, redis.exceptions.NoScriptError) and not client.exists(keys.result("r2"))
    retried = writer.flush([refused[0].item, Finish(GenerationResult(id="r3", status="ok"), entries[3])])
    assert _stored(retried) == [1, 1]
    assert client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0
    client.close()


def test_a_batch_refused_for_memory_writes_nothing(private_redis_url: str) -> None:
    """Under ``maxmemory`` + ``noeviction`` the batch's first write is refused, and so is every answer's after it:
    nothing stored, nothing acked; once memory is raised the same items are written."""
    client = redis.Redis.from_url(private_redis_url)
    keys = Keys("oom")
    entries = _delivered_entries(client, keys, 3)
    items: list[Writable] = [Finish(GenerationResult(id=f"r{i}", status="ok", text="x" * 100), entry)
                             for i, entry in enumerate(entries[:2])]
    items.append(DeadLetter(entries[2], "undecodable: garbage"))
    writer = ResultWriter(client, keys, result_ttl_s=60, token_ttl_s=30)
    writer.flush([])  # NOTE: loads the scripts while memory allows
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"])))
    refused = writer.flush(items)
    assert all(isinstance(o.error, redis.exceptions.OutOfMemoryError) for o in refused), refused
    assert client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 3
    assert not client.exists(keys.result("r0"), keys.result("r1"), keys.dead)
    client.config_set("maxmemory", "0")
    assert _stored(writer.flush(items)) == [1, 1, 0]
    assert client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0 and client.xlen(keys.dead) == 1
    client.close()
