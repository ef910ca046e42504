"""Builders shared by the worker tests: settings, an in-thread worker, raw enqueue and waits."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

from producer.keys import Keys
from producer.schema import GenerationRequest, GenerationResult, decode_result, encode_request
from worker.config import Settings, load_settings
from worker.runtime import Worker

ROOT = Path(__file__).resolve().parents[1]
FAST_WORKER = {"block_ms": 100, "heartbeat_interval_s": 0.1, "stale_after_s": 0.5, "reclaim_interval_s": 0.1,
               "reclaim_min_idle_ms": 0, "cancel_poll_s": 0.01, "drain_timeout_s": 5.0}


def make_settings(redis_url: str, prefix: str, *, echo: dict[str, Any] | None = None,
                  engine: dict[str, Any] | None = None, **worker: Any) -> Settings:
    """Echo-engine settings on the test's own prefix, with fast intervals."""
    return load_settings(None, {
        "worker": {**FAST_WORKER, "prefix": prefix, "name": f"w-{uuid.uuid4().hex[:6]}", **worker},
        "redis": {"url": redis_url},
        "engine": {"model": "echo", **(engine or {})},
        "echo": echo or {},
    })


@contextmanager
def running_worker(settings: Settings, **kwargs: Any) -> Iterator[Worker]:
    """A worker serving in a background thread; stopped gracefully on exit."""
    worker = Worker(settings, handle_signals=False, **kwargs)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=10)
        assert not thread.is_alive(), "worker did not stop"


def enqueue(client: redis.Redis, keys: Keys, lane: int = 0, **fields: Any) -> str:
    """XADD one request (built from ``fields``) to ``lane``; returns its id."""
    request = GenerationRequest(**{"prompt": "hello", **fields})
    client.xadd(keys.lane(lane), encode_request(request))  # type: ignore[arg-type]
    return request.id


def wait_result(client: redis.Redis, keys: Keys, request_id: str, timeout_s: float = 5.0) -> GenerationResult:
    """Poll for the stored result of ``request_id``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = client.get(keys.result(request_id))
        if raw is not None:
            return decode_result(raw)
        time.sleep(0.01)
    raise AssertionError(f"no result for {request_id} within {timeout_s} s")


def start_worker_process(redis_url: str, prefix: str, name: str, *args: str,
                         env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``tokenmill worker --model echo`` as a real process on the test's prefix, with fast intervals.

    It logs warnings and worse only: stderr is a pipe nobody reads while the test runs, and a
    full pipe would block the worker.

    Args:
        env: extra ``TOKENMILL_*`` variables (they win over the defaults here).
        *args: extra command-line flags.
    """
    defaults = {"TOKENMILL_WORKER__HEARTBEAT_INTERVAL_S": "0.2", "TOKENMILL_WORKER__STALE_AFTER_S": "1.0",
                "TOKENMILL_WORKER__RECLAIM_INTERVAL_S": "0.2", "TOKENMILL_WORKER__BLOCK_MS": "200",
                "TOKENMILL_WORKER__RECLAIM_MIN_IDLE_MS": "0", "TOKENMILL_WORKER__LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "worker", "worker", "--model", "echo", "--redis-url", redis_url,
               "--prefix", prefix, "--name", name, *args]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, **defaults, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
