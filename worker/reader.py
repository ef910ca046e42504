"""The reader thread: takes entries from the lanes it serves (the shared lanes and those of every
name of its model: most urgent first, only as many as the engine can admit soon), reclaims dead
consumers' entries from them, triages everything into the two queues, and aborts cancelled requests
(at admission, and while they run: the one cancellation poll).

Entries that come back after their worker died (reclaimed, or left by an earlier process under
this name) are suspects: each runs alone, so a request that kills workers takes no innocent one
with it (docs/design.md, "Reclaim by heartbeats"). The worker also checks its own pending list
against what it holds and takes back entries whose delivery never reached it.

On a sharded queue (protocol/shards.py) it reads and reclaims the lanes of the shards it claims
(worker/shard_claims.py; every shard by default), the shards in turn within a priority; it compares its
pending list with what it holds on every shard's lanes (it may have read a shard it no longer claims).

Imports redis, protocol (keys, shards, schema) and protocol.connection; never the engine object (it only
sees queues and Load).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any

import redis

from tokenmill.protocol.connection import REDIS_ERRORS, is_transient
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys, Lane
from tokenmill.protocol.outcomes import AbortReason, ErrorCode
from tokenmill.protocol.schema import GenerationResult, peek_request_id
from tokenmill.protocol.shards import QueueLayout
from tokenmill.worker.backoff import Backoff
from tokenmill.worker.config import WorkerConfig
from tokenmill.worker.health import RedisHealth
from tokenmill.worker.heartbeat import as_text, read_workers
from tokenmill.worker.intake import IntakePolicy, answer, triage
from tokenmill.worker.messages import Abort, Admit, AdmitBatch, DeadLetter, Entry, Finish, Incoming, Outbound
from tokenmill.worker.pending import OwnDelivery, Pending, list_pending
from tokenmill.worker.poison import AloneMark, find_culprit
from tokenmill.worker.reclaim import Reclaimer
from tokenmill.worker.shard_claims import ShardClaims
from tokenmill.worker.state import Load

log = logging.getLogger("tokenmill.worker")


def lanes_for_role(keys: Keys | QueueLayout, model_names: frozenset[str], role: str,
                   is_fleet_cache_on: bool) -> list[Lane]:
    """The lanes a worker of ``role`` reads (of every shard), most urgent first: a prefill worker the request lanes,
    a decode worker the decode pool's, a worker doing both the request lanes and, with the fleet cache on (a fleet
    that may have prefill workers), the decode pool's too (within a priority the decode lane first: its prompt is
    computed already)."""
    request_lanes = keys.lanes_for(model_names) if role != "decode" else []
    reads_decode = role == "decode" or (role == "both" and is_fleet_cache_on)
    decode_lanes = keys.lanes_for(model_names, is_decode=True) if reads_decode else []
    return sorted(decode_lanes + request_lanes, key=lambda lane: (lane.priority, not lane.is_decode))

# Redis error replies that pass on their own: retried with backoff for as long as they last.
TRANSIENT_ERROR_PREFIXES = ("OOM", "LOADING", "BUSY", "TRYAGAIN", "MASTERDOWN", "CLUSTERDOWN", "READONLY")
MAX_HARD_ERRORS = 10  # other errors in a row (with backoff, about half a minute) end the reader
PENDING_PAGE = 1000  # entries per XPENDING while comparing the pending list with what is held
# NOTE: on a cluster one XREADGROUP names one shard's lanes: an idle worker blocks on the shards in turn, this
# long each (after a non-blocking look at every one), so a request on any shard waits about this long at most.
SHARD_BLOCK_MS = 25


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
        lanes: the lanes it reads (:func:`lanes_for_role`); default: the request lanes of ``model_names``.
        health: records the reader's failing Redis calls (and decides when it gives up).
        readers_per_shard: how many live workers read each shard (worker/shard_claims.py); 0 = all of them.
    """

    def __init__(self, client: redis.Redis, keys: Keys | QueueLayout, config: WorkerConfig, load: Load,
                 inbox: queue.Queue[Incoming], outbox: queue.Queue[Outbound], model_names: frozenset[str],
                 health: RedisHealth, lanes: list[Lane] | None = None, readers_per_shard: int = 0) -> None:
        self._layout = keys if isinstance(keys, QueueLayout) else QueueLayout.single(keys)
        self._client, self._keys, self._config, self._load = client, self._layout.home, config, load
        self._health = health
        self._inbox, self._outbox = inbox, outbox
        self._model_names = model_names
        # Every lane this worker may read, of every shard, most urgent first (docs/design.md, "Redis keys").
        self._all_lanes = lanes if lanes is not None else self._layout.lanes_for(model_names)
        self._lane_of = {lane.stream: lane for lane in self._all_lanes}
        self._claims = ShardClaims(config.name, self._layout.num_shards, readers_per_shard, config.stale_after_s)
        # NOTE: reclaim keeps the heartbeat's pace: it looks once per beat, and claims only entries idle
        # for half a beat (longer than two reclaimers racing, shorter than any dead worker's silence).
        self._reclaimer = Reclaimer(client, self._keys, self._all_lanes, config.name, config.stale_after_s,
                                    min_idle_ms=int(config.heartbeat_interval_s * 500))
        self._reading: list[Lane] = []
        # Stream -> priority lane of every stream this worker reads now (those of the shards it claims).
        self._stream_to_lane: dict[str, int] = {}
        self._read_claimed()
        self._turn = 0  # rotates the shards' order within a priority, and the shard an idle read blocks on
        self._own = OwnDelivery(client, config.name)
        self._alone = AloneMark(client, config.name)  # the entry this worker holds alone (worker/poison.py)
        # NOTE: the entry an earlier process under this name died running alone, looked up with the first backlog page
        self._own_culprit: tuple[str, str] | None | bool = False  # False: not looked up yet
        # NOTE: one policy per shard: a lane parses as its shard's; reply streams are queue-wide in every one
        self._intake = [IntakePolicy(keys, model_names, config.name, config.max_request_bytes)
                        for keys in self._layout.shards]
        self._backoff = Backoff()
        self._next_reclaim_s = self._next_cancel_poll_s = 0.0
        self._next_pending_check_s = time.monotonic() + config.pending_check_interval_s
        self._needs_groups = True  # (re-)create the consumer groups before the next read
        self._needs_pending_check = False  # a connection failed: a reply may have been lost on the way
        # Lanes (of every shard) whose entries already delivered to this consumer name are still to be taken (a
        # restart under the same --name), with the id to list after (None: from the start).
        self._backlog: dict[str, str | None] = dict.fromkeys(self._lane_of)
        # NOTE: entries whose worker died holding them, held here (pending for this worker, counts
        # unchanged) until each runs alone.
        self._suspects: deque[Pending] = deque()
        self.stopping = threading.Event()  # set by the worker: read nothing more
        self.closing = threading.Event()  # set by the worker: poll cancellations no more, end the thread
        self.drained = threading.Event()  # set in burst mode when every lane came back empty
        self.reading = threading.Event()  # set once the lanes' groups exist and reads begin (the worker's /ready)

    def _read_claimed(self) -> None:
        """Read (and reclaim from) the lanes of the shards claimed now; new lanes get their groups first."""
        self._reading = [lane for lane in self._all_lanes if lane.shard in self._claims.shards]
        self._stream_to_lane = {lane.stream: lane.priority for lane in self._reading}
        self._reclaimer.lanes = self._reading
        self._needs_groups = True

    def _ensure_groups(self) -> None:
        """Create the consumer group on every lane read (MKSTREAM, from id 0) if missing, and register
        the model names in every shard (so stats list their lanes)."""
        for stream in self._stream_to_lane:
            try:
                self._client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        if self._model_names:
            for keys in self._layout.shards:
                self._client.sadd(keys.models, *sorted(self._model_names))
        self._needs_groups = False
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
                self._poll_cancels()
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
        if self._needs_groups:
            self._ensure_groups()
        if self._suspects:
            self._run_next_suspect()
            return False
        # NOTE: reclaiming moves entries into this consumer's pending list, where the backlog
        # would meet them again: this worker's own backlog goes first.
        if self._backlog:
            self._take_backlog(self._config.read_batch)
            return False
        now_s = time.monotonic()
        if self._needs_pending_check or now_s >= self._next_pending_check_s:
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
        entries = self._read_lanes(count, block_ms=None if burst else block_ms)
        if burst and not entries and self._take_reclaimed()[0] == 0:
            self.drained.set()
            return True
        if not self.stopping.is_set():  # NOTE: entries read while stopping stay pending: handed over
            self._dispatch(entries)
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
            self._backlog.clear()  # a new group has no pending entries of ours
            self._needs_groups = True
            return num_hard_errors
        # NOTE: a command that ran but whose reply never came (an XREADGROUP, a claim) left entries in
        # this worker's pending list that it does not hold: look for them once Redis answers again.
        is_passing = is_transient(exc)
        self._needs_pending_check = self._needs_pending_check or is_passing
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

    def _poll_cancels(self) -> None:
        """Abort cancelled live requests: one ZMSCORE over the engine's live ids per ``cancel_poll_s``.
        NOTE: a hit is sent again each poll until the engine drops it; a repeated abort is a no-op."""
        now_s = time.monotonic()
        if now_s < self._next_cancel_poll_s:
            return
        self._next_cancel_poll_s = now_s + self._config.cancel_poll_s
        for request_id in self._cancelled_ids(sorted(self._load.live_ids)):
            self._inbox.put(Abort(request_id, AbortReason.CANCELLED))

    def _read_lanes(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` new entries, lane 0 (of every model and shard) first, the shards in turn within a lane;
        blocks only when every lane is empty (on a cluster, on one shard's lanes: :data:`SHARD_BLOCK_MS`)."""
        self._turn += 1
        num_shards = self._layout.num_shards
        order = sorted(self._reading, key=lambda lane: (lane.priority, not lane.is_decode,
                                                        (lane.shard - self._turn) % num_shards))
        entries: list[Entry] = []
        for lane in order:
            if len(entries) < count:
                entries += self._xreadgroup({lane.stream: ">"}, count - len(entries), None)
        groups = self._block_groups(order)
        if not entries and block_ms is not None and groups:
            if len(groups) > 1:
                block_ms = min(block_ms, SHARD_BLOCK_MS)
            entries = self._xreadgroup(dict.fromkeys(groups[self._turn % len(groups)], ">"), count, block_ms)
        return entries

    def _block_groups(self, lanes: list[Lane]) -> list[list[str]]:
        """The lanes one blocking XREADGROUP may name together: all of them on one instance, one shard's on a
        cluster (different slots cannot share a command)."""
        if not self._layout.is_cluster:
            return [[lane.stream for lane in lanes]] if lanes else []
        by_shard: dict[int, list[str]] = {}
        for lane in lanes:
            by_shard.setdefault(lane.shard, []).append(lane.stream)
        return [by_shard[shard] for shard in sorted(by_shard)]

    def _take_backlog(self, count: int) -> None:
        """The next page of entries an earlier process under this name left pending, most urgent lane
        first: suspects, since that process ended holding them (a page shorter than asked ends the lane)."""
        stream = next(iter(self._backlog))
        page = list_pending(self._client, stream, self._lane_of[stream].priority, self._config.name, count,
                            after=self._backlog[stream])
        if len(page) < count:
            del self._backlog[stream]
        else:
            self._backlog[stream] = page[-1].entry_id
        if self._own_culprit is False:
            self._own_culprit = find_culprit(self._client, self._config.name, None, self._all_lanes)
        self._add_suspects([replace(item, killed_its_worker=True) if (item.stream, item.entry_id) == self._own_culprit
                            else item for item in page])

    def _take_back_lost(self) -> None:
        """Compare this worker's pending list with what it holds, and take back what it lost.

        An entry pending for this worker that it does not hold was delivered by a command whose reply
        never arrived. Delivered once, it was never anywhere else and runs as usual (that delivery is
        the one it gets now); delivered more often, it is a suspect like any reclaimed entry.
        """
        self._needs_pending_check = False
        self._next_pending_check_s = time.monotonic() + self._config.pending_check_interval_s
        lost: list[Pending] = []
        for stream, lane in self._lane_of.items():
            held = self._load.held_ids(stream)
            after = None
            while True:
                page = list_pending(self._client, stream, lane.priority, self._config.name, PENDING_PAGE, after=after)
                lost += [p for p in page if p.entry_id not in held]
                if len(page) < PENDING_PAGE:
                    break
                after = page[-1].entry_id
        if not lost:
            return
        log.warning("taking back entries whose delivery was lost", extra={"event": "pending_recovered",
                                                                          "count": len(lost)})
        self._add_suspects([p for p in lost if p.num_deliveries > 1])
        entries = []
        for item in lost:
            if item.num_deliveries == 1:
                entry, _ = self._own.deliver(item, is_counted=False)
                entries += [entry] if entry is not None else []
        self._dispatch(entries)

    def _xreadgroup(self, streams: dict[Any, Any], count: int, block_ms: int | None) -> list[Entry]:
        reply: Any = self._client.xreadgroup(CONSUMER_GROUP, self._config.name, streams, count=count,
                                             block=block_ms)
        out = []
        for raw_stream, items in reply or []:
            stream = as_text(raw_stream)
            out += [Entry(stream, as_text(eid), self._lane_of[stream].priority, dict(fields))
                    for eid, fields in items if fields]
        return out

    def _take_reclaimed(self) -> tuple[int, int]:
        """Follow the live workers' claims on the shards, then claim dead consumers' entries (suspects) from the
        lanes read, as many as the engine can take; returns (claimed, asked)."""
        capacity = max(1, self._load.capacity(self._config.max_waiting))
        workers = read_workers(self._client, self._keys)  # NOTE: judged by the server's clock, not this worker's
        if self._layout.is_sharded and self._claims.update(workers.beats, workers.now_s):
            log.info("shards claimed", extra={"event": "shards_claimed", "shards": sorted(self._claims.shards)})
            self._read_claimed()
            self._ensure_groups()
        claimed = self._reclaimer.reclaim(capacity, workers)
        self._add_suspects(claimed)
        return len(claimed), capacity

    @property
    def claimed_shards(self) -> frozenset[int]:
        """The shards this worker reads now (worker/shard_claims.py)."""
        return self._claims.shards

    def _add_suspects(self, items: list[Pending]) -> None:
        """Queue entries a dead worker held, to run alone one by one; the one it died running alone is
        dead-lettered at once instead (worker/poison.py)."""
        self._load.hold(item.key for item in items)
        for item in items:
            if not item.killed_its_worker:
                self._suspects.append(item)
                continue
            entry, num_deliveries = self._own.deliver(item, is_counted=False)
            if entry is None:  # answered, taken by a reclaimer, or deleted meanwhile
                self._load.release([item.key])
            else:
                self._outbox.put(self._dead_letter(entry, num_deliveries, killed_its_worker=True))

    def _run_next_suspect(self) -> None:
        """Deliver the oldest suspect and run it alone: only once this worker holds nothing but
        suspects, and the next one only after it is answered. A suspect delivered more than
        ``max_deliveries`` times is dead-lettered instead.

        NOTE: if it kills this worker too, only its own delivery count has risen: the suspects
        waiting behind it are still pending here with the counts they had, for the next reclaimer.
        """
        if self._load.num_held > len(self._suspects):
            self._load.wait_for_room(self._config.cancel_poll_s)
            return
        item = self._suspects[0]
        entry, num_deliveries = self._own.deliver(item, is_counted=True)
        self._alone.was_set(item.stream)  # NOTE: the delivery marked it: a death now is its doing
        self._suspects.popleft()
        if entry is None:  # answered, taken by a reclaimer, or deleted meanwhile
            self._load.release([item.key])
        elif num_deliveries > self._config.max_deliveries:
            self._outbox.put(self._dead_letter(entry, num_deliveries))
        else:
            log.info("running a suspect alone", extra={"event": "suspect", "entry_id": entry.entry_id,
                                                        "deliveries": num_deliveries})
            self._dispatch([entry], is_marked=True)

    def _dead_letter(self, entry: Entry, num_deliveries: int, killed_its_worker: bool = False) -> DeadLetter:
        reason = f"{ErrorCode.MAX_DELIVERIES.value}: delivered {num_deliveries} times"
        if killed_its_worker:
            reason = f"{ErrorCode.MAX_DELIVERIES.value}: its worker died while running it alone " \
                     f"(delivered {num_deliveries} times)"
        request_id = peek_request_id(entry.fields)
        result = None
        if request_id is not None:
            result = GenerationResult.failure(request_id, ErrorCode.MAX_DELIVERIES, reason, worker=self._config.name)
        log.warning("dead-lettered", extra={"event": "dead_lettered", "request_id": request_id, "reason": reason})
        return DeadLetter(entry, reason, result)

    def _dispatch(self, entries: list[Entry], is_marked: bool = False) -> None:
        """Triage ``entries`` and pass them on (to the engine, or answered at once).

        Args:
            is_marked: a suspect whose delivery marked it as run alone already; otherwise an entry that leaves
                this worker holding it alone is marked here, and a mark is cleared before a second entry joins it.
        """
        entries = self._moved_misplaced(entries)
        self._load.hold((e.stream, e.entry_id) for e in entries)
        now_s = time.time()
        decided = [self._triage(e, now_s) for e in entries]
        admits = [d for d in decided if isinstance(d, Admit)]
        try:
            if not is_marked and entries:
                if len(entries) == 1 and self._load.num_held == 1:
                    self._alone.set(entries[0].stream, entries[0].entry_id)
                else:
                    self._alone.clear()
            cancelled = self._cancelled_ids([a.request.id for a in admits])
        except REDIS_ERRORS:
            # NOTE: held entries are skipped by the pending check: let go of them, so the check after
            # the reconnect takes them back (they are still pending under this name).
            self._load.release([(e.stream, e.entry_id) for e in entries])
            self._needs_pending_check = True
            raise
        running = []
        for item in decided:
            if isinstance(item, Admit) and item.request.id in cancelled:
                self._outbox.put(answer(item.request, item.entry, AbortReason.CANCELLED, "cancelled before it ran",
                                        self._config.name, status=AbortReason.CANCELLED))
            elif isinstance(item, Admit):
                running.append(item)
            else:
                self._log_refusal(item)
                self._outbox.put(item)
        if running:  # NOTE: one hand-off for the read: each put may wake the engine thread
            self._load.add_queued(len(running))
            self._inbox.put(AdmitBatch(running))

    def _moved_misplaced(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` without those on a shard their id does not live on (written to a lane by hand, or by a
        producer with another ``shards``): each is added to its own shard's lane and then acked and deleted here,
        so its answer lands where its id is looked for. A crash in between leaves a copy: the finish's SET NX
        answers the id once."""
        if not self._layout.is_sharded:
            return entries
        kept = []
        for entry in entries:
            request_id = peek_request_id(entry.fields)
            lane = self._lane_of.get(entry.stream)
            if request_id is None or lane is None or self._layout.shard_of(request_id) == lane.shard:
                kept.append(entry)
                continue
            target = self._layout.for_id(request_id).lane(lane.priority, lane.model, lane.is_decode)
            self._client.xadd(target, entry.fields)  # type: ignore[arg-type]
            pipe = self._client.pipeline(transaction=False)
            pipe.xack(entry.stream, CONSUMER_GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
            pipe.execute()
            log.info("moved to its shard", extra={"event": "misplaced", "request_id": request_id, "stream": target})
        return kept

    def _triage(self, entry: Entry, now_s: float) -> Admit | Finish | DeadLetter:
        """:func:`triage`, turning any failure into a dead letter that says why (never a lost entry)."""
        try:
            shard = self._layout.shard_of_stream(entry.stream)
            return triage(entry, now_s, self._intake[shard or 0])
        except Exception as exc:  # one entry's problem must not stop the reader
            log.exception("triage failed", extra={"event": "triage_failed", "entry_id": entry.entry_id})
            return DeadLetter(entry, reason=f"{ErrorCode.INTERNAL.value}: triage failed: {type(exc).__name__}: {exc}")

    def _cancelled_ids(self, request_ids: list[str]) -> set[str]:
        """The ids of ``request_ids`` with a cancel mark (in the cancel set of each one's shard)."""
        if not request_ids:
            return set()
        if not self._layout.is_sharded:
            scores = self._client.zmscore(self._keys.cancel, request_ids)
            return {rid for rid, score in zip(request_ids, scores) if score is not None}
        shard_to_ids: dict[int, list[str]] = {}
        for request_id in request_ids:
            shard_to_ids.setdefault(self._layout.shard_of(request_id), []).append(request_id)
        pipe = self._client.pipeline(transaction=False)
        for shard, ids in shard_to_ids.items():
            pipe.zmscore(self._layout.shards[shard].cancel, ids)
        return {rid for ids, scores in zip(shard_to_ids.values(), pipe.execute())
                for rid, score in zip(ids, scores) if score is not None}

    @staticmethod
    def _log_refusal(item: Finish | DeadLetter) -> None:
        if isinstance(item, DeadLetter):
            log.warning("dead-lettered", extra={"event": "dead_lettered", "entry_id": item.entry.entry_id,
                                                "reason": item.reason})
        else:
            error = item.result.error
            log.info("refused", extra={"event": "error", "request_id": item.result.id,
                                       "code": error.code if error else item.result.status})
