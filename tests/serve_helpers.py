"""Builders for the ``tokenmill serve`` tests: the app under uvicorn in a background thread (or in
a process of its own, to measure its memory), and a raw HTTP exchange over a socket."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn

from tests.processes import free_port, scaled_s
from tokenmill.producer.config import ServeSettings
from tokenmill.serve.app import server_config

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def running_server(redis_url: str, prefix: str, **serve: Any) -> Iterator[str]:
    """``tokenmill serve`` on the test's prefix in a thread; yields its base URL (``.../v1``).

    Args:
        **serve: ``[serve]`` settings (e.g. ``api_keys=["k"]``).
    """
    port = free_port()
    settings = ServeSettings.load(None, {"redis": {"url": redis_url}, "queue": {"prefix": prefix},
                                         "serve": {"port": port, "log_level": "warning", **serve}})
    server = uvicorn.Server(server_config(settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + scaled_s(20)
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "serve did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        assert not thread.is_alive(), "serve did not stop"


@contextmanager
def serve_process(redis_url: str, prefix: str, *, stderr: Path | None = None,
                  **serve: Any) -> Iterator[tuple[int, int]]:
    """``tokenmill serve`` as a process of its own (``python -m tokenmill.cli serve``); yields its port and pid.

    Args:
        stderr: a file for the process's stderr (its log); None = this process's.
        **serve: ``[serve]`` settings, passed as ``TOKENMILL_SERVE__<KEY>`` env values (``log_level``,
            default warning, as ``--log-level``).
    """
    port = free_port()
    log_level = str(serve.pop("log_level", "warning"))
    env = {**os.environ, **{f"TOKENMILL_SERVE__{key.upper()}": str(value) for key, value in serve.items()}}
    with contextlib.ExitStack() as files:
        err = files.enter_context(stderr.open("w")) if stderr is not None else None
        process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--redis-url", redis_url, "--prefix",
                                    prefix, "serve", "--port", str(port), "--log-level", log_level], cwd=ROOT, env=env,
                                   stderr=err)
    try:
        deadline = time.monotonic() + scaled_s(60)
        while not _answers(f"http://127.0.0.1:{port}/health"):
            assert process.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.05)
        yield port, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:  # stuck on a request it still waits for: the test failed anyway
            process.kill()
            process.wait(timeout=15)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def peak_rss_bytes(pid: int) -> int:
    """The most resident memory process ``pid`` ever had (``VmHWM`` in ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def request_head(method: str, path: str, headers: dict[str, str] | None = None) -> bytes:
    """An HTTP/1.1 request head (``Host`` included)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], Any]:
    """The status, headers and (JSON-decoded when it is JSON) body of the response on ``sock``."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    raw = response.read()
    headers = {key.lower(): value for key, value in response.getheaders()}
    body = json.loads(raw) if headers.get("content-type", "").startswith("application/json") else raw
    return response.status, headers, body


def run_openai_batch(client: Any, lines: list[dict[str, Any]], timeout_s: float,
                     poll_s: float) -> list[dict[str, Any]]:
    """A chat-completions Batch through an ``openai.OpenAI`` client: upload ``lines`` as JSONL,
    create the batch, poll it every ``poll_s`` until it ends (failing past ``timeout_s``), check it
    completed, download its output. Returns the output lines, parsed."""
    upload = client.files.create(file=("in.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + scaled_s(timeout_s)
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(poll_s)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.output_file_id is not None, batch
    return [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
