"""The log of ``tokenmill serve``, in the worker's line format (protocol/logs.py: text or JSON): its
own events and uvicorn's, an access log (one line per HTTP request: method, path, status, duration,
request id) and a throughput line (requests and tokens per minute, every ``[serve] throughput_log_s``
when there was traffic). Both cost a few counters per request; the access log formats nothing below
level info.

Imports starlette (through fastapi), uvicorn and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.config import LOG_LEVELS

from tokenmill.protocol.config import ServeConfig
from tokenmill.protocol.logs import log_to_stderr
from tokenmill.protocol.schema import Usage
from tokenmill.serve.guard import PUBLIC_PATHS
from tokenmill.serve.middleware import HttpMiddleware, StatusNoted

log = logging.getLogger("tokenmill.serve")
access_log = logging.getLogger("tokenmill.serve.access")
MAX_PATH_CHARS = 256  # a longer path is cut: one client must not make lines of 64 KiB


def setup_logging(config: ServeConfig) -> None:
    """Send tokenmill's and uvicorn's logs to stderr at ``log_level``, text or JSON (``log_json``)."""
    log_to_stderr(("tokenmill", "uvicorn"), LOG_LEVELS[config.log_level], config.log_json)


class Traffic:
    """What the server answered since the last throughput line: API requests (probes and scrapes
    left out) and the tokens of the completions answered. Touched from the event loop only."""

    def __init__(self) -> None:
        self._since_s = time.monotonic()
        self.num_requests = self.prompt_tokens = self.completion_tokens = 0

    def add_usage(self, usage: Usage) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens

    def report(self) -> None:
        """Log the rates since the last report, if anything was asked, and start counting anew."""
        now_s = time.monotonic()
        elapsed_s, self._since_s = now_s - self._since_s, now_s
        if self.num_requests and elapsed_s > 0:
            per_min = 60.0 / elapsed_s
            log.info("throughput", extra={
                "event": "throughput", "requests_per_min": round(self.num_requests * per_min, 1),
                "prompt_tokens_per_min": round(self.prompt_tokens * per_min, 1),
                "completion_tokens_per_min": round(self.completion_tokens * per_min, 1),
                "window_s": round(elapsed_s, 1)})
        self.num_requests = self.prompt_tokens = self.completion_tokens = 0

    async def report_every(self, interval_s: float) -> None:
        """Forever: :meth:`report` every ``interval_s``."""
        while True:
            await asyncio.sleep(interval_s)
            self.report()


def traffic_of(request: Request) -> Traffic:
    traffic: Traffic = request.app.state.traffic
    return traffic


class AccessLog(HttpMiddleware):
    """One info line per HTTP request once its response ended (a stream's whole length), guard refusals and
    unknown paths included; counts the API requests for :class:`Traffic`.

    Args:
        app: the app behind it.
        traffic: where requests are counted.
    """

    def __init__(self, app: ASGIApp, traffic: Traffic) -> None:
        super().__init__(app)
        self.traffic = traffic

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        send_logged = StatusNoted(send)
        started = time.perf_counter()
        try:
            await self.app(scope, receive, send_logged)
        finally:
            if scope["path"] not in PUBLIC_PATHS:
                self.traffic.num_requests += 1
            if access_log.isEnabledFor(logging.INFO):
                self._log(scope, send_logged.status, time.perf_counter() - started)

    @staticmethod
    def _log(scope: Scope, status: int, duration_s: float) -> None:
        # NOTE: the raw path as sent (h11 refuses control characters and spaces in it), never the decoded
        # one, where %0A would start a forged line
        path = scope.get("raw_path", b"").decode("latin-1").partition("?")[0] or scope["path"]
        fields = {"event": "http_request", "method": scope["method"], "path": path[:MAX_PATH_CHARS],
                  "status": status, "duration_ms": round(duration_s * 1000, 1)}
        request_id = scope.get("state", {}).get("request_id")
        if request_id is not None:
            fields["request_id"] = request_id
        access_log.info("http request", extra=fields)
