"""A worker given a grammar or a tool schema that can never end answers it with a validation error within
seconds and lives on, its peak memory bounded: the grammar-forced draft once walked such a grammar's forced
continuation until the kernel's OOM killer took the worker (2.2 GB three seconds after the claim)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import redis
import torch

from tests.tiny_models import save_tiny_model
from tests.worker_helpers import start_worker_process, wait_result
from tokenmill.producer.client import Producer
from tokenmill.producer.openai_compat.bodies import parse_body
from tokenmill.protocol.keys import Keys

PEAK_RSS_LIMIT_BYTES = 3 << 30  # the worker holds torch and a tiny model: well under 1 GiB; the leak grew past 2 GiB


def _peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(600)
def test_endless_grammar_and_tool_schema_are_refused_and_the_worker_lives(
        tmp_path: Path, redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    model_dir = save_tiny_model("llama", tmp_path / "model", dtype=torch.float32)
    worker = start_worker_process(redis_url, key_prefix, "grammar-w", model=str(model_dir))
    producer = Producer(redis_url, prefix=key_prefix)
    try:
        tool_body = parse_body({"messages": [{"role": "user", "content": "count"}], "max_tokens": 8,
                                "tool_choice": "required", "tools": [{"type": "function", "function": {
                                    "name": "f", "parameters": {"type": "object", "properties": {"n": {"$ref": "#"}},
                                                                "required": ["n"]}}}]}, "chat")
        warm = producer.submit(prompt="warm up", max_tokens=2)
        # the worker is up (slow machines: minutes)
        wait_result(redis_client, Keys(key_prefix), warm, timeout_s=300, process=worker)
        started = time.monotonic()
        ids = {
            "grammar": producer.submit(prompt="a", max_tokens=8,
                                       response_format={"type": "grammar", "grammar": 'root ::= "a" root'}),
            "tool": producer.submit(**tool_body.options),
            "plain": producer.submit(prompt="batched with them", max_tokens=4),
        }
        results = {name: wait_result(redis_client, Keys(key_prefix), rid, timeout_s=120, process=worker)
                   for name, rid in ids.items()}
        elapsed_s = time.monotonic() - started
        for name in ("grammar", "tool"):
            error = results[name].error
            assert error is not None and error.code == "validation", results[name]
            assert "can never end" in error.message
        assert results["plain"].status == "ok"
        assert worker.poll() is None, "the worker died"
        peak = _peak_rss_bytes(worker.pid)
        print(f"answered in {elapsed_s:.1f} s; worker peak RSS {peak / 2**20:.0f} MiB")
        assert peak < PEAK_RSS_LIMIT_BYTES
    finally:
        producer.close()
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except Exception:  # noqa: BLE001 - never leave it running
            worker.kill()
            worker.wait()
