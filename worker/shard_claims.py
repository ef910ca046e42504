"""Which shards of a sharded queue this worker reads: rendezvous hashing over the live workers.

With ``[queue] readers_per_shard = 0`` (the default) every worker reads every shard: simplest, and
right while workers are few (each shard is then read by all of them). With ``readers_per_shard = R``
each shard is read by the ``R`` live workers that rank highest for it (score: a hash of worker name and
shard), so a worker reads about ``R * shards / workers`` shards, and its prefix cache sees only their
prompts. Every worker computes the same answer from the same heartbeats, with no coordination: a worker
joining takes over only the shards it now ranks high for; a worker leaving (stopped, or silent for
``stale_after_s``) hands each of its shards to the next in that shard's ranking, who also reclaims the
entries it left pending there. A worker always counts itself live, so while views differ for a beat
(a heartbeat not yet seen) a shard is read by more workers, not fewer; a shard is left unread only while
its owners' heartbeats are fresh though they are gone, which ``stale_after_s`` bounds.

Imports only the standard library and the heartbeat vocabulary; never redis or the engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping

from tokenmill.protocol.heartbeat import Heartbeat


def _score(worker: str, shard: int) -> int:
    digest = hashlib.blake2b(f"{worker}\0{shard}".encode(errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owners(shard: int, workers: Collection[str], readers_per_shard: int) -> list[str]:
    """The workers that read ``shard``: the ``readers_per_shard`` of ``workers`` ranking highest for it
    (all of them with ``readers_per_shard = 0``)."""
    ranked = sorted(workers, key=lambda worker: (_score(worker, shard), worker), reverse=True)
    return ranked if readers_per_shard == 0 else ranked[:readers_per_shard]


def claimed_shards(me: str, live: Collection[str], num_shards: int, readers_per_shard: int) -> frozenset[int]:
    """The shards worker ``me`` reads among ``live`` workers (``me`` counts as live)."""
    if readers_per_shard == 0:
        return frozenset(range(num_shards))
    workers = set(live) | {me}
    return frozenset(shard for shard in range(num_shards) if me in owners(shard, workers, readers_per_shard))


class ShardClaims:
    """The shards this worker reads, kept current from the heartbeats (:meth:`update` once per beat).

    Args:
        me: this worker's name.
        num_shards: shards of the queue.
        readers_per_shard: see the module docstring (0 = every shard).
        stale_after_s: a heartbeat older than this (or one that says ``stopped``) is a worker gone.
    """

    def __init__(self, me: str, num_shards: int, readers_per_shard: int, stale_after_s: float) -> None:
        self._me = me
        self._num_shards = num_shards
        self._readers_per_shard = readers_per_shard
        self._stale_after_s = stale_after_s
        # NOTE: until the first heartbeats are read, every shard: a worker starting alone must not wait a beat
        self.shards = frozenset(range(num_shards))

    def update(self, beats: Mapping[str, Heartbeat], now_s: float) -> bool:
        """Recompute from ``beats``, judged at ``now_s``: the Redis server's time read with them, never this
        worker's clock (protocol/heartbeat.py); whether the claimed set changed."""
        live = [name for name, beat in beats.items() if not beat.is_stale(now_s, self._stale_after_s)]
        shards = claimed_shards(self._me, live, self._num_shards, self._readers_per_shard)
        changed = shards != self.shards
        self.shards = shards
        return changed
