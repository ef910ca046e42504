"""The worker's log lines keep tracebacks: a "thread died" line says why, in text and in JSON."""

from __future__ import annotations

import json
import logging

import pytest

from tests.worker_helpers import worker_logs


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
