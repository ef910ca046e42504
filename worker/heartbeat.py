"""Worker heartbeats in the ``workers`` hash: encoding, writing, reading and staleness.

Imports redis, msgpack and producer.keys; never the engine. Readers of the hash (reclaim, a
status command) decide liveness only through :func:`is_dead`.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import msgpack
import redis

from producer.keys import WORKER_RUNNING as RUNNING
from producer.keys import WORKER_STOPPED as STOPPED
from producer.keys import Keys

__all__ = ["RUNNING", "STOPPED", "Heartbeat", "as_text", "forget_old", "is_dead", "read_heartbeats", "write_heartbeat"]
FORGET_AFTER_S = 86_400.0  # a silent worker's heartbeat stays visible (as stale) this long, then is deleted


@dataclass
class Heartbeat:
    """One worker's liveness record (the value of its field in the ``workers`` hash)."""

    name: str  # consumer name in the group
    ts: float  # unix time of this beat
    state: str = RUNNING  # running | stopped
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    started_at: float = field(default_factory=time.time)  # unix time the worker started
    model: str = ""  # model loaded (as configured: alias, id or path)
    served_model_name: str = ""  # the name requests use for it (``/v1/models`` lists these)
    running: int = 0  # requests generating now
    waiting: int = 0  # requests waiting inside the engine
    tokens_per_s: float = 0.0  # completion tokens per second over the last interval
    num_finished: int = 0  # results produced since start
    prefix_hit_ratio: float = 0.0  # prompt tokens found in the prefix cache / prompt tokens looked up
    num_cached_blocks: int = 0  # KV blocks the prefix cache indexes

    def age_s(self, now_s: float) -> float:
        """Seconds since the beat."""
        return max(0.0, now_s - self.ts)

    def is_stale(self, now_s: float, stale_after_s: float) -> bool:
        """True when the worker stopped cleanly or has not beaten for ``stale_after_s``."""
        return self.state == STOPPED or self.age_s(now_s) > stale_after_s


def write_heartbeat(client: redis.Redis, keys: Keys, beat: Heartbeat) -> None:
    """Store ``beat`` under its worker's name."""
    client.hset(keys.workers, beat.name, msgpack.packb(asdict(beat), use_bin_type=True))


def read_heartbeats(client: redis.Redis, keys: Keys) -> dict[str, Heartbeat]:
    """Every worker's last beat, by name; undecodable fields are skipped."""
    beats = {as_text(name): _decode(raw) for name, raw in client.hgetall(keys.workers).items()}
    return {name: beat for name, beat in beats.items() if beat is not None}


def is_dead(name: str, consumer_idle_ms: int, beats: dict[str, Heartbeat], now_s: float,
            stale_after_s: float) -> bool:
    """Whether consumer ``name``'s pending entries may be taken from it.

    A worker with a fresh heartbeat is alive however long its generations run. A consumer that
    never beat (e.g. a raw client) counts as dead once it has been idle for ``stale_after_s``.
    """
    beat = beats.get(name)
    if beat is None:
        return consumer_idle_ms > stale_after_s * 1000
    return beat.is_stale(now_s, stale_after_s)


def forget_old(client: redis.Redis, keys: Keys, now_s: float) -> list[str]:
    """Delete the fields of workers silent for :data:`FORGET_AFTER_S` (they stay visible as stale until then)."""
    names = [name for name, beat in read_heartbeats(client, keys).items() if beat.age_s(now_s) > FORGET_AFTER_S]
    if names:
        client.hdel(keys.workers, *names)
    return names


_FIELDS = frozenset(f.name for f in fields(Heartbeat))


def _decode(raw: Any) -> Heartbeat | None:
    try:
        data = msgpack.unpackb(raw, raw=False)
        # NOTE: fields a newer worker added are ignored: a mixed fleet must never judge a live
        # worker dead (and take its entries) because its heartbeat says more.
        return Heartbeat(**{name: value for name, value in data.items() if name in _FIELDS})
    except Exception:  # noqa: BLE001 - a foreign or older value: not a heartbeat we can judge
        return None


def as_text(value: Any) -> str:
    """A Redis reply value (bytes from a bytes client) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
