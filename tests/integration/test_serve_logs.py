"""The log of a ``tokenmill serve`` process, read from its stderr: one access line per
request (method, path, status, duration, request id), a throughput line while there is traffic, in
the worker's text or JSON lines."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.processes import scaled_s
from tests.serve_helpers import serve_process
from tests.worker_helpers import make_settings, running_worker

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
TEXT_LINE = re.compile(r"^\d\d:\d\d:\d\d (?P<level>[A-Z]+) +(?P<msg>.+?)(?P<fields>( \w+=\S*)*)$")


def _request(url: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    """Status and ``X-Request-Id`` of a GET (or, with ``body``, a POST of JSON)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status), str(response.headers["X-Request-Id"])
    except urllib.error.HTTPError as exc:
        return exc.code, str(exc.headers["X-Request-Id"])


def _parse(line: str, as_json: bool) -> dict[str, Any]:
    """A log line's message and fields (values as text, in a text line)."""
    if as_json:
        parsed: dict[str, Any] = json.loads(line)
        return parsed
    match = TEXT_LINE.match(line)
    assert match, f"not a log line: {line!r}"
    fields = dict(pair.split("=", 1) for pair in match["fields"].split())
    return {"level": match["level"], "msg": match["msg"], **fields}


def _lines(path: Path, as_json: bool) -> list[dict[str, Any]]:
    return [_parse(line, as_json) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_access_log_has_one_line_per_request_and_a_throughput_line(redis_url: str, key_prefix: str,
                                                                   tmp_path: Path, as_json: bool) -> None:
    log_path = tmp_path / "serve.log"
    with running_worker(make_settings(redis_url, key_prefix)), \
            serve_process(redis_url, key_prefix, stderr=log_path, log_level="info", log_json=as_json,
                          throughput_log_s=0.5) as (port, _):
        base = f"http://127.0.0.1:{port}"
        sent = [("GET", "/v1/models", *_request(f"{base}/v1/models")),
                ("GET", "/nope", *_request(f"{base}/nope")),
                ("POST", "/v1/chat/completions", *_request(f"{base}/v1/chat/completions", CHAT)),
                ("POST", "/v1/completions", *_request(f"{base}/v1/completions", {"model": "echo", "prompt": []}))]
        deadline = time.monotonic() + scaled_s(10)
        while not any(line["msg"] == "throughput" for line in _lines(log_path, as_json)):
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
    assert [status for _, _, status, _ in sent] == [200, 404, 200, 400]
    lines = _lines(log_path, as_json)  # NOTE: every line parses: uvicorn's own are in the same format
    access = [line for line in lines if line["msg"] == "http request" and line["path"] != "/health"]
    assert len(access) == len(sent), access  # the start-up's /health polls aside
    for (method, path, status, request_id), line in zip(sent, access, strict=True):
        assert (line["method"], line["path"], int(line["status"]), line["request_id"]) == (
            method, path, status, request_id), line
        assert float(line["duration_ms"]) >= 0 and line["level"] == "INFO"
    throughput = next(line for line in lines if line["msg"] == "throughput")
    assert float(throughput["requests_per_min"]) > 0 and float(throughput["completion_tokens_per_min"]) > 0
    if as_json:
        assert throughput["event"] == "throughput" and access[0]["event"] == "http_request"
    assert "Traceback" not in log_path.read_text()


def test_no_throughput_line_without_traffic_and_no_access_lines_below_info(redis_url: str, key_prefix: str,
                                                                           tmp_path: Path) -> None:
    """Probes are no traffic: only /health was asked (the start-up's polls), so no throughput line."""
    log_path = tmp_path / "serve.log"
    with serve_process(redis_url, key_prefix, stderr=log_path, log_level="info", throughput_log_s=0.2):
        time.sleep(0.6)
    lines = _lines(log_path, as_json=False)
    assert {line["path"] for line in lines if line["msg"] == "http request"} == {"/health"}
    assert not [line for line in lines if line["msg"] == "throughput"]
    with serve_process(redis_url, key_prefix, stderr=log_path, log_level="warning", throughput_log_s=0.2) as (port, _):
        assert _request(f"http://127.0.0.1:{port}/v1/models")[0] == 200
        time.sleep(0.5)
    assert log_path.read_text() == ""
