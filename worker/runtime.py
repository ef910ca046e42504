"""The worker process: wires Redis, the reader and writer threads and the engine loop; owns
startup, signals, draining and burst mode. Loads torch only for real models (Engine.from_config).
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import redis

from tokenmill.engine.engine import Engine
from tokenmill.engine.errors import EngineError
from tokenmill.engine.kv.fetch_rules import FetchRules
from tokenmill.protocol.connection import connect
from tokenmill.worker.config import Settings
from tokenmill.worker.errors import StartupError
from tokenmill.worker.gc_tuning import tune_gc
from tokenmill.worker.health import RedisHealth
from tokenmill.worker.heartbeat import STOPPED
from tokenmill.worker.lane_reads import lanes_for_role
from tokenmill.worker.logs import setup_logging
from tokenmill.worker.loop import EngineLoop
from tokenmill.worker.messages import Incoming, Outbound
from tokenmill.worker.metrics import WorkerMetrics
from tokenmill.worker.reader import Reader
from tokenmill.worker.redis_block_store import redis_block_store
from tokenmill.worker.state import Load
from tokenmill.worker.store_io import StoreFleetIO
from tokenmill.worker.writer import Writer

log = logging.getLogger("tokenmill.worker")

IDLE_WAIT_S = 0.05  # engine thread: wait for commands this long when it has nothing to run
WARM_JOIN_S = 5.0  # the most shut-down waits for the grammar warm-up, once the engine's close stopped its start


def build_engine(settings: Settings, client: redis.Redis | None = None) -> Engine:
    """The engine of ``settings.engine``: a model (imports torch; slow) or the echo model (no torch). With
    ``[engine.fleet_cache] enabled`` its block store is ``client``'s Redis (worker/redis_block_store.py), reached on
    threads of the worker's (worker/store_io.py).

    Raises:
        StartupError: the model cannot be found or loaded, or the engine cannot be sized.
    """
    fleet = settings.engine.fleet_cache

    def fleet_io_for(namespace: bytes, rules: FetchRules) -> StoreFleetIO:
        if client is None:
            raise StartupError("[engine.fleet_cache] enabled needs the worker's Redis")
        return StoreFleetIO(redis_block_store(client, settings.queue.keys.prefix, namespace, fleet.max_store_bytes,
                                              fleet.ttl_s, hash_tag=settings.redis.is_cluster), rules)

    config = settings.engine
    if settings.worker.role == "prefill" and fleet.publish != "all":
        # NOTE: a prefill worker's blocks are for its decode pool, reused or not
        config = config.model_copy(update={"fleet_cache": fleet.model_copy(update={"publish": "all"})})
    try:
        return Engine.from_config(config, fleet_io_for=fleet_io_for if fleet.enabled else None)
    except EngineError as exc:
        raise StartupError(str(exc)) from exc


def run_worker(settings: Settings, *, burst: bool = False) -> int:
    """Set up logging, serve (see :class:`Worker`) and return the exit code; ``RedisUnavailable``
    when Redis cannot be reached, ``StartupError`` when the engine cannot be built."""
    setup_logging(settings.worker.log_level, settings.worker.log_json)
    # NOTE: a SIGTERM while the model loads (minutes for a large one) is a stop like any other: kept here until
    # the worker installs its own handlers, then the worker stops as it would after starting (exit 0, not -15).
    stop_signals: list[int] = []
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: stop_signals.append(signum)) if is_main else None
    try:
        worker = Worker(settings, burst=burst)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    tune_gc(settings.worker.gc_young_threshold)  # NOTE: this process is the worker's own (not an embedding one)
    if stop_signals:
        log.info("signal", extra={"event": "signal", "signal": "SIGTERM", "forced": False, "while": "starting"})
        worker.stop()  # NOTE: run() then drains at once: it reads nothing new and shuts down as after any stop
    return worker.run()


class Worker:
    """One worker: reads a queue's lanes into one engine and writes the results back.

    Threads: the caller's thread runs the engine loop; a reader thread feeds it; a writer
    thread persists its outputs. They meet only in two queues and a :class:`Load`.

    Args:
        settings: merged settings.
        engine: an engine to drive; None builds one from ``settings.engine``.
        client: a Redis client; None connects with ``settings.redis`` (retries + PING).
        handle_signals: install SIGTERM/SIGINT handlers (needs the main thread); False when embedded.
        burst: exit once every lane is empty and nothing is in flight.
    """

    def __init__(self, settings: Settings, engine: Engine | None = None, client: redis.Redis | None = None,
                 *, handle_signals: bool = True, burst: bool = False) -> None:
        self.settings = settings
        self.name = settings.worker.name
        self._client = client if client is not None else connect(settings.redis)
        self._handle_signals, self._burst = handle_signals, burst
        inbox: queue.Queue[Incoming] = queue.Queue()
        outbox: queue.Queue[Outbound] = queue.Queue()
        self._load = load = Load()
        # NOTE: the queue's shards (protocol/shards.py): hash-tagged names on a cluster or with several shards
        layout, config = settings.queue.layout(settings.redis.is_cluster), settings.worker
        model = engine.model_name if engine is not None else settings.engine.model.name  # as the engine names it
        health = RedisHealth(config.redis_give_up_s)
        served = settings.served_model_name
        # NOTE: the names a request may give this worker's model by; it reads their lanes (docs/design.md).
        model_names = frozenset({served, model, settings.engine.model.name})
        lanes = lanes_for_role(layout, model_names, config.role, settings.engine.fleet_cache.enabled)
        self._health = health
        self._stopping = threading.Event()
        self._forced = threading.Event()
        self._failed = threading.Event()  # a thread died: exit non-zero at once
        self._threads: list[threading.Thread] = []  # the reader and the writer, once running
        self._warm: threading.Thread | None = None  # the grammar compiler's warm-up, once started
        self._is_built = False  # the model is loaded and the threads' objects exist (the port answers before)
        # NOTE: one registry per worker, so several workers can live in one process (tests).
        self.metrics = None
        if config.metrics_port is not None:
            self.metrics = WorkerMetrics(self.name, model, layout, lanes,
                                         is_redis_healthy=lambda: health.is_healthy)
            self._serve_metrics(self.metrics, config.metrics_port, config.metrics_host)
        try:
            self._engine = engine if engine is not None else build_engine(settings, self._client)
        except BaseException:
            if self.metrics is not None:
                self.metrics.close()
            raise
        if self.metrics is not None:
            self.metrics.name_model(self._engine.model_name)
        self._loop = EngineLoop(self._engine, inbox, outbox, load, self.name, self.metrics, config.role)
        self._reader = Reader(self._client, layout, config, load, inbox, outbox, model_names, health, lanes,
                              readers_per_shard=settings.queue.readers_per_shard)
        self._writer = Writer(self._client, settings.queue, config, load, outbox, model, served, model_names, health,
                              self.metrics, layout=layout)
        self._is_built = True

    def _serve_metrics(self, metrics: WorkerMetrics, port: int, host: str) -> None:
        """Bind the HTTP port (``/metrics``, ``/health``, ``/ready``) now, before the model loads: a port in use
        fails the start at once, and a liveness probe is answered while the model loads.

        Raises:
            StartupError: the address cannot be bound (one line, what and why).
        """
        try:
            metrics.serve(port, host, alive=self._not_alive, ready=self._not_ready)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} "
                               "(another process has the port? choose another with --metrics-port)") from None

    def _not_alive(self) -> str | None:
        """Why ``/health`` fails: a thread of the worker died (None while the process and its threads run)."""
        if self._failed.is_set():
            return "a thread of the worker died; it is stopping"
        ended = [thread.name for thread in self._threads if not thread.is_alive()]
        return f"thread {', '.join(ended)} ended" if ended and not self._stopping.is_set() else None

    def _not_ready(self) -> str | None:
        """Why ``/ready`` fails (None once the model is loaded and the reader reads the lanes)."""
        if not self._is_built:
            return "loading the model"
        if self._stopping.is_set():
            return "stopping: reading no more requests"
        if not self._reader.reading.is_set():
            return "not reading the lanes yet"
        if not self._health.is_healthy:
            return "Redis does not answer (see the log)"
        return self._not_alive()

    def stop(self, force: bool = False) -> None:
        """Begin a graceful drain; ``force`` (or a second call) stops at once, losing nothing."""
        if force or self._stopping.is_set():
            self._forced.set()
        self._stopping.set()

    def run(self) -> int:
        """Serve until stopped (or drained in burst mode).

        Returns:
            The process exit code: 0 after a graceful or forced stop; 1 when one of the worker's
            threads died (its work stays pending for other workers, and the heartbeat stops,
            so a supervisor restarts the process rather than keep a worker that does nothing),
            Redis failed for ``redis_give_up_s``, or results could not be written before the end
            (their entries stay pending, for a reclaimer to run again).
        """
        if self._handle_signals:
            self._install_signal_handlers()
        threads = [self._supervised("tm-reader", lambda: self._reader.run(self._burst)),
                   self._supervised("tm-writer", self._writer.run)]
        for thread in threads:
            thread.start()
        self._threads = threads
        if self.settings.engine.structured_output.warm_at_start:
            # NOTE: not supervised: plain requests never wait for it, and a failure is only logged. Joined (bounded)
            # at shut-down: a process that exits while it is inside xgrammar's C++ aborts (std::terminate).
            self._warm = threading.Thread(target=self._engine.warm_grammars, name="tm-grammar-warm", daemon=True)
            self._warm.start()
        log.info("started", extra={"event": "started", "worker": self.name, "model": self._engine.model_name,
                                   "queue": self.settings.queue.name, "burst": self._burst})
        try:
            self._serve()
        except Exception:  # noqa: BLE001 - the engine thread failed: same as any thread dying
            self._on_thread_death("tm-engine")
        finally:
            self._shut_down(threads)
        return 1 if self._failed.is_set() else 0

    def _supervised(self, name: str, target: Callable[[], None]) -> threading.Thread:
        """A daemon thread whose death (any exception) stops the worker with a failure."""
        def run() -> None:
            try:
                target()
            except BaseException:  # noqa: BLE001 - logged with its traceback, then the worker stops
                self._on_thread_death(name)

        return threading.Thread(target=run, name=name, daemon=True)

    def _on_thread_death(self, name: str) -> None:
        log.critical("thread died; stopping the worker", exc_info=True,
                     extra={"event": "thread_died", "thread_name": name})
        self._failed.set()
        self.stop(force=True)

    def _serve(self) -> None:
        drain_until_s: float | None = None
        while not self._forced.is_set():
            if self._stopping.is_set() and drain_until_s is None:
                drain_until_s = self._begin_drain()
            if drain_until_s is not None and (self._loop.num_live == 0 or time.monotonic() > drain_until_s):
                return
            if self._burst and self._reader.drained.is_set() and self._is_idle():
                return
            self._loop.run_once(IDLE_WAIT_S)

    def _begin_drain(self) -> float:
        log.info("draining", extra={"event": "draining", "live": self._loop.num_live,
                                    "timeout_s": self.settings.worker.drain_timeout_s})
        self._reader.stopping.set()
        self._loop.hand_back_waiting()
        return time.monotonic() + self.settings.worker.drain_timeout_s

    def _is_idle(self) -> bool:
        return self._loop.num_live == 0 and self._load.num_queued == 0

    def _shut_down(self, threads: list[threading.Thread]) -> None:
        for event in (self._reader.stopping, self._reader.closing, self._writer.closing):
            event.set()
        self._loop.close()
        self._engine.close()  # NOTE: stops the grammar compiler's start too, should the warm-up still be in it
        if self._warm is not None:
            self._warm.join(timeout=WARM_JOIN_S)
        # NOTE: the writer may spend drain_timeout_s retrying results Redis refuses
        for thread in threads:
            thread.join(timeout=self.settings.worker.idle_wait_ms / 1000 + self.settings.worker.drain_timeout_s + 5.0)
        num_unwritten = self._writer.num_unwritten
        if num_unwritten:
            log.error("results could not be written; their entries stay pending for reclaim",
                      extra={"event": "results_lost", "count": num_unwritten})
            self._failed.set()
        if self._failed.is_set():
            self._say_stopped()
        if self.metrics is not None:
            self.metrics.close()
        log.info("stopped", extra={"event": "stopped", "worker": self.name, "forced": self._forced.is_set(),
                                   "failed": self._failed.is_set(), "left_pending": self._loop.num_live})

    def _say_stopped(self) -> None:
        """Best effort: mark the heartbeat stopped, so other workers reclaim this one's work at once."""
        try:
            self._writer.beat(STOPPED)
        except Exception:  # noqa: BLE001 - the worker is failing already; staleness will tell
            log.warning("could not write the final heartbeat", extra={"event": "redis_error"})

    def _install_signal_handlers(self) -> None:
        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("signal", extra={"event": "signal", "signal": signal.Signals(signum).name,
                                      "forced": self._stopping.is_set()})
            self.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
