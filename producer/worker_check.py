"""Whether the live workers read what a producer writes: its queue layout (prefix, queue, shards, lanes) and
models against those the workers publish in their heartbeats (protocol/heartbeat.py).

A producer whose settings differ from the workers' writes keys nobody reads: its requests wait until a
timeout, with no error. So a producer looks at the workers hash on its first submit, then at most every
:data:`CHECK_EVERY_S` (one round trip, the hash and the server's clock: liveness by that clock only), and
logs a warning naming what it uses, what the workers use, and the setting to change. The hash is read
under both spellings of the queue's keys (braced ``{prefix:queue}`` and plain ``prefix:queue``): a
producer whose shard count or hash tagging differs from the workers' finds them under the other one.
A wrong prefix or queue name finds no heartbeat at all, which is the warning (finding the workers'
real prefix would take a SCAN: not done).

The reads are queued on the caller's pipeline (sync or asyncio); the rest is pure. Never imports torch,
the engine or the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.producer.config import ProducerConfig
from tokenmill.protocol.heartbeat import (
    READ_WORKERS_LUA,
    STALE_AFTER_S,
    Heartbeat,
    decode_heartbeat,
    split_workers_reply,
)
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import GenerationRequest
from tokenmill.protocol.shards import QueueLayout

log = logging.getLogger("tokenmill.producer")

CHECK_EVERY_S = 30.0  # a producer looks at the workers on its first submit, then at most this often
LaneUse = tuple[int, str | None]  # a lane a request is written to: (priority, model or None for the shared one)


def lanes_written(requests: Iterable[GenerationRequest]) -> set[LaneUse]:
    """The lanes ``requests`` go to (of every shard alike)."""
    return {(request.priority, request.model) for request in requests}


def every_lane(num_lanes: int, model: str | None = None) -> set[LaneUse]:
    """Every lane of ``model`` (the shared ones for None): what a producer may write."""
    return {(priority, model) for priority in range(num_lanes)}


def other_spelling(home: Keys) -> Keys:
    """The queue's own keys under the other spelling: plain for braced keys, braced for plain ones."""
    return Keys(home.prefix, home.queue, home.num_lanes, not home.hash_tag)


def queue_worker_reads(pipe: Any, layout: QueueLayout) -> int:
    """Queue the reads :func:`seen_workers` takes (sync or asyncio pipeline) and return how many: the workers
    hash with the server's time under the queue's keys, and off a cluster under their other spelling too (on a
    cluster every worker's keys are braced).

    NOTE: execute_command, as redis-py's sync cluster pipeline has no eval(); EVAL routes by its key on every client.
    """
    pipe.execute_command("EVAL", READ_WORKERS_LUA, 1, layout.home.workers)
    if layout.is_cluster:
        return 1
    pipe.execute_command("EVAL", READ_WORKERS_LUA, 1, other_spelling(layout.home).workers)
    return 2


def raise_first_error(replies: Sequence[Any]) -> None:
    """Raise the first error among the replies of a pipeline run with ``raise_on_error=False``."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


@dataclass(frozen=True)
class SeenWorkers:
    """The live workers a producer finds."""

    here: list[Heartbeat]  # under the producer's own workers hash
    elsewhere: list[Heartbeat]  # under the other spelling of the queue's keys
    num_stale: int  # stale heartbeats under the producer's own hash


def seen_workers(replies: Sequence[Any], stale_after_s: float = STALE_AFTER_S) -> SeenWorkers:
    """The live workers of the replies of :func:`queue_worker_reads` (a failed read of the producer's own hash
    is raised; of the other spelling's, read as none)."""
    here, num_stale = _live(replies[0], stale_after_s)
    other = replies[1] if len(replies) > 1 else None
    elsewhere = [] if other is None or isinstance(other, Exception) else _live(other, stale_after_s)[0]
    return SeenWorkers(here, elsewhere, num_stale)


def _live(reply: Any, stale_after_s: float) -> tuple[list[Heartbeat], int]:
    raw, now_s = split_workers_reply(reply)
    beats = [beat for name, value in raw.items() if (beat := decode_heartbeat(name, value)) is not None]
    live = [beat for beat in beats if not beat.is_stale(now_s, stale_after_s)]
    return live, len(raw) - len(live)


def problems(config: ProducerConfig, seen: SeenWorkers, lanes: Iterable[LaneUse]) -> list[str]:
    """Why requests written to ``lanes`` by a producer with ``config`` would wait for no live worker, one
    sentence each (empty: some live worker reads each of them). A worker of an older release, whose
    heartbeat has no layout, counts as reading every shard and lane."""
    layout = config.layout
    home = layout.home
    if not seen.here:
        if seen.elsewhere:
            return [_found_elsewhere(layout, seen.elsewhere)]
        stale = f" (only {seen.num_stale} stale)" if seen.num_stale else ""
        return [f"no live worker heartbeat under {home.workers}{stale}: no worker reads queue {home.queue!r} under "
                f"prefix {home.prefix!r} ({_shards(layout.num_shards)}, lanes such as {_example_lane(layout)}), so "
                "requests wait until one starts; workers and producers must share [queue] prefix and name "
                f"(TOKENMILL_QUEUE__PREFIX, TOKENMILL_QUEUE__NAME, or {_config_hint()})"]
    readers = [beat for beat in seen.here if beat.shards is None or beat.shards == layout.num_shards]
    if not readers:
        theirs = Counter(beat.shards for beat in seen.here).most_common(1)[0][0]
        example = next(beat for beat in seen.here if beat.shards == theirs)
        return [f"this producer writes queue {home.queue!r} over {_shards(layout.num_shards)} (lanes such as "
                f"{_example_lane(layout)}) but its {_workers(seen.here)} {_read(seen.here)} it over "
                f"{_shards(theirs)}{_their_lane(example)}: set [queue] shards = {theirs} for this producer "
                f"(TOKENMILL_QUEUE__SHARDS={theirs}, or {_config_hint()}); producers and workers must agree on it"]
    found = []
    lanes = set(lanes)
    most = max((beat.num_lanes or 0 for beat in readers), default=0)
    unread = sorted({priority for priority, _ in lanes if priority >= most})
    if unread and all(beat.num_lanes is not None for beat in readers):
        found.append(f"this producer writes lane{'s' if len(unread) > 1 else ''} {', '.join(map(str, unread))} of "
                     f"queue {home.queue!r} "
                     f"(num_lanes = {home.num_lanes}) but its {_workers(readers)} {_read(readers)} lanes "
                     f"0..{most - 1} only: set "
                     f"[queue] num_lanes = {most} for this producer (TOKENMILL_QUEUE__NUM_LANES={most}, or "
                     f"{_config_hint()})")
    served = sorted({name for beat in readers for name in beat.model_names})
    for model in sorted({model for _, model in lanes if model is not None and model not in served}):
        found.append(f"no live worker serves model {model!r} on queue {home.queue!r} (served: "
                     f"{', '.join(map(repr, served)) or 'none'}); its requests wait until one starts")
    return found


def _found_elsewhere(layout: QueueLayout, elsewhere: list[Heartbeat]) -> str:
    """The sentence for a producer that finds the queue's workers only under the other spelling of its keys."""
    home = layout.home
    beat = elsewhere[0]
    if beat.shards is not None and beat.shards != layout.num_shards:
        fix = f"set [queue] shards = {beat.shards} for this producer (TOKENMILL_QUEUE__SHARDS={beat.shards})"
    elif beat.cluster and not layout.is_cluster:
        fix = "set [redis] cluster = true for this producer (or a redis+cluster:// URL)"
    elif beat.hash_tag is not None and beat.hash_tag != home.hash_tag:
        value = str(beat.hash_tag).lower()
        fix = f"set [queue] hash_tag = {value} for this producer (TOKENMILL_QUEUE__HASH_TAG={value})"
    else:
        fix = "use the workers' [queue] shards and hash_tag for this producer"
    theirs = "" if beat.shards is None else f" over {_shards(beat.shards)}"
    beats = "beats" if len(elsewhere) == 1 else "beat"
    return (f"no live worker heartbeat under {home.workers}, but {_workers(elsewhere)} of queue {home.queue!r} "
            f"{beats} under {other_spelling(home).workers}, reading it{theirs}{_their_lane(beat)}, while this "
            f"producer writes it over {_shards(layout.num_shards)} (lanes such as {_example_lane(layout)}): {fix}, "
            f"or {_config_hint()}")


def _example_lane(layout: QueueLayout) -> str:
    return layout.shards[0].lane(layout.home.lane_of("normal"))


def _their_lane(beat: Heartbeat) -> str:
    """`` (lanes such as ...)`` of a worker's published layout; empty for an older worker's beat."""
    if None in (beat.prefix, beat.queue, beat.num_lanes, beat.shards, beat.hash_tag, beat.cluster):
        return ""
    try:
        theirs = QueueLayout.build(str(beat.prefix), str(beat.queue), int(beat.num_lanes or 0),
                                   num_shards=int(beat.shards or 0), hash_tag=bool(beat.hash_tag),
                                   is_cluster=bool(beat.cluster))
    except ValueError:  # NOTE: anyone may write the hash: a layout that is none is not shown
        return ""
    return f" (lanes such as {_example_lane(theirs)})"


def _shards(count: int | None) -> str:
    return f"{count} shard" + ("" if count == 1 else "s")


def _workers(beats: Sequence[Heartbeat]) -> str:
    return f"{len(beats)} live worker" + ("" if len(beats) == 1 else "s")


def _read(beats: Sequence[Heartbeat]) -> str:
    return "reads" if len(beats) == 1 else "read"


def _config_hint() -> str:
    return "TOKENMILL_CONFIG naming the workers' settings file"


class WorkerCheck:
    """When a producer looks at the workers (:data:`CHECK_EVERY_S`), and the warnings it logs. Thread-safe."""

    def __init__(self, config: ProducerConfig, every_s: float = CHECK_EVERY_S) -> None:
        self._config = config
        self._every_s = every_s
        self._next_s = 0.0  # monotonic time of the next look; 0: the first submit looks
        self._lock = threading.Lock()

    def is_due(self) -> bool:
        """Whether to look now; a True answer takes the turn (the next is ``every_s`` later)."""
        now_s = time.monotonic()
        with self._lock:
            if now_s < self._next_s:
                return False
            self._next_s = now_s + self._every_s
            return True

    def warn(self, replies: Sequence[Any], lanes: Iterable[LaneUse]) -> list[str]:
        """Log (warning) and return the :func:`problems` of the replies of :func:`queue_worker_reads`; a reply
        that cannot be read is logged at debug, never raised: the check only advises."""
        try:
            found = problems(self._config, seen_workers(replies), lanes)
        except Exception as exc:  # noqa: BLE001 - a failed read or an odd reply must never fail a submit
            log.debug("could not check the live workers: %s", exc)
            return []
        for problem in found:
            log.warning(problem, extra={"event": "workers_mismatch"})
        return found
