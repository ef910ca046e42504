"""The writer thread: persists results (atomic finish), token deltas, heartbeats; polls cancellations.

Imports redis and producer (keys); never the engine object. It only drains the outbox and
sends aborts to the engine thread through the inbox.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import redis

from producer.keys import Keys
from worker.config import WorkerConfig
from worker.backoff import Backoff
from worker.heartbeat import RUNNING, STOPPED, Heartbeat, forget_old, read_heartbeats, write_heartbeat
from worker.messages import Abort, DeadLetter, Finish, Incoming, Outgoing
from worker.metrics import WorkerMetrics
from worker.results import ResultWriter
from worker.state import Load

log = logging.getLogger("tokenmill.worker")

MAX_BATCH = 256  # outbox items per pipeline


class Writer:
    """Drains the outbox into Redis and keeps the worker's heartbeat and cancellations current.

    Args:
        client: Redis client.
        keys: key layout of the served queue.
        config: worker settings (TTLs, intervals).
        load: shared counters (live ids to poll for cancellation, heartbeat stats).
        inbox: where cancellations are sent to the engine thread.
        outbox: what to write.
        model_name: the model served, shown in the heartbeat.
        metrics: counts written results; samples rate and lane depth each beat. None = no metrics.
    """

    def __init__(self, client: redis.Redis, keys: Keys, config: WorkerConfig, load: Load,
                 inbox: queue.Queue[Incoming], outbox: queue.Queue[Outgoing], model_name: str,
                 metrics: WorkerMetrics | None = None) -> None:
        self._metrics = metrics
        self._client, self._keys, self._config, self._load = client, keys, config, load
        self._inbox, self._outbox = inbox, outbox
        self._results = ResultWriter(client, keys, config.result_ttl_s, config.done_ttl_s, config.token_ttl_s)
        self._beat = Heartbeat(name=config.name, ts=time.time(), model=model_name)
        self._aborted: set[str] = set()
        self._unwritten: list[Outgoing] = []  # items of a flush that failed, retried first
        self._backoff = Backoff()
        self._last_tokens = (time.monotonic(), 0)
        self.closing = threading.Event()  # set by the worker: flush what is queued, then stop

    def beat(self, state: str = RUNNING) -> None:
        """Write the heartbeat now, with current stats."""
        now = time.monotonic()
        then, tokens_then = self._last_tokens
        self._last_tokens = (now, self._load.num_tokens)
        self._beat.ts, self._beat.state = time.time(), state
        self._beat.running, self._beat.waiting = self._load.num_running, self._load.num_waiting
        self._beat.num_finished = self._load.num_finished
        self._beat.tokens_per_s = (self._load.num_tokens - tokens_then) / max(now - then, 1e-6)
        write_heartbeat(self._client, self._keys, self._beat)
        if self._metrics is not None:
            self._metrics.observe_beat(self._client, self._beat.tokens_per_s)

    def run(self) -> None:
        """Write until :attr:`closing` is set and the outbox is empty; the last beat says ``stopped``.

        Redis errors never end the loop: a failed write is retried with backoff while the
        reader pauses (see :attr:`Load.is_write_blocked`); anything else is a bug and ends the
        thread, which the worker turns into a non-zero exit.
        """
        next_beat_s = next_trim_s = 0.0
        while not (self.closing.is_set() and self._outbox.empty() and not self._unwritten):
            try:
                self._flush(self._take(self._config.cancel_poll_s))
                self._poll_cancels()
                if time.monotonic() >= next_beat_s:
                    self.beat()
                    next_beat_s = time.monotonic() + self._config.heartbeat_interval_s
                if time.monotonic() >= next_trim_s:
                    self._trim()
                    next_trim_s = time.monotonic() + self._config.trim_interval_s
            except redis.RedisError as exc:
                log.warning("redis write failed, retrying", extra={"event": "redis_error", "error": str(exc)})
                self._backoff.wait()
        self.beat(STOPPED)

    def _take(self, timeout_s: float) -> list[Outgoing]:
        try:
            items = [self._outbox.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while len(items) < MAX_BATCH:
            try:
                items.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        return items

    def _flush(self, items: list[Outgoing]) -> None:
        """Write ``items`` after anything a failed flush left.

        A failed round trip keeps every item for the retry. Items Redis refused one by one
        (e.g. ``OOM`` under ``maxmemory``) are kept too, and reads pause until they are written.

        Raises:
            redis.RedisError: the round trip or an item failed; the caller backs off.
        """
        self._unwritten += items
        if not self._unwritten:
            return
        try:
            outcomes = self._results.flush(self._unwritten)
        except redis.RedisError:
            self._load.set_write_blocked(True)
            raise
        self._unwritten = [o.item for o in outcomes if o.error is not None]
        for outcome in outcomes:
            if outcome.error is None:
                self._log_written(outcome.item, outcome.is_stored)
        self._load.set_write_blocked(bool(self._unwritten))
        if self._unwritten:
            first = next(o.error for o in outcomes if o.error is not None)
            raise redis.ResponseError(f"{len(self._unwritten)} result(s) not written: {first}")
        self._backoff.reset()

    def _log_written(self, item: Finish | DeadLetter, was_stored: bool) -> None:
        result = item.result
        if self._metrics is not None:
            self._metrics.observe_result(result, was_stored)
        log.info("finished", extra={"event": "finished", "request_id": result.id if result else None,
                                    "status": result.status if result else "dead", "duplicate": not was_stored,
                                    "tokens": len(result.token_ids) if result else 0})

    def _poll_cancels(self) -> None:
        """One ZMSCORE for all live ids; a hit is aborted once in the engine."""
        live_ids = sorted(self._load.live_ids - self._aborted)
        self._aborted &= self._load.live_ids
        if not live_ids:
            return
        scores = self._client.zmscore(self._keys.cancel, live_ids)
        for request_id, score in zip(live_ids, scores):
            if score is not None:
                self._aborted.add(request_id)
                self._inbox.put(Abort(request_id, "cancelled"))

    def _trim(self) -> None:
        """Forget old cancellations and long-silent workers' heartbeats."""
        now_s = time.time()
        self._client.zremrangebyscore(self._keys.cancel, "-inf", now_s - self._config.cancel_ttl_s)
        forget_old(self._client, self._keys, read_heartbeats(self._client, self._keys), now_s,
                   self._config.heartbeat_forget_s)
