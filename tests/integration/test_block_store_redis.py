"""The fleet's block store on Redis: binary round trips, a byte cap kept least recently used first out,
lifetimes, large batches, discarding rejected values, and the same behaviour as the in-process store on one
script of operations."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import pytest
import redis

from tests.doubles import LocalBlockStore
from tokenmill.engine.kv.block_store import BlockStore, namespace
from tokenmill.worker.redis_block_store import MAX_CHUNK_BYTES, RedisBlockStore, _chunks, redis_block_store

SIZE = 1000  # bytes of each value of the small tests


def digest(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16).digest()


def value(seed: int, size: int = SIZE) -> bytes:
    """``size`` bytes that differ per seed and hold zeros and 0xff."""
    pattern = bytes((seed + i) % 256 for i in range(256))
    return (b"\x00\xff" + pattern * (size // 256 + 1))[:size]


def held_bytes(client: redis.Redis, store: RedisBlockStore) -> int:
    """What the value keys of the sizes hash really hold (STRLEN of each)."""
    members: list[bytes] = client.hkeys(store.sizes_key)  # type: ignore[assignment]
    return sum(int(client.strlen(f"{store.key_prefix}:{member.decode()}")) for member in members)


def counter(client: redis.Redis, store: RedisBlockStore) -> int:
    reply: bytes | None = client.get(store.bytes_key)  # type: ignore[assignment]
    return int(reply or 0)


def test_binary_round_trip_and_misses(redis_client: redis.Redis, key_prefix: str) -> None:
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=1 << 20, ttl_s=60)
    values = [b"\x00" * 300, b"\xff" * 300, bytes(range(256)) * 3, value(7), b"\x00\xff\x00\r\n\x00"]
    keys = [digest(f"k{i}") for i in range(len(values))]
    store.put(keys, values)
    missing = digest("missing")
    assert store.get([*keys, missing]) == [*values, None]
    assert store.contains([missing, *keys]) == [False] + [True] * len(keys)
    assert redis_client.get(store.value_key(keys[0])) == values[0]  # raw bytes, no framing
    assert store.get([]) == [] and store.contains([]) == []
    assert counter(redis_client, store) == held_bytes(redis_client, store) == sum(map(len, values))


def test_put_twice_keeps_the_first_value(redis_client: redis.Redis, key_prefix: str) -> None:
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=1 << 20, ttl_s=60)
    a = digest("a")
    store.put([a], [value(1)])
    store.put([a, a], [value(2), value(3)])
    assert store.get([a]) == [value(1)]
    assert counter(redis_client, store) == SIZE


def test_byte_cap_evicts_least_recently_used(redis_client: redis.Redis, key_prefix: str) -> None:
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=3 * SIZE, ttl_s=60)
    a, b, c, d = (digest(name) for name in "abcd")
    for i, key in enumerate((a, b, c)):
        store.put([key], [value(i)])
    assert store.get([a]) == [value(0)]  # A is now the most recently used
    store.put([d], [value(3)])
    assert store.contains([a, b, c, d]) == [True, False, True, True]
    assert redis_client.zscore(store.lru_key, b.hex()) is None
    assert redis_client.hget(store.sizes_key, b.hex()) is None
    assert counter(redis_client, store) == held_bytes(redis_client, store) == 3 * SIZE
    # A batch larger than the cap keeps its last values: its first ones are its oldest.
    batch = [digest(f"batch{i}") for i in range(5)]
    store.put(batch, [value(10 + i) for i in range(5)])
    assert store.contains(batch) == [False, False, True, True, True]
    assert store.contains([a, c, d]) == [False, False, False]
    assert counter(redis_client, store) == held_bytes(redis_client, store) == 3 * SIZE


def test_value_larger_than_the_cap_is_skipped(redis_client: redis.Redis, key_prefix: str) -> None:
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=2 * SIZE, ttl_s=60)
    small, large = digest("small"), digest("large")
    store.put([large, small], [value(1, 2 * SIZE + 1), value(2)])
    assert store.contains([large, small]) == [False, True]
    assert counter(redis_client, store) == SIZE


def test_values_live_ttl_after_their_last_use(redis_client: redis.Redis, key_prefix: str) -> None:
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=1 << 20, ttl_s=30.2)
    a = digest("a")
    store.put([a], [value(1)])
    assert 0 < redis_client.ttl(store.value_key(a)) <= 31  # whole seconds, rounded up
    redis_client.expire(store.value_key(a), 5)
    assert store.get([a]) == [value(1)]
    assert redis_client.ttl(store.value_key(a)) > 5  # a get renews a hit
    redis_client.expire(store.value_key(a), 5)
    store.put([a], [value(2)])
    assert redis_client.ttl(store.value_key(a)) > 5  # so does a put of a key already present
    assert store.get([a]) == [value(1)]
    assert RedisBlockStore(redis_client, key_prefix, max_bytes=1, ttl_s=0.01).ttl_s == 1


def test_put_of_a_present_key_renews_its_recency(redis_client: redis.Redis, key_prefix: str) -> None:
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=2 * SIZE, ttl_s=60)
    a, b, c = (digest(name) for name in "abc")
    store.put([a, b], [value(1), value(2)])
    store.put([a], [value(1)])  # another engine publishes the same block: it is in use
    store.put([c], [value(3)])
    assert store.contains([a, b, c]) == [True, False, True]


def test_expired_values_stay_counted_until_evicted(redis_client: redis.Redis, key_prefix: str) -> None:
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=3 * SIZE, ttl_s=60)
    a, b, c, d = (digest(name) for name in "abcd")
    store.put([a, b], [value(1), value(2)])
    redis_client.pexpire(store.value_key(a), 1)
    deadline = time.monotonic() + 5
    while redis_client.exists(store.value_key(a)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert store.get([a, b]) == [None, value(2)]  # a miss does not renew the stale entry
    assert counter(redis_client, store) == 2 * SIZE  # conservative: A's bytes still count
    store.put([c, d], [value(3), value(4)])  # over the cap: the stale A goes first
    assert store.contains([b, c, d]) == [True, True, True]
    assert counter(redis_client, store) == held_bytes(redis_client, store) == 3 * SIZE
    # A value stored again after it expired replaces its stale size instead of adding to it.
    redis_client.delete(store.value_key(b))
    store.put([b], [value(5, SIZE // 2)])
    assert store.get([b]) == [value(5, SIZE // 2)]
    assert counter(redis_client, store) == held_bytes(redis_client, store) == 2 * SIZE + SIZE // 2


def test_large_batch_round_trips(redis_client: redis.Redis, key_prefix: str) -> None:
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=64 << 20, ttl_s=60)
    keys = [digest(f"big{i}") for i in range(40)]
    values = [value(i, 1 << 20) for i in range(40)]
    store.put(keys, values)  # more than one script call (MAX_CHUNK_BYTES)
    assert store.contains(keys) == [True] * 40
    assert store.get(keys) == values
    assert counter(redis_client, store) == held_bytes(redis_client, store) == 40 << 20


def test_chunks_bound_the_bytes_of_one_script_call() -> None:
    pairs = [(digest(str(i)), b"x" * size) for i, size in enumerate([10, 10, 10, 25, 1, 40, 5])]
    chunks = list(_chunks(pairs, 30))
    assert [[len(block) for _, block in chunk] for chunk in chunks] == [[10, 10, 10], [25, 1], [40], [5]]
    assert [pair for chunk in chunks for pair in chunk] == pairs
    assert MAX_CHUNK_BYTES == 32 << 20


def test_helper_builds_the_namespace_prefix(redis_client: redis.Redis, key_prefix: str) -> None:
    root = namespace("m", "w", "t", "torch.bfloat16", 16, (2, 4, 8))
    store = redis_block_store(redis_client, key_prefix, root, max_bytes=1 << 20, ttl_s=60)
    assert store.key_prefix == f"{key_prefix}:kv:{root.hex()}"
    a = digest("a")
    store.put([a], [value(1)])
    assert redis_client.get(f"{key_prefix}:kv:{root.hex()}:{a.hex()}") == value(1)
    assert redis_client.zscore(f"{key_prefix}:kv:{root.hex()}:lru", a.hex()) is not None


def test_discard_deletes_values_as_if_expired(redis_client: redis.Redis, key_prefix: str) -> None:
    """A rejected value is deleted; its size stays counted (conservatively) until the block computed in its place
    is put, which replaces it, or eviction pops it."""
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=3 * SIZE, ttl_s=60)
    a, b, c, d = (digest(name) for name in "abcd")
    store.put([a, b], [value(1), value(2)])
    store.discard([a, digest("absent")])
    store.discard([])
    assert store.contains([a, b]) == [False, True] and store.get([a]) == [None]
    assert counter(redis_client, store) == 2 * SIZE  # as an expired value: still counted
    store.put([a], [value(3, SIZE // 2)])  # the recomputed block: stored (not kept out as "present")
    assert store.get([a]) == [value(3, SIZE // 2)]
    assert counter(redis_client, store) == held_bytes(redis_client, store) == SIZE + SIZE // 2
    store.discard([b])
    store.put([c, d], [value(4), value(5)])  # over the cap with B's stale size: B's entry goes first
    assert store.contains([a, c, d]) == [True, True, True]
    assert redis_client.hget(store.sizes_key, b.hex()) is None
    assert counter(redis_client, store) == held_bytes(redis_client, store) == 2 * SIZE + SIZE // 2


def test_a_decoding_client_is_refused(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        with pytest.raises(ValueError, match="decode_responses"):
            RedisBlockStore(client, key_prefix, max_bytes=1 << 20, ttl_s=60)
    finally:
        client.close()


def test_redis_errors_propagate(redis_client: redis.Redis, key_prefix: str) -> None:
    store = RedisBlockStore(redis_client, key_prefix, max_bytes=1 << 20, ttl_s=60)
    redis_client.set(store.bytes_key, "not a number")
    with pytest.raises(redis.ResponseError):
        store.put([digest("a")], [value(1)])


@pytest.fixture(params=["local", "redis"])
def make_store(request: pytest.FixtureRequest, redis_client: redis.Redis,
               key_prefix: str) -> Callable[[int], BlockStore]:
    """Builds the store under test with a byte cap."""
    if request.param == "local":
        return lambda max_bytes: LocalBlockStore(max_bytes)
    return lambda max_bytes: RedisBlockStore(redis_client, key_prefix, max_bytes, ttl_s=60)


def test_same_behaviour_as_the_local_store(make_store: Callable[[int], BlockStore]) -> None:
    store = make_store(3 * SIZE)
    a, b, c, d, e, missing = (digest(name) for name in ("a", "b", "c", "d", "e", "missing"))
    transcript: list[object] = []
    store.put([a, b, a], [value(1), value(2), value(9)])  # a duplicate within one batch keeps the first
    transcript.append(store.get([a, missing, b]))
    transcript.append(store.contains([b, missing, a]))
    store.put([c], [value(3)])
    transcript.append(store.get([a]))  # A used: B is now the oldest
    store.put([d, e], [value(4), value(5, 4 * SIZE)])  # E is larger than the cap: skipped
    transcript.append(store.contains([a, b, c, d, e]))
    store.put([b, e], [value(6), value(7)])  # the batch evicts C then A
    transcript.append(store.get([a, b, c, d, e]))
    store.discard([b, missing])  # a rejected value: gone, and a put of its key stores anew
    transcript.append(store.contains([b, d]))
    store.put([b], [value(8)])
    transcript.append(store.get([b]))
    store.put([], [])
    with pytest.raises(ValueError):
        store.put([a, b], [value(1)])
    assert transcript == [
        [value(1), None, value(2)],
        [True, False, True],
        [value(1)],
        [True, False, True, True, False],
        [None, value(6), None, value(4), value(7)],
        [False, True],
        [value(8)],
    ]
