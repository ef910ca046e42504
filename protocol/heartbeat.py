"""Worker heartbeats: the record each worker keeps in the ``{prefix}:{queue}:workers`` hash, its
encoding, the two scripts that write and read it, and the one rule that decides whether a worker is
gone. Pydantic and msgpack only (the scripts are text; the callers run them).

One clock: the Redis server's. A beat's ``ts`` is stamped by the server inside the write
(:data:`STAMP_LUA`), and every reader judges it against the server's time read with the hash, in
one script on the node that holds it (:data:`READ_WORKERS_LUA`). Workers' clocks are never compared
with each other or with a reader's: a worker whose clock ran an hour fast stayed live an hour after
it died, and one 120 s slow had its live entries reclaimed and run twice.

Anyone who can write to Redis can write to that hash, so reading never trusts it: a value that is
not a valid heartbeat is skipped (and counts as no heartbeat), never an error; a beat stamped in the
future is stale (:meth:`Heartbeat.age_s`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgpack
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("tokenmill.heartbeat")

RUNNING = "running"
STOPPED = "stopped"  # written on a clean exit (or a failing thread): its pending entries may be reclaimed at once
# Heartbeat age (s) after which a worker counts as gone: the default of the worker's own
# ``stale_after_s`` (reclaim) and of every reader of the workers hash (``tokenmill status``, stats, serve).
STALE_AFTER_S = 15.0
MAX_JOBS = 32  # jobs a heartbeat lists (those with the most predicted backlog): a beat stays small
# How far (s) a beat's ``ts`` may be ahead of the server's time read with it and still count. A beat the
# server stamped is never ahead when read from the same node; this covers a server clock stepped back a
# little (NTP) and a failover to a replica whose clock is a little behind. Anything further ahead was not
# stamped by this server's clock: forged, or written by a worker of an older release with its own clock.
FUTURE_TOLERANCE_S = 1.0

# Writes a beat stamped with the server's time. KEYS[1]: the workers hash; ARGV[1]: the worker's name;
# ARGV[2]: its beat, a msgpack map without ``ts`` (:func:`encode_unstamped`). Appends the entry
# ``"ts": <float64 seconds>`` to the map (its header rewritten with one entry more: fixmap, map16 or map32),
# so the stored value is a plain heartbeat any reader decodes. Replies with TIME (seconds, microseconds).
# NOTE: appended last, so the server's ts wins should the map carry one too (msgpack maps keep the last).
STAMP_LUA = """
local t = redis.call('TIME')
local body = ARGV[2]
local head = string.byte(body, 1)
local n, at
if head ~= nil and head >= 0x80 and head <= 0x8f then
  n, at = head - 0x80, 2
elseif head == 0xde then
  n, at = struct.unpack('>H', body, 2), 4
elseif head == 0xdf then
  n, at = struct.unpack('>I4', body, 2), 6
else
  return redis.error_reply('a heartbeat is a msgpack map')
end
n = n + 1
local map
if n <= 15 then
  map = string.char(0x80 + n)
elseif n <= 0xffff then
  map = string.char(0xde) .. struct.pack('>H', n)
else
  map = string.char(0xdf) .. struct.pack('>I4', n)
end
local ts = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('HSET', KEYS[1], ARGV[1], map .. string.sub(body, at) .. '\\162ts\\203' .. struct.pack('>d', ts))
return t
"""

# The server's time and the whole workers hash (KEYS[1]) in one step, on the node that holds the hash.
# NOTE: a script, not TIME beside HGETALL: on a cluster a keyless TIME may go to another node, whose
# clock is not the one that stamped the beats. Replies {seconds, microseconds, {name, value, ...}}.
READ_WORKERS_LUA = """
local t = redis.call('TIME')
return {t[1], t[2], redis.call('HGETALL', KEYS[1])}
"""


class JobBacklog(BaseModel):
    """One job's requests inside a worker's engine, as its output-length predictor sees them (``Heartbeat.jobs``)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    num_requests: int  # live requests of the job in the engine (waiting, running, swapped), samples counted
    backlog_tokens: float  # predicted completion tokens they still generate
    mean_length: float | None = None  # predicted mean completion length of a new request of the job; None: no history


class Heartbeat(BaseModel):
    """One worker's liveness record (the value of its field in the ``workers`` hash).

    NOTE: fields a newer worker adds are ignored, not refused: a mixed fleet must never judge a live
    worker dead (and take its entries) because its heartbeat says more.
    """

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    name: str  # consumer name in the group
    ts: float  # unix time of this beat by the Redis server's clock (:data:`STAMP_LUA`), never the worker's
    state: str = RUNNING  # running | stopped
    pid: int = Field(default_factory=os.getpid)
    host: str = Field(default_factory=socket.gethostname)
    # Unix time the worker started, by the worker's own clock: shown, never compared with ``ts`` or judged.
    started_at: float = Field(default_factory=time.time)
    model: str = ""  # model loaded (as configured: alias, id or path)
    served_model_name: str = ""  # the name requests use for it (``/v1/models`` lists these)
    # Every name a request's ``model`` may give to reach this worker: it reads those models' lanes. Empty
    # from a worker of an older release, which reads the shared lanes only (serves no request naming a model).
    model_names: list[str] = Field(default_factory=list)
    # The layout of the queue the worker reads (protocol/shards.py), so a producer can tell its own from the
    # workers' (producer/worker_check.py). None from a worker of an older release (the fields are absent).
    prefix: str | None = None
    queue: str | None = None
    num_lanes: int | None = None  # it reads lanes 0..num_lanes-1
    shards: int | None = None
    hash_tag: bool | None = None  # its keys are braced ({prefix:queue}...): hash_tag set, a cluster, or shards > 1
    cluster: bool | None = None  # it talks to a Redis Cluster
    # Shown by the dashboard; None from a worker of an older release (the fields are absent).
    role: str | None = None  # [worker] role: both, prefill or decode
    version: str | None = None  # tokenmill's version on the worker
    kv_usage: float | None = None  # used fraction of the device KV pool (0..1); None: not reported
    running: int = 0  # requests generating now
    waiting: int = 0  # requests waiting inside the engine
    tokens_per_s: float = 0.0  # completion tokens per second over the last interval
    num_finished: int = 0  # results produced since start
    prefix_hit_ratio: float = 0.0  # prompt tokens found in the prefix cache / prompt tokens looked up
    num_cached_blocks: int = 0  # KV blocks the prefix cache indexes
    # Speculative decoding since start (engine/spec/): draft tokens kept / run, and kept per draft. None before
    # the first draft, with speculation off, and from a worker of an older release (the field is absent).
    spec_acceptance_rate: float | None = None
    spec_mean_accepted_length: float | None = None
    # Output-length prediction (engine/core/length_predictor.py): completion tokens the engine is predicted to still
    # generate for its live requests, and the predicted mean completion length of a new request of no job. None with
    # prediction off, before the engine's first request, and from a worker of an older release (the fields are absent).
    backlog_tokens: float | None = None
    mean_length: float | None = None
    # The same per job (a reply stream: each bulk job and batch has its own), for the MAX_JOBS jobs with the most
    # backlog; a job not listed may still have requests in this engine.
    jobs: dict[str, JobBacklog] = Field(default_factory=dict)

    def age_s(self, now_s: float) -> float:
        """Seconds since the beat at ``now_s``, the Redis server's time read with it; never negative.

        A beat more than :data:`FUTURE_TOLERANCE_S` ahead of ``now_s`` is infinitely old (stale): the
        server never stamps one, and trusting it kept a dead worker live until its forged (or
        fast-clocked) time came, an hour or forever. Within the tolerance it is 0 s old.
        """
        if self.ts > now_s + FUTURE_TOLERANCE_S:
            return math.inf
        return max(0.0, now_s - self.ts)

    def is_from_future(self, now_s: float) -> bool:
        """Whether the beat is ahead of ``now_s`` by more than :data:`FUTURE_TOLERANCE_S` (so stale)."""
        return math.isinf(self.age_s(now_s))

    def is_stale(self, now_s: float, stale_after_s: float) -> bool:
        """True when the worker stopped cleanly or has not beaten for ``stale_after_s`` by the server's
        clock ``now_s`` (a beat from the future included: :meth:`age_s`)."""
        return self.state == STOPPED or self.age_s(now_s) > stale_after_s


def encode_heartbeat(beat: Heartbeat) -> bytes:
    """``beat`` as stored, ``ts`` included (what :data:`STAMP_LUA` stores, with the server's ``ts``)."""
    packed: bytes = msgpack.packb(beat.model_dump(), use_bin_type=True)
    return packed


def encode_unstamped(beat: Heartbeat) -> bytes:
    """``beat`` without ``ts``: the ARGV of :data:`STAMP_LUA`, which adds the server's."""
    packed: bytes = msgpack.packb(beat.model_dump(exclude={"ts"}), use_bin_type=True)
    return packed


class Workers(NamedTuple):
    """The workers hash as read by :data:`READ_WORKERS_LUA`: the heartbeats and the clock to judge them by."""

    beats: dict[str, Heartbeat]  # by worker name; values that are not heartbeats left out
    now_s: float  # the Redis server's time when the hash was read


def server_time_s(reply: Any) -> float:
    """Seconds since the epoch from a TIME reply (``[seconds, microseconds]``, bytes or text)."""
    return int(reply[0]) + int(reply[1]) / 1_000_000


def split_workers_reply(reply: Any) -> tuple[dict[str, Any], float]:
    """The raw values by worker name (names as text, undecodable bytes escaped) and the server's time,
    from a :data:`READ_WORKERS_LUA` reply (an exception from a pipeline is raised)."""
    if isinstance(reply, Exception):
        raise reply
    flat = reply[2]
    names = [name.decode(errors="backslashreplace") if isinstance(name, bytes) else str(name) for name in flat[0::2]]
    return dict(zip(names, flat[1::2], strict=True)), server_time_s(reply)


def decode_heartbeats(raw: Mapping[str, Any]) -> dict[str, Heartbeat]:
    """The heartbeats among ``raw`` values by name; those that are not one are skipped (logged once)."""
    beats = {}
    for name, value in raw.items():
        beat = decode_heartbeat(name, value)
        if beat is not None:
            beats[name] = beat
    return beats


def decode_workers(reply: Any) -> Workers:
    """The heartbeats and the server's time of a :data:`READ_WORKERS_LUA` reply."""
    raw, now_s = split_workers_reply(reply)
    return Workers(decode_heartbeats(raw), now_s)


def decode_heartbeat(name: str, raw: Any) -> Heartbeat | None:
    """The heartbeat stored under ``name``, or None when ``raw`` is not one (logged at debug).

    The field name is the worker's name, whatever the value says.
    """
    try:
        data = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        if not isinstance(data, dict):
            raise ValueError(f"a heartbeat is a map, got {type(data).__name__}")
        return Heartbeat.model_validate({**data, "name": name})
    except Exception as exc:  # noqa: BLE001 - any bytes at all: msgpack and pydantic raise many types
        if name not in _warned:  # NOTE: once per name: readers look every heartbeat interval
            _warned.add(name)
            log.warning("skipping a value in the workers hash that is not a heartbeat",
                        extra={"event": "bad_heartbeat", "worker": name, "error": str(exc)[:200]})
        return None


_warned: set[str] = set()  # names whose bad value was logged


def is_dead(name: str, consumer_idle_ms: int, beats: dict[str, Heartbeat], now_s: float,
            stale_after_s: float) -> bool:
    """Whether consumer ``name``'s pending entries may be taken from it (``now_s``: the server's time
    read with ``beats``).

    A worker with a fresh heartbeat is alive however long its generations run. A consumer that
    never beat (a raw client, or a worker whose heartbeat is unreadable) counts as dead once it
    has been idle for ``stale_after_s``.
    """
    beat = beats.get(name)
    if beat is None:
        return consumer_idle_ms > stale_after_s * 1000
    return beat.is_stale(now_s, stale_after_s)
