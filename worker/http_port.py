"""The worker's HTTP port (``--metrics-port``): ``/metrics`` (Prometheus text), ``/health`` (200 ``ok``
while the process and its threads run: a liveness probe), ``/ready`` (200 ``ok`` once the model is loaded
and the lanes are read, else 503 with a one-line reason: a readiness probe), 404 for any other path.
Served from daemon threads; a check is a call that returns None when all is well, else the reason.

Imports prometheus_client lazily (it ships with the engine extra); standard library otherwise.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

Check = Callable[[], str | None]  # None: fine; else why not, in one line


def fine() -> str | None:
    """The check that always passes."""
    return None


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # NOTE: a scrape in progress never holds up the process's exit


class _SilentHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape or probe on stderr."""


def start(port: int, addr: str, registry: CollectorRegistry, *, alive: Check = fine,
          ready: Check = fine) -> tuple[WSGIServer, threading.Thread]:
    """Bind ``addr:port`` and serve from a daemon thread.

    Raises:
        OSError: the address cannot be bound.
    """
    from prometheus_client import make_wsgi_app  # noqa: PLC0415 - optional extra

    metrics = make_wsgi_app(registry)
    checks = {"/health": alive, "/ready": ready}

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return list(metrics(environ, start_response))
        check = checks.get(path)
        if check is None:
            return _text(start_response, "404 Not Found", f"no {path}: this port serves /metrics, /health and /ready")
        if environ["REQUEST_METHOD"] != "GET":
            return _text(start_response, "405 Method Not Allowed", f"{path} answers GET only", [("Allow", "GET")])
        try:
            reason = check()
        except Exception as exc:  # noqa: BLE001 - a probe answers, whatever broke
            reason = f"the check failed: {type(exc).__name__}: {exc}"
        return _text(start_response, "200 OK" if reason is None else "503 Service Unavailable", reason or "ok")

    class Server(_Server):
        # NOTE: the address's own family: "::" needs AF_INET6
        address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    server = make_server(addr, port, app, Server, handler_class=_SilentHandler)
    thread = threading.Thread(target=server.serve_forever, name="tm-http-port", daemon=True)
    thread.start()
    return server, thread


def _text(start_response: Callable[..., Any], status: str, text: str,
          headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    body = text.encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                            *(headers or [])])
    return [body]
