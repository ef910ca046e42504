"""The reader thread: takes entries from the lanes it serves (the shared lanes and those of every
name of its model: most urgent first, only as many as the engine can admit soon), reclaims dead
consumers' entries from them, triages everything into the two queues, and aborts cancelled requests
(at admission, and while they run: the one cancellation poll).

:class:`Reader` coordinates; each job has its own module: reading the lanes (worker/lane_reads.py),
reclaiming (worker/reclaim.py, following the shard claims of worker/shard_claims.py), running suspects
alone (worker/suspects.py, worker/poison.py), this worker's own pending list: its backlog and its lost
deliveries (worker/pending.py), the cancel marks (worker/cancels.py) and handing entries on
(worker/dispatch.py). Entries that come back after their worker died are suspects (docs/design.md,
"Reclaim by heartbeats").

Imports redis, protocol (keys, shards, connection); never the engine object (it only sees queues and Load).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import redis

from tokenmill.protocol.connection import REDIS_ERRORS, is_transient
from tokenmill.protocol.keys import Keys, Lane
from tokenmill.protocol.outcomes import AbortReason
from tokenmill.protocol.shards import QueueLayout
from tokenmill.worker.backoff import Backoff
from tokenmill.worker.cancels import CancelMarks
from tokenmill.worker.config import WorkerConfig
from tokenmill.worker.dispatch import Dispatcher
from tokenmill.worker.health import RedisHealth
from tokenmill.worker.heartbeat import read_workers
from tokenmill.worker.lane_reads import LaneReads
from tokenmill.worker.messages import Abort, Incoming, Outbound
from tokenmill.worker.pending import OwnPending
from tokenmill.worker.poison import AloneMark
from tokenmill.worker.reclaim import Reclaimer
from tokenmill.worker.shard_claims import ShardClaims
from tokenmill.worker.state import Load
from tokenmill.worker.suspects import Suspects

log = logging.getLogger("tokenmill.worker")

# Redis error replies that pass on their own: retried with backoff for as long as they last.
TRANSIENT_ERROR_PREFIXES = ("OOM", "LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN", "READONLY")
MAX_HARD_ERRORS = 10  # other errors in a row (with backoff, about half a minute) end the reader


class Reader:
    """Feeds the engine thread (``inbox``) and the writer (``outbox``) from Redis.

    Args:
        client: Redis client (thread-safe pool; a blocking read holds one connection).
        keys: the served queue's shards (or, for a queue of one shard, its keys).
        config: worker settings (batch sizes, block time, reclaim policy, cancellation poll).
        load: shared counters (backpressure, the engine's live ids).
        inbox: admits and aborts for the engine thread.
        outbox: immediate answers and dead letters for the writer.
        model_names: the names a request's ``model`` may give (served and configured): the reader reads
            their lanes besides the shared ones, and so only ever takes requests it can serve.
        lanes: the lanes it reads (:func:`worker.lane_reads.lanes_for_role`); default: the request lanes of
            ``model_names``.
        health: records the reader's failing Redis calls (and decides when it gives up).
        readers_per_shard: how many live workers read each shard (worker/shard_claims.py); 0 = all of them.
    """

    def __init__(self, client: redis.Redis, keys: Keys | QueueLayout, config: WorkerConfig, load: Load,
                 inbox: queue.Queue[Incoming], outbox: queue.Queue[Outbound], model_names: frozenset[str],
                 health: RedisHealth, lanes: list[Lane] | None = None, readers_per_shard: int = 0) -> None:
        layout = keys if isinstance(keys, QueueLayout) else QueueLayout.single(keys)
        self._layout, self._client, self._config, self._load = layout, client, config, load
        self._health, self._inbox = health, inbox
        # Every lane this worker may read, of every shard, most urgent first (docs/design.md, "Redis keys").
        all_lanes = lanes if lanes is not None else layout.lanes_for(model_names)
        self._lanes = LaneReads(client, layout, config.name, all_lanes, model_names)
        self._claims = ShardClaims(config.name, layout.num_shards, readers_per_shard, config.stale_after_s)
        # NOTE: reclaim keeps the heartbeat's pace: it looks once per beat, and claims only entries idle
        # for half a beat (longer than two reclaimers racing, shorter than any dead worker's silence).
        self._reclaimer = Reclaimer(client, layout.home, all_lanes, config.name, config.stale_after_s,
                                    min_idle_ms=int(config.heartbeat_interval_s * 500))
        self._read_claimed()
        self._own = OwnPending(client, config.name, all_lanes, config.pending_check_interval_s)
        self._alone = AloneMark(client, config.name)  # the entry this worker holds alone (worker/poison.py)
        self._cancels = CancelMarks(client, layout, config.cancel_poll_s)
        self._suspects = Suspects(client, all_lanes, config, load, outbox, self._own, self._alone)
        self._dispatcher = Dispatcher(client, layout, self._lanes.lane_of, model_names, config, load, inbox, outbox,
                                      self._cancels, self._own, self._alone)
        self._backoff = Backoff()
        self._next_reclaim_s = 0.0
        self.stopping = threading.Event()  # set by the worker: read nothing more
        self.closing = threading.Event()  # set by the worker: poll cancellations no more, end the thread
        self.drained = threading.Event()  # set in burst mode when every lane came back empty
        self.reading = threading.Event()  # set once the lanes' groups exist and reads begin (the worker's /ready)

    def _read_claimed(self) -> None:
        """Read (and reclaim from) the lanes of the shards claimed now; new lanes get their groups first."""
        self._lanes.read_shards(self._claims.shards)
        self._reclaimer.lanes = self._lanes.reading

    def _ensure_groups(self) -> None:
        self._lanes.ensure_groups()
        self.reading.set()

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
                for request_id in self._cancels.poll(self._load.live_ids):
                    self._inbox.put(Abort(request_id, AbortReason.CANCELLED))
                if is_reading and not self.stopping.is_set():
                    is_reading = not self._read_once(burst)
                else:
                    self.closing.wait(self._config.cancel_poll_s)
                num_hard_errors = 0
                self._backoff.reset()
                self._health.succeeded("tm-reader")
            except REDIS_ERRORS as exc:
                num_hard_errors = self._on_redis_error(exc, num_hard_errors)
        try:
            self._alone.clear()  # NOTE: a clean stop is no death: what it held alone is not to blame
        except REDIS_ERRORS:
            log.warning("could not clear the alone mark", extra={"event": "redis_error"})

    def _read_once(self, burst: bool) -> bool:
        """One round: run the next suspect, or take this name's backlog, or check the pending list and
        reclaim when due and then read as much as the engine can take; True when drained."""
        if self._lanes.needs_groups:
            self._ensure_groups()
        if self._suspects:
            entry = self._suspects.run_next()
            if entry is not None:
                self._dispatcher.dispatch([entry], is_marked=True)
            return False
        # NOTE: reclaiming moves entries into this consumer's pending list, where the backlog
        # would meet them again: this worker's own backlog goes first.
        if self._own.has_backlog:
            self._suspects.add_backlog(self._own.backlog_page(self._config.read_batch))
            return False
        now_s = time.monotonic()
        if self._own.is_check_due(now_s):
            self._take_back_lost()
        if now_s >= self._next_reclaim_s:
            num_reclaimed, capacity = self._take_reclaimed()
            # NOTE: a full batch means more may be waiting: go on at once while there is room.
            is_more = num_reclaimed >= capacity
            self._next_reclaim_s = now_s + (0.0 if is_more else self._config.heartbeat_interval_s)
            if num_reclaimed:
                return False
        capacity = self._load.capacity(self._config.max_waiting)
        if capacity == 0:
            self._load.wait_for_room(0.05)
            return False
        count = min(capacity, self._config.read_batch)
        # NOTE: while requests run, a read blocks no longer than one cancellation poll period.
        block_ms = self._config.idle_wait_ms
        if self._load.live_ids:
            block_ms = min(block_ms, int(self._config.cancel_poll_s * 1000) or 1)
        entries = self._lanes.read(count, block_ms=None if burst else block_ms)
        if burst and not entries and self._take_reclaimed()[0] == 0:
            self.drained.set()
            return True
        if not self.stopping.is_set():  # NOTE: entries read while stopping stay pending: handed over
            self._dispatcher.dispatch(entries)
        return False

    def _on_redis_error(self, exc: Exception, num_hard_errors: int) -> int:
        """Log, repair or back off after a failed round; returns the new count of hard errors. A cluster failing
        over or moving slots (CLUSTERDOWN, TRYAGAIN, MOVED, no node reachable) is transient, like a lost connection.

        Raises:
            redis.RedisError: ``exc`` again after too many hard errors in a row.
            RedisGaveUp: Redis failed every call for ``redis_give_up_s``.
        """
        message = str(exc)
        if "NOGROUP" in message:
            log.warning("consumer group missing; re-creating it", extra={"event": "group_recreated"})
            self._own.forget_backlog()  # a new group has no pending entries of ours
            self._lanes.needs_groups = True
            return num_hard_errors
        # NOTE: a command that ran but whose reply never came (an XREADGROUP, a claim) left entries in
        # this worker's pending list that it does not hold: look for them once Redis answers again.
        is_passing = is_transient(exc)
        if is_passing:
            self._own.ask_for_check()
        is_passing = is_passing or message.startswith(TRANSIENT_ERROR_PREFIXES)
        log.warning("redis unavailable" if is_passing else "redis error",
                    extra={"event": "redis_error", "error": message, "error_type": type(exc).__name__})
        self._health.failed("tm-reader", exc)
        if not is_passing:
            num_hard_errors += 1
            if num_hard_errors >= MAX_HARD_ERRORS:
                raise exc
        self._backoff.wait(self.closing)
        return num_hard_errors

    def _take_back_lost(self) -> None:
        """Take back the entries pending for this worker that it does not hold (:meth:`OwnPending.lost`).

        Delivered once, such an entry was never anywhere else and runs as usual (that delivery is the one it
        gets now); delivered more often, it is a suspect like any reclaimed entry.
        """
        lost = self._own.lost(self._load)
        if not lost:
            return
        log.warning("taking back entries whose delivery was lost", extra={"event": "pending_recovered",
                                                                          "count": len(lost)})
        self._suspects.add([p for p in lost if p.num_deliveries > 1])
        entries = []
        for item in lost:
            if item.num_deliveries == 1:
                entry, _ = self._own.deliver(item, is_counted=False)
                entries += [entry] if entry is not None else []
        self._dispatcher.dispatch(entries)

    def _take_reclaimed(self) -> tuple[int, int]:
        """Follow the live workers' claims on the shards, then claim dead consumers' entries (suspects) from the
        lanes read, as many as the engine can take; returns (claimed, asked)."""
        capacity = max(1, self._load.capacity(self._config.max_waiting))
        # NOTE: judged by the server's clock, not this worker's
        workers = read_workers(self._client, self._layout.home)
        if self._layout.is_sharded and self._claims.update(workers.beats, workers.now_s):
            log.info("shards claimed", extra={"event": "shards_claimed", "shards": sorted(self._claims.shards)})
            self._read_claimed()
            self._ensure_groups()
        claimed = self._reclaimer.reclaim(capacity, workers)
        self._suspects.add(claimed)
        return len(claimed), capacity

    @property
    def claimed_shards(self) -> frozenset[int]:
        """The shards this worker reads now (worker/shard_claims.py)."""
        return self._claims.shards
