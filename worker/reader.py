"""The reader thread: takes entries from the lanes (most urgent first, only as many as the engine
can admit soon), reclaims dead consumers' entries, and triages everything into the two queues.

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
from worker.intake import answer, triage
from worker.messages import Admit, DeadLetter, Entry, Finish, Incoming, Outgoing
from worker.reclaim import Reclaimed, Reclaimer
from worker.state import Load

log = logging.getLogger("tokenmill.worker")


class Reader:
    """Feeds the engine thread (``inbox``) and the writer (``outbox``) from Redis.

    Args:
        client: Redis client (thread-safe pool; a blocking read holds one connection).
        keys: key layout of the served queue.
        config: worker settings (batch sizes, block time, reclaim policy).
        load: shared counters (backpressure).
        inbox: admits for the engine thread.
        outbox: immediate answers and dead letters for the writer.
        model_name: the model the engine serves.
    """

    def __init__(self, client: redis.Redis, keys: Keys, config: WorkerConfig, load: Load,
                 inbox: queue.Queue[Incoming], outbox: queue.Queue[Outgoing], model_name: str) -> None:
        self._client, self._keys, self._config, self._load = client, keys, config, load
        self._inbox, self._outbox, self._model_name = inbox, outbox, model_name
        self._reclaimer = Reclaimer(client, keys, config.name, config.stale_after_s, config.reclaim_min_idle_ms)
        self.stopping = threading.Event()  # set by the worker: read nothing more
        self.drained = threading.Event()  # set in burst mode when every lane came back empty

    def ensure_groups(self) -> None:
        """Create the consumer group on every lane (MKSTREAM, from id 0) if missing."""
        for stream in self._keys.lanes:
            try:
                self._client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def run(self, burst: bool) -> None:
        """Read until :attr:`stopping` is set (or, with ``burst``, until the lanes are empty)."""
        self._dispatch(self._read_lanes(self._config.read_count, block_ms=None, start_id="0"))
        next_reclaim_s = 0.0
        while not self.stopping.is_set():
            try:
                if time.monotonic() >= next_reclaim_s:
                    self._take_reclaimed()
                    next_reclaim_s = time.monotonic() + self._config.reclaim_interval_s
                capacity = self._load.capacity(self._config.max_waiting)
                if capacity == 0:
                    self._load.wait_for_room(0.05)
                    continue
                block_ms = None if burst else self._config.block_ms
                entries = self._read_lanes(min(capacity, self._config.read_count), block_ms)
                if burst and not entries and self._nothing_to_reclaim():
                    self.drained.set()
                    return
                if not self.stopping.is_set():  # NOTE: entries read while stopping stay pending: handed over
                    self._dispatch(entries)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("redis unavailable", extra={"event": "redis_error", "error": str(exc)})
                self.stopping.wait(1.0)

    def _read_lanes(self, count: int, block_ms: int | None, start_id: str = ">") -> list[Entry]:
        """Up to ``count`` entries, lane 0 first; blocks on all lanes only when every lane is empty."""
        entries: list[Entry] = []
        for stream in self._keys.lanes:
            if len(entries) < count:
                entries += self._xreadgroup({stream: start_id}, count - len(entries), None)
        if not entries and block_ms is not None and start_id == ">":
            entries = self._xreadgroup({s: ">" for s in self._keys.lanes}, count, block_ms)
        return entries

    def _xreadgroup(self, streams: dict[Any, Any], count: int, block_ms: int | None) -> list[Entry]:
        reply: Any = self._client.xreadgroup(CONSUMER_GROUP, self._config.name, streams, count=count,
                                             block=block_ms)
        lanes = {stream: k for k, stream in enumerate(self._keys.lanes)}
        out = []
        for raw_stream, items in reply or []:
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            out += [Entry(stream, eid.decode(), lanes[stream], dict(fields)) for eid, fields in items if fields]
        return out

    def _take_reclaimed(self) -> int:
        capacity = max(1, self._load.capacity(self._config.max_waiting))
        fresh = []
        for item in self._reclaimer.reclaim(capacity):
            if item.num_deliveries > self._config.max_deliveries:
                self._outbox.put(self._dead_letter(item))
            else:
                fresh.append(item.entry)
        self._dispatch(fresh)
        return len(fresh)

    def _nothing_to_reclaim(self) -> bool:
        return self._take_reclaimed() == 0

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
        decided = [triage(e, now_s, self._model_name, self._config.name) for e in entries]
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
