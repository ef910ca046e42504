"""The worker's log lines keep tracebacks: a "thread died" line says why, in text and in JSON; the throughput line
tells what was answered per minute."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.worker_helpers import worker_logs
from tokenmill.worker.throughput_log import ThroughputLog

ROOT = Path(__file__).resolve().parents[2]


def _fail() -> None:
    raise RuntimeError("a bug in the writer")


@pytest.mark.parametrize("as_json", [False, True])
def test_a_logged_exception_carries_its_traceback(as_json: bool) -> None:
    with worker_logs(as_json) as buffer:
        try:
            _fail()
        except RuntimeError:
            logging.getLogger("tokenmill.worker").critical("thread died; stopping the worker", exc_info=True,
                                                           extra={"event": "thread_died", "thread_name": "tm-writer"})
    output = buffer.getvalue()
    if as_json:
        line = json.loads(output)
        assert line["msg"] == "thread died; stopping the worker" and line["thread_name"] == "tm-writer"
        trace = line["traceback"]
    else:
        first, _, trace = output.partition("\n")
        assert "CRITICAL thread died; stopping the worker thread_name=tm-writer" in first
    assert trace.startswith("Traceback (most recent call last):")
    assert "in _fail" in trace and "RuntimeError: a bug in the writer" in trace


@pytest.mark.parametrize("as_json", [False, True])
def test_a_line_without_an_exception_is_one_line(as_json: bool) -> None:
    with worker_logs(as_json) as buffer:
        logging.getLogger("tokenmill.worker").info("finished", extra={"event": "finished", "request_id": "r1"})
    output = buffer.getvalue()
    assert output.count("\n") == 1
    assert "traceback" not in output.lower()


_LOAD_A_MODEL = """
import sys
{before}
from tokenmill.worker.logs import setup_logging
setup_logging("INFO", as_json={as_json})
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import save_tiny_model  # torch only for this test

    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.mark.parametrize(("as_json", "imported_first"), [(False, False), (True, False), (True, True)],
                         ids=["text-control", "json-imported-after", "json-imported-before"])
def test_json_logs_switch_off_hugging_face_progress_bars(tiny_model: Path, as_json: bool,
                                                         imported_first: bool) -> None:
    code = _LOAD_A_MODEL.format(before="import transformers" if imported_first else "", as_json=as_json)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    done = subprocess.run([sys.executable, "-c", code, str(tiny_model)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    # NOTE: the text control shows the bar is there to switch off (text logs leave it as it is)
    assert ("Loading weights" in done.stderr) is not as_json, done.stderr[-2000:]


def _lines(buffer: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_the_throughput_line_gives_each_windows_rates_per_status() -> None:
    throughput = ThroughputLog(interval_s=30.0)
    start_s = time.monotonic()
    with worker_logs(as_json=True) as buffer:
        for _ in range(40):
            throughput.add("ok", 16)
        throughput.add("error", 0)
        throughput.add("dead", 0)
        throughput.report_if_due(start_s + 10.0)  # the window not over yet: nothing
        assert buffer.getvalue() == ""
        throughput.report_if_due(start_s + 30.0)
        throughput.report_if_due(start_s + 70.0)  # nothing stored since: no line
        throughput.add("ok", 4)
        throughput.report_if_due(start_s + 71.0, final=True)  # the worker stops: the partial window at once
    first, last = _lines(buffer)
    assert first["event"] == "throughput" and first["level"] == "INFO" and first["results"] == 42
    window_s = first["window_s"]
    assert window_s == pytest.approx(30.0, abs=0.1)
    assert first["ok_per_min"] == round(40 * 60 / window_s, 1) and first["error_per_min"] == round(60 / window_s, 1)
    assert first["dead_per_min"] == round(60 / window_s, 1) and first["results_per_min"] == round(42 * 60 / window_s, 1)
    assert first["completion_tokens_per_min"] == round(640 * 60 / window_s, 1)
    assert last["window_s"] == 1.0 and last["ok_per_min"] == 60.0 and "error_per_min" not in last
    assert last["results"] == 1


def test_a_zero_interval_never_logs_throughput() -> None:
    throughput = ThroughputLog(interval_s=0.0)
    with worker_logs(as_json=True) as buffer:
        throughput.add("ok", 1)
        throughput.report_if_due(time.monotonic() + 3600.0, final=True)
    assert buffer.getvalue() == ""
