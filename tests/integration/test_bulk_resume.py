"""Killing ``tokenmill bulk`` half way (SIGINT or SIGKILL) and re-running it: every item ends up
in the output exactly once, the interrupted run leaves valid JSONL, and the re-run sends no request
the first run had queued (the worker writes no duplicate result)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.bulk_helpers import NUM_ITEMS, item_ids, read_jsonl, write_input
from tests.processes import free_port, scaled_s
from tests.worker_helpers import make_settings, running_worker
from tokenmill.producer import Producer, bulk
from tokenmill.producer.bulk import BulkJob, BulkOptions
from tokenmill.producer.bulk.options import job_id_of, request_id_of
from tokenmill.protocol.schema import decode_result
from tokenmill.worker.runtime import Worker

pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[2]


def _start_bulk(redis_url: str, prefix: str, source: Path, out: Path, *flags: str,
                as_json: bool = True) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tokenmill.cli", "--redis-url", redis_url, "--prefix", prefix, "bulk", str(source),
               str(out), "--max-in-flight", "8", "--no-progress", *(["--json"] if as_json else []), *flags]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "CI": "true", "COLUMNS": "200"}, preexec_fn=_takes_ctrl_c)


def _takes_ctrl_c() -> None:
    """The child takes SIGINT as a terminal's process does: a suite started in the background (``make test &``)
    ignores SIGINT, its children inherit that, and Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_lines(path: Path, num_lines: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + scaled_s(timeout_s)
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= num_lines:
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} never reached {num_lines} lines")


def _interrupt_after(process: subprocess.Popen[bytes], out: Path, num_lines: int, signum: int) -> tuple[bytes, bytes]:
    try:
        _wait_for_lines(out, num_lines)
        process.send_signal(signum)
        return process.communicate(timeout=scaled_s(20))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _num_duplicates(worker: Worker) -> float:
    """Results the worker did not store because the id was already answered (a request sent twice)."""
    assert worker.metrics is not None
    value = worker.metrics.registry.get_sample_value("tokenmill_duplicate_results_total")
    return value or 0.0


def _paced_echo(redis_url: str, prefix: str) -> Any:
    """An echo worker at ~1 token per 10 ms step. Speculation off: echo's drafts are always kept, and a
    step would add up to num_speculative_tokens + 1 tokens, ending the job before the test interrupts it."""
    return make_settings(redis_url, prefix, model="echo:step_delay_s=0.01", metrics_port=free_port(),
                         engine={"speculative": {"method": "off"}})


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGKILL])
def test_killed_bulk_resumes_with_every_item_exactly_once(signum: int, tmp_path: Path, redis_url: str,
                                                          key_prefix: str, producer: Producer) -> None:
    source = write_input(tmp_path / "in.jsonl", "jsonl")
    out = tmp_path / "out.jsonl"
    with running_worker(_paced_echo(redis_url, key_prefix)) as worker:
        process = _start_bulk(redis_url, key_prefix, source, out)
        stdout, stderr = _interrupt_after(process, out, 40, signum)
        if signum == signal.SIGINT:
            assert process.returncode == 130, stderr.decode()
            assert b'"interrupted": true' in stdout
            read_jsonl(out)  # NOTE: a graceful stop leaves only whole lines
        else:
            assert process.returncode == -signal.SIGKILL
        summary = bulk.run(source, out, producer=producer, max_in_flight=8)
        assert _num_duplicates(worker) == 0, "the re-run sent nothing the first run had queued"
    assert summary.is_complete and 40 <= summary.num_skipped < NUM_ITEMS, "killed half way, finished on re-run"
    assert summary.num_adopted + summary.num_recovered > 0, "the first run's queued requests were not re-sent"
    assert summary.num_skipped + summary.num_done == NUM_ITEMS
    ids = item_ids(read_jsonl(out))
    assert sorted(ids) == sorted(f"q{i}" for i in range(NUM_ITEMS)), "every item exactly once"
    assert read_jsonl(summary.errors_path) == []


def test_cancel_on_interrupt_cancels_this_runs_requests_and_the_rerun_redoes_them(
        tmp_path: Path, redis_url: str, key_prefix: str, producer: Producer) -> None:
    source = write_input(tmp_path / "in.jsonl", "jsonl")
    out = tmp_path / "out.jsonl"
    with running_worker(_paced_echo(redis_url, key_prefix)) as worker:
        process = _start_bulk(redis_url, key_prefix, source, out, "--cancel-on-interrupt")
        stdout, stderr = _interrupt_after(process, out, 20, signal.SIGINT)
        assert process.returncode == 130, stderr.decode()
        first = json.loads(stdout)
        assert first["cancelled_on_interrupt"] > 0
        time.sleep(0.5)  # the worker answers the cancelled requests
        assert producer.stats()["depth"] == 0, "nothing of the first run is left to run"
        summary = bulk.run(source, out, producer=producer, max_in_flight=8)
        assert _num_duplicates(worker) == 0
    assert summary.is_complete and summary.num_ok == NUM_ITEMS - summary.num_skipped
    assert sorted(item_ids(read_jsonl(out))) == sorted(f"q{i}" for i in range(NUM_ITEMS))
    assert read_jsonl(summary.errors_path) == []


def _interrupt_unserved_run(redis_url: str, prefix: str, source: Path, out: Path, producer: Producer) -> None:
    """A ``--cancel-on-interrupt`` run Ctrl-C'd while no worker serves the queue: its 8 requests (the window) stay
    queued with their cancel marks, to be answered ``cancelled`` by the next worker (as under load, when the
    re-run starts before the workers reach them)."""
    process = _start_bulk(redis_url, prefix, source, out, "--cancel-on-interrupt")
    try:
        deadline = time.monotonic() + 20.0
        while producer.stats()["depth"] < 8:
            assert time.monotonic() < deadline and process.poll() is None, "the run never queued its window"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=scaled_s(20))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr.decode()
    assert json.loads(stdout)["cancelled_on_interrupt"] == 8
    assert read_jsonl(out) == []


def test_a_rerun_runs_again_the_rows_an_interrupted_run_cancelled_that_land_while_it_waits(
        tmp_path: Path, redis_url: str, key_prefix: str, producer: Producer) -> None:
    """The issue's case: the re-run adopts the cancelled requests (still queued), their ``cancelled`` results land
    while it waits, and it runs those rows again under new ids, using no retry (``retries=0``)."""
    source = write_input(tmp_path / "in.jsonl", "jsonl", num_items=20)
    out = tmp_path / "out.jsonl"
    _interrupt_unserved_run(redis_url, key_prefix, source, out, producer)
    job = BulkJob(producer, source, out, BulkOptions(max_in_flight=8, retries=0))
    rerun = threading.Thread(target=job.run, daemon=True)
    rerun.start()
    deadline = time.monotonic() + 20.0
    while job.summary.num_adopted < 8:  # NOTE: no worker yet: nothing can be recovered, all 8 are waited for
        assert time.monotonic() < deadline and rerun.is_alive(), "the re-run never adopted the cancelled requests"
        time.sleep(0.02)
    with running_worker(make_settings(redis_url, key_prefix, metrics_port=free_port())) as worker:
        rerun.join(30)
        assert not rerun.is_alive()
        assert _num_duplicates(worker) == 0
    summary = job.summary
    [first] = producer.raw_results([request_id_of(job_id_of(out), "q0", 0)])
    assert first is not None and decode_result(first).status == "cancelled", "the adopted request was cancelled"
    assert summary.is_complete and not summary.has_errors and summary.num_ok == 20
    assert summary.num_rerun_cancelled == 8 and summary.num_retried == 0 and summary.num_submitted == 20
    assert sorted(item_ids(read_jsonl(out))) == sorted(f"q{i}" for i in range(20))
    assert read_jsonl(summary.errors_path) == []


def test_no_retry_cancelled_keeps_cancelled_rows_and_a_later_rerun_runs_them(
        tmp_path: Path, redis_url: str, key_prefix: str, producer: Producer) -> None:
    """``--no-retry-cancelled`` writes the cancelled rows to the errors file (exit 3); a re-run without it takes
    them out of the errors file, runs them, exits 0, and its summary says so."""
    source = write_input(tmp_path / "in.jsonl", "jsonl", num_items=20)
    out = tmp_path / "out.jsonl"
    _interrupt_unserved_run(redis_url, key_prefix, source, out, producer)
    with running_worker(make_settings(redis_url, key_prefix)):
        kept = _start_bulk(redis_url, key_prefix, source, out, "--no-retry-cancelled")
        stdout, stderr = kept.communicate(timeout=scaled_s(60))
        assert kept.returncode == 3, stderr.decode()
        first = json.loads(stdout)
        assert (first["ok"], first["statuses"].get("cancelled"), first["kept_cancelled"]) == (12, 8, 8)
        assert first["complete"] and first["rerun_cancelled"] == 0
        cancelled = read_jsonl(tmp_path / "out.jsonl.errors.jsonl")
        assert len(cancelled) == 8 and {line["status"] for line in cancelled} == {"cancelled"}

        rerun = _start_bulk(redis_url, key_prefix, source, out, as_json=False)
        stdout, stderr = rerun.communicate(timeout=scaled_s(60))
    text = stdout.decode()
    assert rerun.returncode == 0, text + stderr.decode()
    assert re.search(r"done earlier \(in the output, skipped\)\W+12\b", text), text
    assert re.search(r"cancelled earlier, run again\W+8\b", text), text
    assert re.search(r"done now\W+8\b", text), text
    assert "(complete)" in text
    assert sorted(item_ids(read_jsonl(out))) == sorted(f"q{i}" for i in range(20)), "every item exactly once"
    assert read_jsonl(tmp_path / "out.jsonl.errors.jsonl") == []
