"""The fleet's KV block store on Redis: the :class:`~tokenmill.engine.kv.block_store.BlockStore` that engines
on different machines share, so a prompt prefix computed by one engine is loaded by the others.

Key layout, under a prefix the caller builds per namespace (:func:`redis_block_store`:
``tokenmill:kv:<namespace hex>``, so engines of another model, dtype or layout never meet; on a Redis
Cluster ``{tokenmill:kv:<namespace hex>}``, a hash tag that keeps every key a script names or builds on
one slot)::

    <prefix>:<digest hex>   string: one block's sealed value (engine/kv/block_store.py), with a lifetime (EX)
    <prefix>:lru            sorted set: digest hex -> last use (microseconds since the epoch)
    <prefix>:sizes          hash: digest hex -> the value's length in bytes
    <prefix>:bytes          integer: the sum of ``sizes``, what the byte cap is checked against

Why a byte cap of its own: the fleet's Redis also holds the queues, so its ``maxmemory-policy`` must be
``noeviction`` (an evicted lane or result would lose work). Redis therefore never makes room for blocks;
the store bounds itself, least recently used first out, and its lifetime drops blocks nobody reads.

The store's write path is trusted: only workers write these keys (a fleet that wants it enforced gives
producers a Redis ACL user without write access to ``<prefix>:kv:*``). The engine opens every value it
fetches and discards one it rejects (:meth:`RedisBlockStore.discard`), so the block computed in its place can
be put; values are stored and returned as they come, the store never looks inside them.

Thread-safety: the redis-py client takes a pooled connection per command or pipeline, and the only other
state here is the score clock (under a lock), so calls may come from any thread; the fleet's I/O makes them from
its threads only (worker/store_io.py). Errors from Redis propagate: the engine counts them and computes the blocks
itself.
Imports redis and the standard library only; never torch, never the engine.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from redis.commands.core import Script

# NOTE: one script per chunk of a put, so "stored + counted + evicted down to the cap" is one step that
# no other engine's put interleaves with (the counter never drifts from the sizes hash). A key already
# present keeps its value (another engine stored the same block: same digest, same bytes) and only gets
# its lifetime and recency refreshed; EXPIRE answers 1 exactly when the key exists, so it is the check.
# A value stored again after its key expired replaces the stale size still in the hash.
#
# NOTE: a value that expires by its lifetime leaves its size in ``sizes``/``bytes`` and its member in
# ``lru`` until eviction pops it (it is among the least recently used, so it goes first). Until then the
# counter over-counts: the cap is conservative, the store never holds more than ``max_bytes``. A value the
# engine discards (:meth:`RedisBlockStore.discard`, a rejected block) is a deleted key, as an expired one: its
# size stays counted until the block computed in its place is put (replacing it) or eviction pops it.
#
# NOTE: evicted value keys are built from the prefix inside the script, not passed in KEYS: on a cluster the
# prefix is a hash tag (:func:`redis_block_store`), so they are on the slot of the keys the script names.
#   KEYS: 1 lru, 2 sizes, 3 bytes, 4.. value keys
#   ARGV: 1 value key prefix (ending in ':'), 2 lifetime s, 3 max bytes, 4 score of the first value key
#         (the i-th gets score + i: a batch keeps its order), then digest hex and value per value key
PUT_LUA = """
local lru, sizes, counter = KEYS[1], KEYS[2], KEYS[3]
local prefix, ttl, max_bytes, score = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local total = tonumber(redis.call('GET', counter) or '0')
for i = 4, #KEYS do
  local hex, value = ARGV[2 * i - 3], ARGV[2 * i - 2]
  if redis.call('EXPIRE', KEYS[i], ttl) == 0 then
    redis.call('SET', KEYS[i], value, 'EX', ttl)
    local stale = tonumber(redis.call('HGET', sizes, hex) or '0')
    redis.call('HSET', sizes, hex, #value)
    total = total + #value - stale
  end
  redis.call('ZADD', lru, score + i - 4, hex)
end
while total > max_bytes do
  local popped = redis.call('ZPOPMIN', lru)
  if #popped == 0 then
    redis.call('DEL', sizes)
    total = 0
    break
  end
  local hex = popped[1]
  redis.call('DEL', prefix .. hex)
  total = total - tonumber(redis.call('HGET', sizes, hex) or '0')
  redis.call('HDEL', sizes, hex)
end
redis.call('SET', counter, total)
"""

# NOTE: runs in the get's pipeline right after its GETEXs, so it sees what they saw: only hits get a newer
# score. A plain ZADD XX would also renew the member of a value that expired, and keep its stale size
# counted longer. No values travel through it, so it is short however large the blocks.
#   KEYS: 1 lru, 2.. value keys. ARGV: 1 score of the first value key, 2.. digest hex per value key.
TOUCH_LUA = """
local score = tonumber(ARGV[1])
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('ZADD', KEYS[1], 'XX', score + i - 2, ARGV[i])
  end
end
"""

# NOTE: a script blocks Redis while it runs, and the queues share that Redis: a put of many large blocks
# is split so that no one call moves more than this many value bytes (a larger value goes alone).
MAX_CHUNK_BYTES = 32 << 20


class RedisBlockStore:
    """A :class:`~tokenmill.engine.kv.block_store.BlockStore` in Redis, least recently used first out past
    ``max_bytes``, each value dropped ``ttl_s`` after its last use.

    Args:
        client: a Redis client that does not decode responses (values are raw bytes).
        key_prefix: the prefix of every key of this store (see the module docstring).
        max_bytes: the most value bytes it keeps; a larger value is never stored.
        ttl_s: a value's lifetime after its last put or get (whole seconds, at least one).
    """

    def __init__(self, client: redis.Redis, key_prefix: str, max_bytes: int, ttl_s: float) -> None:
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the block store needs a client with decode_responses=False (values are bytes)")
        self._client = client
        self.key_prefix = key_prefix
        self.max_bytes = max_bytes
        self.ttl_s = max(1, math.ceil(ttl_s))
        self.lru_key = f"{key_prefix}:lru"
        self.sizes_key = f"{key_prefix}:sizes"
        self.bytes_key = f"{key_prefix}:bytes"
        self._put: Script = client.register_script(PUT_LUA)
        self._touch: Script = client.register_script(TOUCH_LUA)
        self._lock = threading.Lock()
        self._last_score = 0

    def value_key(self, key: bytes) -> str:
        """The Redis key holding the value of digest ``key``."""
        return f"{self.key_prefix}:{key.hex()}"

    def put(self, keys: Sequence[bytes], blocks: Sequence[bytes]) -> None:
        """Store ``blocks[i]`` under ``keys[i]`` (a key already present keeps its value)."""
        pairs = [(key, bytes(block)) for key, block in zip(keys, blocks, strict=True)
                 if len(block) <= self.max_bytes]
        for chunk in _chunks(pairs, MAX_CHUNK_BYTES):
            args: list[Any] = [f"{self.key_prefix}:", self.ttl_s, self.max_bytes, self._scores(len(chunk))]
            for key, block in chunk:
                args.extend((key.hex(), block))
            self._put(keys=[self.lru_key, self.sizes_key, self.bytes_key, *(self.value_key(k) for k, _ in chunk)],
                      args=args)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value of each key, None where the store does not hold it; a hit's lifetime and recency renew."""
        if not keys:
            return []
        value_keys = [self.value_key(key) for key in keys]
        pipe = self._client.pipeline(transaction=False)
        for value_key in value_keys:
            pipe.getex(value_key, ex=self.ttl_s)
        touch_keys = [self.lru_key, *value_keys]
        touch_args: list[int | str] = [self._scores(len(keys)), *(k.hex() for k in keys)]
        self._touch(keys=touch_keys, args=touch_args, client=pipe)
        replies = pipe.execute(raise_on_error=False)
        for reply in replies[:len(keys)]:
            if isinstance(reply, redis.RedisError):
                raise reply
        if isinstance(replies[-1], redis.exceptions.NoScriptError):
            # NOTE: a cluster pipeline loads no script (a promoted replica may lack it): a call of its own does
            self._touch(keys=touch_keys, args=touch_args)
        elif isinstance(replies[-1], redis.RedisError):
            raise replies[-1]
        return [None if value is None else bytes(value) for value in replies[:len(keys)]]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each key (no values travel, nothing renews)."""
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self.value_key(key))
        return [bool(count) for count in pipe.execute()]

    def discard(self, keys: Sequence[bytes]) -> None:
        """Delete the values of ``keys``. NOTE: their sizes stay counted until eviction pops them or a put of the
        same key replaces them, as an expired value's do (see PUT_LUA): the cap stays conservative."""
        if not keys:
            return
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.delete(self.value_key(key))
        pipe.execute()

    def _scores(self, count: int) -> int:
        """The first of ``count`` consecutive recency scores, each later than any this store gave before.

        NOTE: microseconds since the epoch are exact in a sorted set's double score (below 2**53); the
        clock only moves forward, so a batch keeps its order and a later call is always more recent than an
        earlier one of this process even within one microsecond (as the local store's order is).
        """
        with self._lock:
            first = max(time.time_ns() // 1000, self._last_score + 1)
            self._last_score = first + count - 1
            return first


def redis_block_store(client: redis.Redis, prefix: str, namespace: bytes, max_bytes: int,
                      ttl_s: float, *, hash_tag: bool = False) -> RedisBlockStore:
    """The store of one namespace (:func:`~tokenmill.engine.kv.block_store.namespace`) under ``prefix``.

    Args:
        client: a Redis client that does not decode responses.
        prefix: the fleet's key prefix, e.g. ``tokenmill``.
        namespace: the root of the engines' digest chains.
        max_bytes: the most value bytes the store keeps.
        ttl_s: a value's lifetime after its last use.
        hash_tag: the namespace's keys as ``{prefix:kv:<hex>}:...``, one Redis Cluster slot (a cluster needs it:
            a script's keys must share a slot); the namespace's blocks then live on one node.
    """
    key_prefix = f"{prefix}:kv:{namespace.hex()}"
    return RedisBlockStore(client, f"{{{key_prefix}}}" if hash_tag else key_prefix, max_bytes, ttl_s)


def _chunks(pairs: list[tuple[bytes, bytes]], max_bytes: int) -> Iterator[list[tuple[bytes, bytes]]]:
    """``pairs`` in order, in runs of at most ``max_bytes`` value bytes (a larger value is a run alone)."""
    chunk: list[tuple[bytes, bytes]] = []
    size = 0
    for pair in pairs:
        if chunk and size + len(pair[1]) > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(pair)
        size += len(pair[1])
    if chunk:
        yield chunk
