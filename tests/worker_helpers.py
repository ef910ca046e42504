"""Builders shared by the worker tests: settings, an in-thread worker, raw enqueue and waits."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import redis

from tests.processes import scaled_s
from tokenmill.protocol.heartbeat import Heartbeat, decode_heartbeat, encode_heartbeat
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.schema import GenerationRequest, GenerationResult, decode_result, encode_request, encode_result
from tokenmill.worker.config import Settings
from tokenmill.worker.logs import setup_logging
from tokenmill.worker.runtime import Worker

ROOT = Path(__file__).resolve().parents[1]
FAST_WORKER = {"idle_wait_ms": 100, "heartbeat_interval_s": 0.1, "stale_after_s": 0.5, "cancel_poll_s": 0.01,
               "drain_timeout_s": 5.0}


def make_settings(redis_url: str, prefix: str, *, model: str = "echo", engine: dict[str, dict[str, Any]] | None = None,
                  **worker: Any) -> Settings:
    """Settings on the test's own prefix, with fast intervals.

    Args:
        model: the model's name; ``echo:step_delay_s=0.01`` paces the echo model.
        engine: more engine settings by section, e.g. ``{"scheduler": {"max_num_seqs": 1}}``.
        **worker: ``[worker]`` settings.
    """
    engine = engine or {}
    return Settings.load(None, {
        "queue": {"prefix": prefix},
        "worker": {**FAST_WORKER, "name": f"w-{uuid.uuid4().hex[:6]}", **worker},
        "redis": {"url": redis_url},
        "engine": {**engine, "model": {**engine.get("model", {}), "name": model}},
    })


@contextmanager
def running_worker(settings: Settings, **kwargs: Any) -> Iterator[Worker]:
    """A worker serving in a background thread, once its first heartbeat is written (serve answers a
    model only once a live worker announces it); stopped gracefully on exit."""
    worker = Worker(settings, handle_signals=False, **kwargs)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    _wait_for_heartbeat(settings, thread)
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=scaled_s(10))
        assert not thread.is_alive(), "worker did not stop"


@contextmanager
def serving_models(redis_url: str, prefix: str, *models: str) -> Iterator[dict[str, str]]:
    """An echo worker per model, served under that name (named ``w-<model>``); yields model -> worker name."""
    with ExitStack() as stack:
        worker_of = {}
        for model in models:
            settings = make_settings(redis_url, prefix, served_model_name=model, name=f"w-{model}")
            worker_of[model] = stack.enter_context(running_worker(settings)).name
        yield worker_of


def _wait_for_heartbeat(settings: Settings, thread: threading.Thread, timeout_s: float = 10.0) -> None:
    """Until the worker's heartbeat is in the workers hash, it stops, or Redis fails (its own tests)."""
    if settings.redis.url is None:
        return
    client = redis.Redis.from_url(settings.redis.url)
    deadline = time.monotonic() + scaled_s(timeout_s)
    try:
        while thread.is_alive() and time.monotonic() < deadline:
            if client.hexists(settings.queue.keys.workers, settings.worker.name):
                return
            time.sleep(0.005)
    except redis.RedisError:
        return
    finally:
        client.close()


def announce(client: redis.Redis, keys: Keys, name: str, *model_names: str) -> None:
    """A live heartbeat of a worker that reads nothing: serve takes ``model_names`` as served and queues
    requests naming them, where they wait."""
    beat = Heartbeat(name=name, ts=time.time(), model=model_names[0], served_model_name=model_names[0],
                     model_names=list(model_names))
    client.hset(keys.workers, name, encode_heartbeat(beat))


@contextmanager
def worker_logs(as_json: bool, level: str = "INFO") -> Iterator[io.StringIO]:
    """The worker's log lines (``setup_logging``, as a worker process sets it up) written to a buffer;
    the loggers are put back as they were afterwards."""
    loggers = [logging.getLogger(name) for name in ("tokenmill", "engine")]
    saved = [(logger.handlers[:], logger.level, logger.propagate) for logger in loggers]
    # NOTE: an earlier test's dictConfig (Celery's, uvicorn's) disables the loggers that existed then; a worker
    # process has none disabled
    disabled = [logger for name, logger in logging.Logger.manager.loggerDict.items()
                if isinstance(logger, logging.Logger) and logger.disabled
                and name.split(".")[0] in ("tokenmill", "engine")]
    for logger in disabled:
        logger.disabled = False
    buffer = io.StringIO()
    stderr, sys.stderr = sys.stderr, buffer
    try:
        setup_logging(level, as_json)
    finally:
        sys.stderr = stderr
    try:
        yield buffer
    finally:
        for logger, (handlers, level_before, propagate) in zip(loggers, saved):
            logger.handlers[:], logger.propagate = handlers, propagate
            logger.setLevel(level_before)
        for logger in disabled:
            logger.disabled = True


def enqueue(client: redis.Redis, keys: Keys, lane: int = 0, **fields: Any) -> str:
    """XADD one request (built from ``fields``) to ``lane``; returns its id."""
    request = GenerationRequest(**{"prompt": "hello", **fields})
    client.xadd(keys.lane(lane), encode_request(request))  # type: ignore[arg-type]
    return request.id


def add_dead_letter(client: redis.Redis, keys: Keys, request_id: str) -> None:
    """What the worker does after max_deliveries: a dead entry (from lane 1) plus a stored failure."""
    request = GenerationRequest(id=request_id, prompt="revived", priority=1)
    client.xadd(keys.dead, {"reason": "max_deliveries: delivered 6 times", "stream": keys.lane(1),
                            "entry_id": "1-0", **encode_request(request)})  # type: ignore[dict-item]
    failure = GenerationResult.failure(request_id, ErrorCode.MAX_DELIVERIES, "delivered 6 times")
    client.set(keys.result(request_id), encode_result(failure))


def wait_result(client: redis.Redis, keys: Keys, request_id: str, timeout_s: float = 5.0,
                process: subprocess.Popen[bytes] | None = None) -> GenerationResult:
    """Poll for the stored result of ``request_id`` (``timeout_s`` scaled by the machine's load).

    Args:
        process: the worker expected to answer (``start_worker_process``'s): its exit fails the wait at once, and a
            failure shows what it logged.
    """
    deadline = time.monotonic() + scaled_s(timeout_s)
    while time.monotonic() < deadline:
        raw = client.get(keys.result(request_id))
        if raw is not None:
            return decode_result(raw)
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the worker exited ({process.returncode}) before answering {request_id}:\n"
                                 f"{_log_tail(process)}")
        time.sleep(0.01)
    logged = f"; the worker logged:\n{_log_tail(process)}" if process is not None else ""
    raise AssertionError(f"no result for {request_id} within {timeout_s} s{logged}")


def _log_tail(process: subprocess.Popen[bytes], num_chars: int = 4000) -> str:
    """The end of what a worker process wrote to stderr so far (``start_worker_process`` keeps it in a file)."""
    if process.stderr is None:
        return "(not kept)"
    process.stderr.seek(0)
    return process.stderr.read().decode(errors="replace")[-num_chars:]


def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> None:
    """Poll ``condition`` every ``poll_s`` until it holds; fail after ``timeout_s`` (scaled by the machine's load)."""
    deadline = time.monotonic() + scaled_s(timeout_s)
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {timeout_s} s"
        time.sleep(poll_s)


def wait_serving(client: redis.Redis, keys: Keys, name: str, process: subprocess.Popen[bytes],
                 timeout_s: float = 30.0) -> None:
    """Wait until the worker process beats under ``name`` (its model loaded, its signal handlers installed): a
    SIGTERM before then ends a process still starting, by the signal's default (exit -15), not a worker's stop."""
    def beats() -> bool:
        raw = client.hget(keys.workers, name)
        beat = decode_heartbeat(name, raw) if raw is not None else None
        return process.poll() is not None or (beat is not None and beat.pid == process.pid)
    wait_until(beats, timeout_s)


def start_worker_process(redis_url: str, prefix: str, name: str, *args: str, model: str = "echo",
                         env: dict[str, str] | None = None, clock_skew_s: float = 0.0) -> subprocess.Popen[bytes]:
    """``python -m tokenmill.cli worker --model echo`` as a real process on the test's prefix, with fast intervals.

    It logs warnings and worse only, to a temporary file (not a pipe: one nobody reads while the test runs blocks
    the worker once full); the process's ``stderr`` reads that file from its start.

    Args:
        *args: extra flags of the worker command.
        model: the model's name (``echo:...`` options pace the echo model).
        env: extra ``TOKENMILL_*`` variables (they win over the defaults here).
        clock_skew_s: seconds the process's ``time.time()`` runs ahead (negative: behind) of the machine's clock.
    """
    defaults = {"TOKENMILL_WORKER__HEARTBEAT_INTERVAL_S": "0.2", "TOKENMILL_WORKER__STALE_AFTER_S": "1.0",
                "TOKENMILL_WORKER__IDLE_WAIT_MS": "200", "TOKENMILL_WORKER__LOG_LEVEL": "WARNING"}
    launcher = ["-m", "tokenmill.cli"]
    if clock_skew_s:
        # NOTE: a worker on a machine whose clock is off, with no hook in the worker: time.time is replaced
        # before anything of tokenmill is imported, then the command line runs as ``-m`` runs it.
        launcher = ["-c", f"import runpy, time; _time = time.time; time.time = lambda: _time() + {clock_skew_s!r}; "
                          "runpy.run_module('tokenmill.cli', run_name='__main__', alter_sys=True)"]
    command = [sys.executable, *launcher, "--redis-url", redis_url, "--prefix", prefix, "worker",
               "--model", model, "--name", name, *args]
    with tempfile.NamedTemporaryFile(prefix=f"tokenmill-{name}-", suffix=".log", delete=False) as log_file:
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **defaults, **(env or {})},
                                   stdout=subprocess.DEVNULL, stderr=log_file)
    process.stderr = open(log_file.name, "rb")  # noqa: SIM115 - closed with the process (Popen.__exit__)
    os.unlink(log_file.name)  # NOTE: the open reader keeps it readable; nothing is left behind
    return process

