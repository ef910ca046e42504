"""producer.dead_letters against a real Redis, without the CLI: read, select, requeue."""

from __future__ import annotations

import pytest
import redis

from tests.worker_helpers import add_dead_letter
from tokenmill.producer import dead_letters
from tokenmill.protocol.keys import Keys


def test_read_select_and_requeue(redis_client: redis.Redis, keys: Keys) -> None:
    for request_id in ("dead-a", "dead-b"):
        add_dead_letter(redis_client, keys, request_id)
    letters = dead_letters.read(redis_client, keys)
    assert [d.request_id for d in letters] == ["dead-a", "dead-b"]
    assert letters[0].reason.startswith("max_deliveries") and letters[0].stream == keys.lane(1)
    assert set(letters[0].fields) == {b"d", b"v"}
    assert len(dead_letters.read(redis_client, keys, limit=1)) == 1
    chosen, missing = dead_letters.select(letters, ["dead-a", letters[1].dead_id, "nope"])
    assert chosen == letters and missing == {"nope"}
    assert dead_letters.select(letters, None) == (letters, set())
    new_id = dead_letters.requeue(redis_client, keys, letters[0])
    assert [eid.decode() for eid, _ in redis_client.xrange(keys.lane(1))] == [new_id]
    assert redis_client.get(keys.result("dead-a")) is None  # the max_deliveries answer is gone: it may run again
    assert redis_client.get(keys.result("dead-b")) is not None
    assert [d.request_id for d in dead_letters.read(redis_client, keys)] == ["dead-b"]


def test_requeue_refuses_a_foreign_stream(redis_client: redis.Redis, keys: Keys) -> None:
    add_dead_letter(redis_client, keys, "dead-x")
    letter = dead_letters.read(redis_client, keys)[0]
    with pytest.raises(ValueError, match="not a lane"):
        dead_letters.requeue(redis_client, Keys(keys.prefix, "other"), letter)
