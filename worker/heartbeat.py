"""Worker heartbeats in Redis: writing this worker's, reading everyone's, forgetting long-silent ones.

The record and the liveness rule are the vocabulary's (protocol/heartbeat.py); this module only
moves them in and out of the ``workers`` hash. Imports redis and protocol; never the engine.
"""

from __future__ import annotations

from typing import Any

import redis

from tokenmill.producer.keys import Keys
from tokenmill.protocol.heartbeat import RUNNING, STOPPED, Heartbeat, decode_heartbeat, encode_heartbeat, is_dead

__all__ = ["RUNNING", "STOPPED", "Heartbeat", "as_text", "forget_old", "is_dead", "read_heartbeats", "write_heartbeat"]
FORGET_AFTER_S = 86_400.0  # a silent worker's heartbeat stays visible (as stale) this long, then is deleted


def write_heartbeat(client: redis.Redis, keys: Keys, beat: Heartbeat) -> None:
    """Store ``beat`` under its worker's name."""
    client.hset(keys.workers, beat.name, encode_heartbeat(beat))


def read_heartbeats(client: redis.Redis, keys: Keys) -> dict[str, Heartbeat]:
    """Every worker's last beat, by name; values that are not heartbeats are skipped (and logged once)."""
    beats = {}
    for raw_name, raw in client.hgetall(keys.workers).items():
        name = as_text(raw_name)
        beat = decode_heartbeat(name, raw)
        if beat is not None:
            beats[name] = beat
    return beats


def forget_old(client: redis.Redis, keys: Keys, now_s: float) -> list[str]:
    """Delete the fields of workers silent for :data:`FORGET_AFTER_S` (they stay visible as stale until then)."""
    names = [name for name, beat in read_heartbeats(client, keys).items() if beat.age_s(now_s) > FORGET_AFTER_S]
    if names:
        client.hdel(keys.workers, *names)
    return names


def as_text(value: Any) -> str:
    """A Redis reply value (bytes from a bytes client) as text; undecodable bytes are escaped, never an error."""
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else str(value)
