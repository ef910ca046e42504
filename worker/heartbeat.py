"""Worker heartbeats in Redis: writing this worker's, reading everyone's, forgetting long-silent ones.

The record, the liveness rule and the scripts are the vocabulary's (protocol/heartbeat.py); this
module only runs them against the ``workers`` hash. Both directions use the Redis server's clock: a
beat is stamped by the server as it is written, and read together with the server's time, so no
worker's clock (nor the reader's) ever decides who is alive. Imports redis and protocol; never the engine.
"""

from __future__ import annotations

from typing import Any

import redis

from tokenmill.protocol.heartbeat import (
    READ_WORKERS_LUA,
    RUNNING,
    STAMP_LUA,
    STOPPED,
    Heartbeat,
    Workers,
    decode_workers,
    encode_unstamped,
    is_dead,
    server_time_s,
)
from tokenmill.protocol.keys import Keys

__all__ = ["RUNNING", "STOPPED", "Heartbeat", "Workers", "as_text", "forget_old", "is_dead", "read_heartbeats",
           "read_workers", "write_heartbeat"]
FORGET_AFTER_S = 86_400.0  # a silent worker's heartbeat stays visible (as stale) this long, then is deleted


def write_heartbeat(client: redis.Redis, keys: Keys, beat: Heartbeat) -> float:
    """Store ``beat`` under its worker's name, stamped with the server's time (its own ``ts`` is not sent);
    returns that time."""
    reply: Any = client.eval(STAMP_LUA, 1, keys.workers, beat.name, encode_unstamped(beat))
    return server_time_s(reply)


def read_workers(client: redis.Redis, keys: Keys) -> Workers:
    """Every worker's last beat, by name, and the server's time to judge them by, in one round trip to
    the node of the hash; values that are not heartbeats are skipped (and logged once)."""
    return decode_workers(client.eval(READ_WORKERS_LUA, 1, keys.workers))


def read_heartbeats(client: redis.Redis, keys: Keys) -> dict[str, Heartbeat]:
    """Every worker's last beat, by name (to look at; judging liveness needs :func:`read_workers`'s clock)."""
    return read_workers(client, keys).beats


def forget_old(client: redis.Redis, keys: Keys) -> list[str]:
    """Delete the fields of workers silent for :data:`FORGET_AFTER_S` by the server's clock (they stay
    visible as stale until then).

    NOTE: a beat from the future (stale at once: protocol/heartbeat.py) stays visible as long, counted by
    how far ahead it is: a forged far-future value is forgotten, an old-release worker's fast clock is shown.
    """
    beats, now_s = read_workers(client, keys)
    names = [name for name, beat in beats.items() if abs(now_s - beat.ts) > FORGET_AFTER_S]
    if names:
        client.hdel(keys.workers, *names)
    return names


def as_text(value: Any) -> str:
    """A Redis reply value (bytes from a bytes client) as text; undecodable bytes are escaped, never an error."""
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)
