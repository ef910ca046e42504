"""A client that follows docs/design.md alone: only redis-py and msgpack, nothing from tokenmill."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import redis

ROOT = Path(__file__).resolve().parents[2]


def test_raw_client_submits_and_reads_results(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    base = f"{key_prefix}:raw"
    worker = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "--redis-url", redis_url, "--prefix", key_prefix, "--queue", "raw",
         "worker", "--model", "echo"],
        cwd=ROOT, env={**os.environ, "TOKENMILL_WORKER__IDLE_WAIT_MS": "100"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        ids = []
        for lane in range(3):
            request_id = uuid.uuid4().hex
            request = {"id": request_id, "prompt": f"raw {lane}", "params": {"max_tokens": 16},
                       "metadata": {"lane": lane}, "submitted_at": time.time()}
            redis_client.xadd(f"{base}:lane:{lane}", {"d": msgpack.packb(request), "v": 1})
            ids.append(request_id)
        for lane, request_id in enumerate(ids):
            popped = redis_client.blpop([f"{base}:done:{request_id}"], timeout=20)
            assert popped is not None, "no result in time"
            result = msgpack.unpackb(redis_client.get(f"{base}:res:{request_id}"), raw=False)
            assert (result["id"], result["status"], result["text"]) == (request_id, "ok", f"raw {lane}")
            assert result["metadata"] == {"lane": lane} and result["usage"]["completion_tokens"] == 6  # and EOS
    finally:
        worker.terminate()
        assert worker.wait(timeout=10) == 0
