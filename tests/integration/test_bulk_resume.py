"""Killing ``tokenmill bulk`` half way (SIGINT or SIGKILL) and re-running it: every item ends up
in the output exactly once, and the interrupted run leaves valid JSONL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producer import Producer, bulk
from tests.integration.bulk_helpers import NUM_ITEMS, item_ids, read_jsonl, write_input
from tests.worker_helpers import make_settings, running_worker

ROOT = Path(__file__).resolve().parents[2]


def _start_bulk(redis_url: str, prefix: str, source: Path, out: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "cli", "--redis-url", redis_url, "--prefix", prefix, "bulk", str(source),
               str(out), "--max-in-flight", "8", "--no-progress", "--json"]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "CI": "true"})


def _wait_for_lines(path: Path, num_lines: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= num_lines:
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} never reached {num_lines} lines")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL])
def test_killed_bulk_resumes_with_every_item_exactly_once(signum: int, tmp_path: Path, redis_url: str,
                                                          key_prefix: str, producer: Producer) -> None:
    source = write_input(tmp_path / "in.jsonl", "jsonl")
    out = tmp_path / "out.jsonl"
    settings = make_settings(redis_url, key_prefix, model="echo:tokens_per_step=1,step_delay_s=0.01")
    with running_worker(settings):
        process = _start_bulk(redis_url, key_prefix, source, out)
        try:
            _wait_for_lines(out, 40)
            process.send_signal(signum)
            stdout, stderr = process.communicate(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        if signum == signal.SIGINT:
            assert process.returncode == 130, stderr.decode()
            assert b'"interrupted": true' in stdout
            read_jsonl(out)  # NOTE: a graceful stop leaves only whole lines
        else:
            assert process.returncode == -signal.SIGKILL
        summary = bulk.run(source, out, producer=producer, max_in_flight=8)
    assert summary.is_complete and 40 <= summary.num_skipped < NUM_ITEMS, "killed half way, finished on re-run"
    ids = item_ids(read_jsonl(out))
    assert sorted(ids) == sorted(f"q{i}" for i in range(NUM_ITEMS)), "every item exactly once"
    assert read_jsonl(summary.errors_path) == []
