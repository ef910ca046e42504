"""The writer thread: persists results (atomic finish), token deltas (each with its byte offset)
and heartbeats; trims old cancel marks and heartbeats; tells the reader which entries are answered.
Imports redis, protocol (config, shards, rates, version) and protocol.connection; never the engine object:
it only drains the outbox.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Collection

import redis

from tokenmill.protocol.config import QueueConfig
from tokenmill.protocol.connection import REDIS_ERRORS
from tokenmill.protocol.rates import RateCounter
from tokenmill.protocol.shards import QueueLayout
from tokenmill.protocol.version import package_version
from tokenmill.worker.backlog import predicted_backlog
from tokenmill.worker.backoff import Backoff
from tokenmill.worker.config import WorkerConfig
from tokenmill.worker.health import RedisHealth
from tokenmill.worker.heartbeat import RUNNING, STOPPED, Heartbeat, forget_old, write_heartbeat
from tokenmill.worker.messages import DeadLetter, Finish, Handoff, Outbound, Outgoing, TokenDelta
from tokenmill.worker.metrics import WorkerMetrics
from tokenmill.worker.results import PositionedDelta, ResultWriter, Writable
from tokenmill.worker.state import Load
from tokenmill.worker.throughput_log import ThroughputLog

log = logging.getLogger("tokenmill.worker")

MAX_BATCH = 256  # outbox items per pipeline
TRIM_INTERVAL_S = 60.0  # how often old cancel marks and heartbeats are trimmed
WAKE_S = 0.25  # the idle writer looks at least this often whether it is closing


class Writer:
    """Drains the outbox into Redis and keeps the worker's heartbeat current.

    Args:
        client: Redis client.
        queue_config: the served queue (keys, result lifetime).
        config: worker settings (TTLs, intervals).
        load: shared counters (heartbeat stats; reads pause while writes fail).
        outbox: what to write.
        model_name: the model loaded, shown in the heartbeat.
        served_model_name: the name it is served under: in the heartbeat and stamped on every result.
        model_names: every name whose lanes the worker reads, announced in the heartbeat (serve routes by it).
        health: records the writer's failing Redis calls (and decides when it gives up).
        metrics: counts written results; samples rate and lane depth each beat. None = no metrics.
        layout: the queue's shards; default: ``queue_config``'s on one instance.
    """

    def __init__(self, client: redis.Redis, queue_config: QueueConfig, config: WorkerConfig, load: Load,
                 outbox: queue.Queue[Outbound], model_name: str, served_model_name: str,
                 model_names: Collection[str], health: RedisHealth, metrics: WorkerMetrics | None = None,
                 layout: QueueLayout | None = None) -> None:
        self._health = health
        self._metrics = metrics
        self._layout = layout if layout is not None else queue_config.layout(is_cluster=False)
        self._client, self._keys, self._config, self._load = client, self._layout.home, config, load
        self._outbox = outbox
        self._cancel_ttl_s = queue_config.result_ttl_s  # NOTE: a cancel mark is kept as long as a result
        self._results = ResultWriter(client, self._layout, queue_config.result_ttl_s, config.token_ttl_s)
        # NOTE: ts is the server's, set by each write (worker/heartbeat.py); 0 until the first
        home = self._layout.home
        self._beat = Heartbeat(name=config.name, ts=0.0, model=model_name,
                               served_model_name=served_model_name, model_names=sorted(model_names),
                               prefix=home.prefix, queue=home.queue, num_lanes=home.num_lanes,
                               shards=self._layout.num_shards, hash_tag=home.hash_tag, cluster=self._layout.is_cluster,
                               role=config.role, version=package_version())
        self._rates = RateCounter(home, config.name)  # the dashboard's per-minute counters (protocol/rates.py)
        self._throughput = ThroughputLog(config.throughput_log_s)  # the info line of results per minute
        self._unwritten: list[Writable] = []  # items of a flush that failed, retried first
        self._stream_bytes: dict[str, int] = {}  # request id -> bytes of token deltas so far in this run
        self._backoff = Backoff()
        self._last_tokens = (time.monotonic(), 0)
        self.closing = threading.Event()  # set by the worker: flush what is queued, then stop

    def beat(self, state: str = RUNNING) -> None:
        """Write the heartbeat now, with current stats."""
        now = time.monotonic()
        then, tokens_then = self._last_tokens
        # NOTE: a rate over a fraction of the interval is noise (a beat right after another, as the one at stop,
        # read ~10x): the rate moves only once half an interval has passed, and a stopped worker generates nothing.
        if now - then >= self._config.heartbeat_interval_s / 2:
            self._last_tokens = (now, self._load.num_tokens)
            self._beat.tokens_per_s = (self._load.num_tokens - tokens_then) / (now - then)
        if state == STOPPED:
            self._beat.tokens_per_s = 0.0
        self._beat.state = state
        self._beat.running, self._beat.waiting = self._load.num_running, self._load.num_waiting
        self._beat.num_finished = self._load.num_finished
        self._beat.prefix_hit_ratio = self._load.prefix_hit_ratio
        self._beat.num_cached_blocks = self._load.num_cached_blocks
        self._beat.kv_usage = self._load.kv_usage
        self._beat.spec_acceptance_rate = self._load.spec_acceptance_rate
        self._beat.spec_mean_accepted_length = self._load.spec_mean_accepted_length
        predicted = predicted_backlog(self._load.length, self._load.num_tokens, self._load.num_finished)
        self._beat.backlog_tokens, self._beat.mean_length = predicted.backlog_tokens, predicted.mean_length
        self._beat.jobs = predicted.jobs
        self._beat.ts = write_heartbeat(self._client, self._keys, self._beat)
        self._rates.sync_clock(self._beat.ts)
        if self._metrics is not None:
            self._metrics.observe_beat(self._client, self._beat.tokens_per_s, self._beat.mean_length)

    @property
    def num_unwritten(self) -> int:
        """Results (and dead letters) taken but not written: after :meth:`run` ended, what was lost."""
        return sum(not isinstance(item, PositionedDelta) for item in self._unwritten)

    def run(self) -> None:
        """Write until :attr:`closing` is set and the outbox is empty; the last beat says ``stopped``.

        Redis errors never end the loop by themselves: a failed write (a result, a heartbeat) is
        retried with backoff while the reader pauses (see :attr:`Load.is_write_blocked`), until the
        failures have lasted ``redis_give_up_s`` (:class:`worker.health.RedisGaveUp`). Once closing,
        it tries for ``drain_timeout_s`` at most, then stops with :attr:`num_unwritten` results left
        (their entries stay pending, for a reclaimer to run again). Anything else is a bug and ends
        the thread, which the worker turns into a non-zero exit.
        """
        next_beat_s = next_trim_s = 0.0
        give_up_at_s: float | None = None
        while not (self.closing.is_set() and self._outbox.empty() and not self._unwritten):
            if self.closing.is_set():
                give_up_at_s = give_up_at_s or time.monotonic() + self._config.drain_timeout_s
                if time.monotonic() >= give_up_at_s:
                    break
            try:
                self._flush(self._take(max(0.0, min(WAKE_S, next_beat_s - time.monotonic()))))
                self._rates.flush(self._client, force=self.closing.is_set())
                self._throughput.report_if_due()
                if time.monotonic() >= next_beat_s:
                    self.beat()
                    next_beat_s = time.monotonic() + self._config.heartbeat_interval_s
                if time.monotonic() >= next_trim_s:
                    self._trim()
                    next_trim_s = time.monotonic() + TRIM_INTERVAL_S
                self._load.set_write_blocked(False)
                self._backoff.reset()
                self._health.succeeded("tm-writer")
            except REDIS_ERRORS as exc:
                self._load.set_write_blocked(True)
                log.warning("redis write failed, retrying", extra={"event": "redis_error", "error": str(exc)})
                self._health.failed("tm-writer", exc)
                self._backoff.wait(self.closing if give_up_at_s is None else None)
        self._unwritten += self._positioned(self._take_all())
        self._throughput.report_if_due(final=True)
        if self._unwritten:
            return  # NOTE: Redis is failing: a last beat would only fail too (staleness tells)
        self.beat(STOPPED)

    def _take(self, timeout_s: float) -> list[Outgoing]:
        """What the outbox holds, MAX_BATCH items or a few more (an engine step's come whole), waiting up to
        ``timeout_s`` for the first."""
        try:
            items = _items(self._outbox.get(timeout=timeout_s))
        except queue.Empty:
            return []
        while len(items) < MAX_BATCH:
            try:
                items += _items(self._outbox.get_nowait())
            except queue.Empty:
                break
        return items

    def _take_all(self) -> list[Outgoing]:
        items: list[Outgoing] = []
        while True:
            try:
                items += _items(self._outbox.get_nowait())
            except queue.Empty:
                return items

    def _positioned(self, items: list[Outgoing]) -> list[Writable]:
        """``items`` with each token delta placed at its byte offset in its request's text (this run's:
        a finish ends the run), so that a retried write keeps its place. A request's deltas of several steps in
        one batch (the writer fell behind the engine) become one, at the first one's place: one stream entry and
        its expiry per request per write, not per step."""
        out: list[Writable] = []
        open_deltas: dict[str, int] = {}  # request id -> where its delta is in `out` (none of its finish since)
        for item in items:
            if isinstance(item, TokenDelta):
                data = item.text.encode(errors="replace")
                offset = self._stream_bytes.get(item.request_id, 0)
                self._stream_bytes[item.request_id] = offset + len(data)
                index = open_deltas.get(item.request_id)
                if index is None:
                    open_deltas[item.request_id] = len(out)
                    out.append(PositionedDelta(item.request_id, data, offset))
                else:
                    earlier = out[index]
                    assert isinstance(earlier, PositionedDelta)  # NOTE: open_deltas holds only deltas' places
                    out[index] = PositionedDelta(item.request_id, earlier.data + data, earlier.offset)
            elif isinstance(item, Handoff):
                out.append(item)
            else:
                if item.result is not None:
                    open_deltas.pop(item.result.id, None)
                    self._stream_bytes.pop(item.result.id, None)
                    if item.result.model is None:
                        item.result.model = self._beat.served_model_name
                out.append(item)
        return out

    def _flush(self, items: list[Outgoing]) -> None:
        """Write ``items`` after anything a failed flush left.

        A failed round trip keeps every item for the retry. Items Redis refused one by one
        (e.g. ``OOM`` under ``maxmemory``) are kept too. Answered entries are released
        (:meth:`Load.release`).

        Raises:
            redis.RedisError: the round trip or an item failed; the caller backs off.
        """
        self._unwritten += self._positioned(items)
        if not self._unwritten:
            return
        outcomes = self._results.flush(self._unwritten)
        self._unwritten = [o.item for o in outcomes if o.error is not None]
        written = [o for o in outcomes if o.error is None]
        self._load.release((o.item.entry.stream, o.item.entry.entry_id) for o in written)
        for outcome in written:
            self._log_written(outcome.item, outcome.is_stored)
        if self._unwritten:
            first = next(o.error for o in outcomes if o.error is not None)
            raise redis.ResponseError(f"{len(self._unwritten)} result(s) not written: {first}")

    def _log_written(self, item: Finish | DeadLetter | Handoff, was_stored: bool) -> None:
        if isinstance(item, Handoff):
            if self._metrics is not None:
                self._metrics.observe_handoff(was_stored)
            log.info("handed off", extra={"event": "handed_off", "request_id": item.request_id,
                                          "stream": self._results.decode_stream(item), "duplicate": not was_stored})
            return
        result = item.result
        if self._metrics is not None:
            self._metrics.observe_result(result, was_stored)
        status = result.status if result is not None else "dead"
        if was_stored:
            tokens = result.usage.completion_tokens if result is not None else 0
            if result is not None:
                self._rates.add(item.entry.stream, tokens)
            self._throughput.add(status, tokens)
        # NOTE: an ok result at debug (the throughput line counts it: at info, this line and the claimed one were a
        # quarter of a busy worker's CPU), what did not go well or was written twice at info
        level = logging.DEBUG if status == "ok" and was_stored else logging.INFO
        if log.isEnabledFor(level):
            log.log(level, "finished", extra={"event": "finished", "request_id": result.id if result else None,
                                              "status": status, "duplicate": not was_stored,
                                              "tokens": len(result.token_ids) if result else 0})

    def _trim(self) -> None:
        """Forget old cancellations (of every shard) and long-silent workers' heartbeats."""
        now_s = time.time()
        for keys in self._layout.shards:
            self._client.zremrangebyscore(keys.cancel, "-inf", now_s - self._cancel_ttl_s)
        forget_old(self._client, self._keys)


def _items(taken: Outbound) -> list[Outgoing]:
    """The items of one outbox entry (an item, or an engine step's list)."""
    return taken if isinstance(taken, list) else [taken]
