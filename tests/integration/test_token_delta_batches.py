"""A request's token deltas of several engine steps that reach the writer in one batch (it fell behind) are written
as one stream entry at the first one's place, not one entry and one expiry per step; a finish ends its request's
run (the next run starts at offset 0) without touching the other requests' deltas, and readers get the same text."""

from __future__ import annotations

import queue

import redis

from tests.worker_helpers import make_settings
from tokenmill.producer import Producer
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys
from tokenmill.protocol.schema import GenerationResult
from tokenmill.worker.health import RedisHealth
from tokenmill.worker.messages import Entry, Finish, Outgoing, TokenDelta
from tokenmill.worker.state import Load
from tokenmill.worker.writer import Writer


def _entry(client: redis.Redis, keys: Keys) -> Entry:
    client.xgroup_create(keys.lane(0), CONSUMER_GROUP, id="$", mkstream=True)
    client.xadd(keys.lane(0), {"d": b"x", "v": 1})
    [(_, [(entry_id, fields)])] = client.xreadgroup(CONSUMER_GROUP, "c1", {keys.lane(0): ">"})  # type: ignore[misc]
    return Entry(keys.lane(0), entry_id.decode(), 0, dict(fields))


def test_a_batch_writes_one_entry_per_request_and_readers_get_the_text(redis_url: str, redis_client: redis.Redis,
                                                                        key_prefix: str) -> None:
    keys = Keys(key_prefix)
    settings = make_settings(redis_url, key_prefix)
    writer = Writer(redis_client, settings.queue, settings.worker, Load(), queue.Queue(), "echo", "echo", ["echo"],
                    RedisHealth(settings.worker.redis_give_up_s))
    entry = _entry(redis_client, keys)
    batch: list[Outgoing] = [TokenDelta("a", "Hé"), TokenDelta("b", "x"), TokenDelta("a", "llo"), TokenDelta("b", "y"),
                             Finish(GenerationResult(id="a", status="ok", text="Héllo"), entry, stream_tokens=True),
                             TokenDelta("b", "z")]
    writer._flush(batch)
    entries = {rid: [fields for _, fields in redis_client.xrange(keys.tokens(rid))] for rid in ("a", "b")}
    assert entries["a"] == [{b"t": "Hé".encode() + b"llo", b"o": b"0"}, {b"end": b"1", b"status": b"ok"}]
    assert entries["b"] == [{b"t": b"xyz", b"o": b"0"}]
    writer._flush([TokenDelta("b", "!")])
    assert redis_client.xrange(keys.tokens("b"))[-1][1] == {b"t": b"!", b"o": b"3"}
    with Producer(redis_url, prefix=key_prefix) as producer:
        assert "".join(producer.stream("a", timeout=5)) == "Héllo"
