"""A worker of a command's own: ``tokenmill serve --model M`` and ``tokenmill bulk IN OUT --model M`` run one in
a thread of their process (as ``tokenmill demo`` does), on the embedded Redis when none is configured, so one
command answers, as ``vllm serve M`` / ``vllm run-batch`` do.

Why a thread, not a child process: one process to signal and to stop (Ctrl-C, SIGTERM, a container's stop),
no worker left running when the command is killed, no settings to hand over; the engine's forward releases the
GIL, and the HTTP front's or the bulk job's own work is small beside it. The worker is built (the model loaded)
before the command starts its work, and stopped after it; its failure (a thread died, Redis gone for
``redis_give_up_s``) ends the command with one line on stderr.

Imports the worker only inside functions (``--help`` and the other commands never load it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import redis
import typer

from tokenmill.cli.common import CliState, fail
from tokenmill.cli.engine_flags import EngineFlags, load_worker_settings, merge
from tokenmill.protocol.connection import resolve_url

if TYPE_CHECKING:
    from tokenmill.producer.client import Producer
    from tokenmill.worker.config import Settings
    from tokenmill.worker.runtime import Worker

log = logging.getLogger("tokenmill.cli")

STOP_MARGIN_S = 10.0  # beyond the worker's own drain and write-back budget, before a stop is forced
FAILED = ("the in-process worker stopped: one of its threads died or Redis was gone for [worker] redis_give_up_s "
          "(its log above says which)")


def refuse_engine_flags_without_model(engine_flags: EngineFlags, command: str) -> None:
    """Exit 1 when engine flags were given without ``--model``: they configure the command's own worker."""
    if engine_flags.given:
        raise fail(f"error: {', '.join(engine_flags.given)} configure{'s' if len(engine_flags.given) == 1 else ''} "
                   f"the worker {command} runs with --model; give --model too (without it, {command} uses the "
                   "workers already serving the queue)")


def local_worker_settings(ctx: typer.Context, model: str, engine_flags: EngineFlags,
                          worker: Mapping[str, Any] | None = None) -> Settings:
    """The settings of the command's worker: the global options (``--config``, ``--redis-url``, ``--queue``, ...),
    ``model``, the ``[worker]`` values given, and the engine flags; exit 1 naming every invalid one."""
    state: CliState = ctx.obj
    own = merge({"worker": dict(worker or {}), "engine": {"model": {"name": model}}}, engine_flags.overrides())
    return load_worker_settings(state.config_file, merge(state.overrides, own))


def use_embedded_redis_if_unset(ctx: typer.Context, settings: Settings) -> Settings:
    """With no Redis configured (``--redis-url``, ``REDIS_URL``, ``[redis] url``), start (or reuse) the embedded
    one and say where it runs in one log line; the command's other settings (``ctx``) use it too.

    Raises:
        RedisUnavailable: the embedded Redis did not start, or ``[redis] cluster`` is set without a URL.
    """
    if settings.redis.url is not None:
        return settings
    url = resolve_url(settings.redis)  # NOTE: starts or reuses the embedded Redis (a cluster needs a URL: raises)
    log.info("using the embedded Redis (no --redis-url or REDIS_URL set; it outlives this command: tokenmill redis "
             "stop)", extra={"event": "embedded_redis", "url": url})
    state: CliState = ctx.obj
    ctx.obj = replace(state, overrides=merge(state.overrides, {"redis": {"url": url}}))
    return settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": url})})


def served_names(settings: Settings) -> frozenset[str]:
    """The model names a request may give the worker of ``settings`` (its served name and configured name)."""
    return frozenset({settings.served_model_name, settings.engine.model.name})


class LocalWorker:
    """A :class:`worker.runtime.Worker` in a thread of this process, owned by one command.

    Args:
        settings: the worker's settings (a Redis URL set: :func:`use_embedded_redis_if_unset`).
        on_failure: called (from the worker's thread) when the worker ends without being asked to, or fails;
            it must return at once (set an event, ask a server to stop).

    Raises (building: the model loads here):
        StartupError: the model cannot be found or loaded, or the engine cannot be sized.
        RedisUnavailable: Redis cannot be reached.
    """

    def __init__(self, settings: Settings, on_failure: Callable[[], None]) -> None:
        from tokenmill.worker.gc_tuning import tune_gc  # noqa: PLC0415 - as below
        from tokenmill.worker.runtime import Worker  # noqa: PLC0415 - loads the engine (and torch for a model)

        self.settings = settings
        self.failure: str | None = None  # why the worker ended unasked or failed, once it did
        self._on_failure = on_failure
        self._stop_asked = threading.Event()
        log.info("loading the model", extra={"event": "loading", "model": settings.engine.model.name})
        self._worker: Worker = Worker(settings, handle_signals=False)
        tune_gc(settings.worker.gc_young_threshold)  # NOTE: the command's process is the worker's, as run_worker's
        self._thread = threading.Thread(target=self._run, name="tm-local-worker", daemon=True)

    @property
    def name(self) -> str:
        return self._worker.name

    @property
    def is_stopping(self) -> bool:
        return self._stop_asked.is_set()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            code = self._worker.run()
        except BaseException:  # NOTE: logged with its traceback; the command stops with one line
            log.critical("the in-process worker failed", exc_info=True, extra={"event": "worker_failed"})
            code = 1
        if code != 0 or not self._stop_asked.is_set():
            self.failure = FAILED if code != 0 else "the in-process worker stopped unasked"
            self._on_failure()

    def wait_serving(self, producer: Producer, timeout_s: float) -> bool:
        """Wait until the worker's heartbeat is in Redis (what ``tokenmill serve`` checks a request's model
        against); False when the worker ended first, or ``timeout_s`` passed (it is then only slow)."""
        deadline = time.monotonic() + timeout_s
        stale_after_s = self.settings.worker.stale_after_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                if self.name in producer.stats(stale_after_s=stale_after_s)["workers"]:
                    return True
            except redis.RedisError:  # NOTE: the worker's own health decides; serve answers 503 meanwhile
                pass
            time.sleep(0.05)
        return False

    def stop(self, force: bool = False) -> None:
        """Stop reading and finish the started requests (``drain_timeout_s``); ``force``, or a second call: at
        once (the started requests stay pending, for the next worker on the queue)."""
        self._stop_asked.set()
        self._worker.stop(force=force)

    def close(self, force: bool = False) -> None:
        """Stop (unless already asked), wait for the thread; force the stop if the drain outlasts its budget.
        Sets :attr:`failure` when the worker does not end."""
        if not self._stop_asked.is_set() or force:
            self.stop(force=force)
        if self._thread.ident is None:
            return  # NOTE: never started
        config = self.settings.worker
        try:
            self._thread.join(timeout=2 * config.drain_timeout_s + config.idle_wait_ms / 1000 + STOP_MARGIN_S)
        except KeyboardInterrupt:  # NOTE: Ctrl-C (bulk: or SIGTERM) while it drains: stop at once, as a second signal
            pass
        if self._thread.is_alive():
            self.stop(force=True)
            self._thread.join(timeout=config.idle_wait_ms / 1000 + STOP_MARGIN_S)
        if self._thread.is_alive() and self.failure is None:
            self.failure = "the in-process worker did not stop"
