"""Worker heartbeats: the record each worker keeps in the ``{prefix}:{queue}:workers`` hash, its
encoding, and the one rule that decides whether a worker is gone. Pydantic and msgpack only.

Anyone who can write to Redis can write to that hash, so reading never trusts it: a value that is
not a valid heartbeat is skipped (and counts as no heartbeat), never an error.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import msgpack
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("tokenmill.heartbeat")

RUNNING = "running"
STOPPED = "stopped"  # written on a clean exit (or a failing thread): its pending entries may be reclaimed at once
# Heartbeat age (s) after which a worker counts as gone: the default of the worker's own
# ``stale_after_s`` (reclaim) and of every reader of the workers hash (``tokenmill status``, stats, serve).
STALE_AFTER_S = 15.0
MAX_JOBS = 32  # jobs a heartbeat lists (those with the most predicted backlog): a beat stays small


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
    ts: float  # unix time of this beat
    state: str = RUNNING  # running | stopped
    pid: int = Field(default_factory=os.getpid)
    host: str = Field(default_factory=socket.gethostname)
    started_at: float = Field(default_factory=time.time)  # unix time the worker started
    model: str = ""  # model loaded (as configured: alias, id or path)
    served_model_name: str = ""  # the name requests use for it (``/v1/models`` lists these)
    # Every name a request's ``model`` may give to reach this worker: it reads those models' lanes. Empty
    # from a worker of an older release, which reads the shared lanes only (serves no request naming a model).
    model_names: list[str] = Field(default_factory=list)
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
        """Seconds since the beat."""
        return max(0.0, now_s - self.ts)

    def is_stale(self, now_s: float, stale_after_s: float) -> bool:
        """True when the worker stopped cleanly or has not beaten for ``stale_after_s``."""
        return self.state == STOPPED or self.age_s(now_s) > stale_after_s


def encode_heartbeat(beat: Heartbeat) -> bytes:
    packed: bytes = msgpack.packb(beat.model_dump(), use_bin_type=True)
    return packed


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
    """Whether consumer ``name``'s pending entries may be taken from it.

    A worker with a fresh heartbeat is alive however long its generations run. A consumer that
    never beat (a raw client, or a worker whose heartbeat is unreadable) counts as dead once it
    has been idle for ``stale_after_s``.
    """
    beat = beats.get(name)
    if beat is None:
        return consumer_idle_ms > stale_after_s * 1000
    return beat.is_stale(now_s, stale_after_s)
