"""Optional Prometheus endpoint: a collector that reads the worker's Load at scrape time.

Imports prometheus_client lazily (it ships with the engine extra); never redis or the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from worker.state import Load


def serve_metrics(port: int, load: Load, worker: str) -> None:
    """Serve ``/metrics`` on ``port`` in a daemon thread (running, waiting, queued, finished, tokens)."""
    from prometheus_client import REGISTRY, start_http_server  # noqa: PLC0415 - optional dependency
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

    class _LoadCollector:
        def collect(self) -> Iterator[Any]:
            for name, value in (("running", load.num_running), ("waiting", load.num_waiting),
                                ("queued", load.num_queued)):
                gauge = GaugeMetricFamily(f"tokenmill_worker_{name}", f"requests {name}", labels=["worker"])
                gauge.add_metric([worker], value)
                yield gauge
            for name, value in (("finished", load.num_finished), ("tokens", load.num_tokens)):
                counter = CounterMetricFamily(f"tokenmill_worker_{name}", f"{name} since start", labels=["worker"])
                counter.add_metric([worker], value)
                yield counter

    REGISTRY.register(_LoadCollector())
    start_http_server(port)
