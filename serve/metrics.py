"""Prometheus metrics of one ``serve`` process, on its own ``CollectorRegistry`` (served at
``/metrics``): HTTP requests by route, method and status, requests in flight, their latency, and
the process's own memory and CPU. The queue's and the workers' numbers are the workers' metrics.

Imports prometheus_client and starlette (through fastapi); never torch, the engine or the worker.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.serve.middleware import HttpMiddleware, StatusNoted

# Seconds from the request's head to its response's end (a streamed or long generation included).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# The route label of a request answered before or without a route: the guard's 401 / 413 / 408, an unknown path.
UNROUTED = "none"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # any other: "other"


class ServeMetrics:
    """The registry and the series of one server process."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("tokenmill_serve_requests", "HTTP requests answered, by route template, method "
                                "and status", ["route", "method", "status"], registry=registry)
        self.in_flight = Gauge("tokenmill_serve_requests_in_flight", "HTTP requests being answered",
                               registry=registry)
        self.latency_s = Histogram("tokenmill_serve_request_duration_seconds", "request head to the response's "
                                   "end, by route template", ["route", "method"], buckets=LATENCY_BUCKETS_S,
                                   registry=registry)
        ProcessCollector(registry=registry)

    def render(self) -> bytes:
        """Prometheus text of every series."""
        return generate_latest(self.registry)


class MetricsMiddleware(HttpMiddleware):
    """Counts every HTTP request, those the guard refuses before routing included. A request is
    labelled by its route's template (``/v1/files/{file_id}``, from the ``route`` Starlette's
    router puts in the scope), never its raw path: one series per file id would have no bound.

    Args:
        app: the app behind it.
        metrics: where to count.
    """

    def __init__(self, app: ASGIApp, metrics: ServeMetrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"] if scope["method"] in METHODS else "other"  # a client's word: bound the series
        send_counted = StatusNoted(send)
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.metrics.in_flight.dec()
            route = str(getattr(scope.get("route"), "path", UNROUTED))
            self.metrics.latency_s.labels(route, method).observe(time.perf_counter() - started)
            self.metrics.requests.labels(route, method, str(send_counted.status)).inc()
