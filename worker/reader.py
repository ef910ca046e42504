"""The reader thread: takes entries from the lanes (most urgent first, only as many as the engine
can admit soon), reclaims dead consumers' entries, triages everything into the two queues, and
aborts cancelled requests (at admission, and while they run: the one cancellation poll).

Imports redis and producer (keys, schema); never the engine object (it only sees queues and Load).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import redis

from producer.keys import CONSUMER_GROUP, Keys
from producer.schema import ErrorCode, GenerationResult, peek_request_id
from worker.config import WorkerConfig
from worker.backoff import Backoff
from worker.heartbeat import as_text
from worker.intake import IntakePolicy, answer, triage
from worker.messages import Abort, Admit, DeadLetter, Entry, Finish, Incoming, Outgoing
from worker.reclaim import Reclaimed, Reclaimer
from worker.state import Load

log = logging.getLogger("tokenmill.worker")

# Redis error replies that pass on their own: retried with backoff for as long as they last.
TRANSIENT_ERROR_PREFIXES = ("OOM", "LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN", "READONLY")
MAX_HARD_ERRORS = 10  # other errors in a row (with backoff, about half a minute) end the reader


class Reader:
    """Feeds the engine thread (``inbox``) and the writer (``outbox``) from Redis.

    Args:
        client: Redis client (thread-safe pool; a blocking read holds one connection).
        keys: key layout of the served queue.
        config: worker settings (batch sizes, block time, reclaim policy, cancellation poll).
        load: shared counters (backpressure, the engine's live ids).
        inbox: admits and aborts for the engine thread.
        outbox: immediate answers and dead letters for the writer.
        model_names: the names a request's ``model`` may give (served and configured).
    """

    def __init__(self, client: redis.Redis, keys: Keys, config: WorkerConfig, load: Load,
                 inbox: queue.Queue[Incoming], outbox: queue.Queue[Outgoing], model_names: frozenset[str]) -> None:
        self._client, self._keys, self._config, self._load = client, keys, config, load
        self._inbox, self._outbox = inbox, outbox
        # NOTE: reclaim keeps the heartbeat's pace: it looks once per beat, and claims only entries idle
        # for half a beat (longer than two reclaimers racing, shorter than any dead worker's silence).
        self._reclaimer = Reclaimer(client, keys, config.name, config.stale_after_s,
                                    min_idle_ms=int(config.heartbeat_interval_s * 500))
        self._intake = IntakePolicy(keys, model_names, config.name, config.max_request_bytes)
        self._backoff = Backoff()
        self._next_reclaim_s = self._next_cancel_poll_s = 0.0
        self._needs_groups = True  # (re-)create the consumer groups before the next read
        # Lanes whose entries already delivered to this consumer name are still to be re-read
        # (a restart under the same --name), with the id to read after.
        self._backlog: dict[str, str] = {stream: "0" for stream in keys.lanes}
        self.stopping = threading.Event()  # set by the worker: read nothing more
        self.closing = threading.Event()  # set by the worker: poll cancellations no more, end the thread
        self.drained = threading.Event()  # set in burst mode when every lane came back empty

    def _ensure_groups(self) -> None:
        """Create the consumer group on every lane (MKSTREAM, from id 0) if missing."""
        for stream in self._keys.lanes:
            try:
                self._client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._needs_groups = False

    def run(self, burst: bool) -> None:
        """Read until :attr:`stopping` is set (or, with ``burst``, until the lanes are empty), and
        poll cancellations of running requests until :attr:`closing` is set.

        Redis errors never end the loop: a lost consumer group (``NOGROUP``: the lanes were
        deleted, or a Redis without persistence restarted) is re-created, and transient errors
        (connection, ``OOM``, ``LOADING``, ``BUSY``) are retried with backoff. Only a run of
        :data:`MAX_HARD_ERRORS` other errors in a row ends the thread, which makes the worker
        exit non-zero rather than heartbeat while doing nothing.
        """
        num_hard_errors = 0
        is_reading = True
        while not self.closing.is_set():
            try:
                self._poll_cancels()
                if is_reading and not self.stopping.is_set():
                    is_reading = not self._read_once(burst)
                else:
                    self.closing.wait(self._config.cancel_poll_s)
                num_hard_errors = 0
                self._backoff.reset()
            except redis.RedisError as exc:
                num_hard_errors = self._on_redis_error(exc, num_hard_errors)

    def _read_once(self, burst: bool) -> bool:
        """One round: reclaim when due, then read as much as the engine can take; True when drained."""
        if self._needs_groups:
            self._ensure_groups()
        now_s = time.monotonic()
        # NOTE: reclaiming moves entries into this consumer's pending list, where the backlog
        # read would meet them again: this worker's own backlog goes first.
        if not self._backlog and now_s >= self._next_reclaim_s:
            num_reclaimed, capacity = self._take_reclaimed()
            # NOTE: a full batch means more may be waiting: go on at once while there is room.
            is_more = num_reclaimed >= capacity
            self._next_reclaim_s = now_s + (0.0 if is_more else self._config.heartbeat_interval_s)
        capacity = self._load.capacity(self._config.max_waiting)
        if capacity == 0:
            self._load.wait_for_room(0.05)
            return False
        count = min(capacity, self._config.read_count)
        if self._backlog:
            self._dispatch(self._read_backlog(count))
            return False
        # NOTE: while requests run, a read blocks no longer than one cancellation poll period.
        block_ms = self._config.block_ms
        if self._load.live_ids:
            block_ms = min(block_ms, int(self._config.cancel_poll_s * 1000) or 1)
        entries = self._read_lanes(count, block_ms=None if burst else block_ms)
        if burst and not entries and self._take_reclaimed()[0] == 0:
            self.drained.set()
            return True
        if not self.stopping.is_set():  # NOTE: entries read while stopping stay pending: handed over
            self._dispatch(entries)
        return False

    def _on_redis_error(self, exc: redis.RedisError, num_hard_errors: int) -> int:
        """Log, repair or back off after a failed round; returns the new count of hard errors.

        Raises:
            redis.RedisError: ``exc`` again after too many hard errors in a row.
        """
        message = str(exc)
        if "NOGROUP" in message:
            log.warning("consumer group missing; re-creating it", extra={"event": "group_recreated"})
            self._backlog.clear()  # a new group has no pending entries of ours
            self._needs_groups = True
            return num_hard_errors
        is_transient = isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) or message.startswith(
            TRANSIENT_ERROR_PREFIXES)
        log.warning("redis unavailable" if is_transient else "redis error",
                    extra={"event": "redis_error", "error": message})
        if not is_transient:
            num_hard_errors += 1
            if num_hard_errors >= MAX_HARD_ERRORS:
                raise exc
        self._backoff.wait(self.closing)
        return num_hard_errors

    def _poll_cancels(self) -> None:
        """Abort cancelled live requests: one ZMSCORE over the engine's live ids per ``cancel_poll_s``.
        NOTE: a hit is sent again each poll until the engine drops it; a repeated abort is a no-op."""
        now_s = time.monotonic()
        if now_s < self._next_cancel_poll_s:
            return
        self._next_cancel_poll_s = now_s + self._config.cancel_poll_s
        for request_id in self._cancelled_ids(sorted(self._load.live_ids)):
            self._inbox.put(Abort(request_id, "cancelled"))

    def _read_lanes(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` new entries, lane 0 first; blocks only when every lane is empty."""
        entries: list[Entry] = []
        for stream in self._keys.lanes:
            if len(entries) < count:
                entries += self._xreadgroup({stream: ">"}, count - len(entries), None)
        if not entries and block_ms is not None:
            entries = self._xreadgroup({s: ">" for s in self._keys.lanes}, count, block_ms)
        return entries

    def _read_backlog(self, count: int) -> list[Entry]:
        """The next page of entries already delivered to this consumer name, most urgent lane first.

        A page shorter than asked ends that lane's backlog; the cursor moves past every entry,
        including ones deleted from the stream meanwhile (those are acked: nothing to run).
        """
        stream = next(iter(self._backlog))
        reply: Any = self._client.xreadgroup(CONSUMER_GROUP, self._config.name, {stream: self._backlog[stream]},
                                             count=count)
        items = reply[0][1] if reply else []
        if len(items) < count:
            del self._backlog[stream]
        else:
            self._backlog[stream] = items[-1][0]
        lane = self._keys.lanes.index(stream)
        deleted = [eid for eid, fields in items if not fields]
        if deleted:
            self._client.xack(stream, CONSUMER_GROUP, *deleted)
        return [Entry(stream, as_text(eid), lane, dict(fields)) for eid, fields in items if fields]

    def _xreadgroup(self, streams: dict[Any, Any], count: int, block_ms: int | None) -> list[Entry]:
        reply: Any = self._client.xreadgroup(CONSUMER_GROUP, self._config.name, streams, count=count,
                                             block=block_ms)
        lanes = {stream: k for k, stream in enumerate(self._keys.lanes)}
        out = []
        for raw_stream, items in reply or []:
            stream = as_text(raw_stream)
            out += [Entry(stream, as_text(eid), lanes[stream], dict(fields)) for eid, fields in items if fields]
        return out

    def _take_reclaimed(self) -> tuple[int, int]:
        """Claim dead consumers' entries, as many as the engine can take; returns (claimed, asked)."""
        capacity = max(1, self._load.capacity(self._config.max_waiting))
        claimed = self._reclaimer.reclaim(capacity)
        fresh = []
        for item in claimed:
            if item.num_deliveries > self._config.max_deliveries:
                self._outbox.put(self._dead_letter(item))
            else:
                fresh.append(item.entry)
        self._dispatch(fresh)
        return len(claimed), capacity

    def _dead_letter(self, item: Reclaimed) -> DeadLetter:
        reason = f"{ErrorCode.MAX_DELIVERIES.value}: delivered {item.num_deliveries} times"
        request_id = peek_request_id(item.entry.fields)
        result = None
        if request_id is not None:
            result = GenerationResult.failure(request_id, ErrorCode.MAX_DELIVERIES, reason, worker=self._config.name)
        log.warning("dead-lettered", extra={"event": "dead_lettered", "request_id": request_id, "reason": reason})
        return DeadLetter(item.entry, reason, result)

    def _dispatch(self, entries: list[Entry]) -> None:
        now_s = time.time()
        decided = [self._triage(e, now_s) for e in entries]
        admits = [d for d in decided if isinstance(d, Admit)]
        cancelled = self._cancelled_ids([a.request.id for a in admits])
        for item in decided:
            if isinstance(item, Admit) and item.request.id in cancelled:
                self._outbox.put(answer(item.request, item.entry, "cancelled", "cancelled before it ran",
                                        self._config.name, status="cancelled"))
            elif isinstance(item, Admit):
                self._load.add_queued(1)
                self._inbox.put(item)
            else:
                self._log_refusal(item)
                self._outbox.put(item)

    def _triage(self, entry: Entry, now_s: float) -> Admit | Finish | DeadLetter:
        """:func:`triage`, turning any failure into a dead letter that says why (never a lost entry)."""
        try:
            return triage(entry, now_s, self._intake)
        except Exception as exc:  # noqa: BLE001 - one entry's problem must not stop the reader
            log.exception("triage failed", extra={"event": "triage_failed", "entry_id": entry.entry_id})
            return DeadLetter(entry, reason=f"{ErrorCode.INTERNAL.value}: triage failed: {type(exc).__name__}: {exc}")

    def _cancelled_ids(self, request_ids: list[str]) -> set[str]:
        if not request_ids:
            return set()
        scores = self._client.zmscore(self._keys.cancel, request_ids)
        return {rid for rid, score in zip(request_ids, scores) if score is not None}

    @staticmethod
    def _log_refusal(item: Finish | DeadLetter) -> None:
        if isinstance(item, DeadLetter):
            log.warning("dead-lettered", extra={"event": "dead_lettered", "entry_id": item.entry.entry_id,
                                                "reason": item.reason})
        else:
            error = item.result.error
            log.info("refused", extra={"event": "error", "request_id": item.result.id,
                                       "code": error.code if error else item.result.status})
