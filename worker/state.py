"""Counters shared by the worker's threads (engine, reader, writer) behind one lock.

Standard library only; holds numbers and id snapshots, never Redis clients or the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.engine.core.stats import EngineStats, LengthStats


@dataclass
class Load:
    """How busy the engine is, for backpressure and cancellation polling (reader) and heartbeats (writer).

    The engine thread publishes ``num_waiting`` / ``num_running`` / ``live_ids`` after each
    step; the reader counts admits it queued that the engine thread has not taken yet.
    """

    num_waiting: int = 0  # requests waiting inside the engine
    num_running: int = 0  # requests the engine is generating
    num_queued: int = 0  # admits handed to the engine thread, not yet added to the engine
    num_tokens: int = 0  # completion tokens generated since start
    num_finished: int = 0  # results handed to the writer since start
    live_ids: frozenset[str] = frozenset()  # request ids inside the engine, not yet aborted
    prefix_hit_ratio: float = 0.0  # of prompt tokens looked up in the prefix cache
    kv_usage: float | None = None  # used fraction of the device KV pool (None before the engine's first stats)
    num_cached_blocks: int = 0  # KV blocks the prefix cache indexes
    spec_acceptance_rate: float | None = None  # speculative draft tokens kept / run; None before any draft
    spec_mean_accepted_length: float | None = None  # speculative draft tokens kept per draft; None before any
    length: LengthStats = field(default_factory=LengthStats)  # output-length prediction after the last step
    is_write_blocked: bool = False  # Redis refused the writer's last round: read nothing more until one succeeds
    # NOTE: (stream, entry id) of every entry this worker took (read, reclaimed, recovered) and has
    # not answered yet, wherever it is: reader, preparation, engine, outbox, a failed write. Its own
    # pending list in Redis minus these are entries it lost (a reply that never arrived).
    _held: set[tuple[str, str]] = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _room: threading.Event = field(default_factory=threading.Event, repr=False)

    def capacity(self, max_waiting: int) -> int:
        """How many more entries the reader may take now (0 at the high-water mark, or while
        results cannot be written: taking more work then would only strand it in this worker)."""
        with self._lock:
            if self.is_write_blocked:
                return 0
            return max(0, max_waiting - self.num_waiting - self.num_queued)

    def add_queued(self, delta: int) -> None:
        """The reader queued (+n) or the engine thread took (-n) admits."""
        with self._lock:
            self.num_queued += delta

    def publish(self, num_waiting: int, num_running: int, live_ids: frozenset[str],
                stats: EngineStats | None = None) -> None:
        """Engine thread: the engine's queues after a step, and now and then its whole stats (None: not this
        step); wakes a reader waiting for room."""
        with self._lock:
            had_room_for_less = num_waiting < self.num_waiting
            self.num_waiting, self.num_running, self.live_ids = num_waiting, num_running, live_ids
            if stats is not None:
                self.prefix_hit_ratio, self.num_cached_blocks = stats.prefix.hit_ratio, stats.num_cached_blocks
                self.kv_usage = stats.num_used_gpu_blocks / stats.num_gpu_blocks if stats.num_gpu_blocks else None
                self.length = stats.length
                if stats.speculation.num_drafts:
                    self.spec_acceptance_rate = stats.speculation.acceptance_rate
                    self.spec_mean_accepted_length = stats.speculation.mean_accepted_length
        if had_room_for_less or num_waiting == 0:
            self._wake_reader()

    def set_write_blocked(self, is_blocked: bool) -> None:
        """Writer: whether Redis refuses its writes; unblocking wakes the reader."""
        with self._lock:
            was_blocked, self.is_write_blocked = self.is_write_blocked, is_blocked
        if was_blocked and not is_blocked:
            self._wake_reader()

    def count_finished(self, num_tokens: int) -> None:
        """Engine thread: one request finished after generating ``num_tokens``."""
        with self._lock:
            self.num_finished += 1
            self.num_tokens += num_tokens

    def hold(self, entries: Iterable[tuple[str, str]]) -> None:
        """Reader: it took these ``(stream, entry id)`` entries (before it hands them on)."""
        with self._lock:
            self._held.update(entries)

    def release(self, entries: Iterable[tuple[str, str]]) -> None:
        """Writer: these entries are answered (acked); wakes the reader (a suspect may be next)."""
        with self._lock:
            self._held.difference_update(entries)
        self._wake_reader()

    def held_ids(self, stream: str) -> frozenset[str]:
        """Entry ids of ``stream`` this worker holds."""
        with self._lock:
            return frozenset(entry_id for held_stream, entry_id in self._held if held_stream == stream)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def _wake_reader(self) -> None:
        """Wake a reader waiting for room. NOTE: only when not set already: ``Event.set`` takes its condition's lock
        and notifies, after every engine iteration and every write. A set skipped while the event is set loses no
        wake: the reader clears it when it wakes (:meth:`wait_for_room`) and then looks at the load again."""
        if not self._room.is_set():
            self._room.set()

    def wait_for_room(self, timeout_s: float) -> None:
        """Reader: sleep until the engine takes work or an entry is answered, at most ``timeout_s``."""
        self._room.wait(timeout_s)
        self._room.clear()
