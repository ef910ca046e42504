"""Builders for the ``tokenmill serve`` tests: the app under uvicorn in a background thread, and an
openai client pointed at it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from producer.config import ServeSettings
from serve.app import create_app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def running_server(redis_url: str, prefix: str, **serve: Any) -> Iterator[str]:
    """``tokenmill serve`` on the test's prefix in a thread; yields its base URL (``.../v1``).

    Args:
        **serve: ``[serve]`` settings (e.g. ``api_keys=["k"]``).
    """
    port = free_port()
    settings = ServeSettings.load(None, {"redis": {"url": redis_url}, "queue": {"prefix": prefix},
                                         "serve": {"port": port, "log_level": "warning", **serve}})
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "serve did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        assert not thread.is_alive(), "serve did not stop"
