"""What operators ask ``tokenmill serve``, without an API key: ``/health`` (200 while Redis
answers, 503 once it is gone), ``/version``, and ``/metrics`` (the process's own HTTP series)."""

from __future__ import annotations

import importlib.metadata
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_helpers import running_server


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, bytes(exc.read())


def test_health_follows_redis_and_version_names_the_package(private_redis_url: str, key_prefix: str) -> None:
    with running_server(private_redis_url, key_prefix, api_keys=["sk-only"]) as url:
        root = url.removesuffix("/v1")
        assert _get(f"{root}/health") == (200, b'{"status":"ok"}')
        status, body = _get(f"{root}/version")
        assert status == 200 and json.loads(body) == {"version": importlib.metadata.version("tokenmill")}
        redis.Redis.from_url(private_redis_url).shutdown(nosave=True)
        status, body = _get(f"{root}/health")
    assert status == 503 and json.loads(body)["error"]["code"] == "redis_unavailable"


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_count_requests_by_route_and_status(redis_url: str, key_prefix: str) -> None:
    with running_server(redis_url, key_prefix, api_keys=["sk-only"]) as url:
        key = {"Authorization": "Bearer sk-only"}
        assert _get(f"{url}/models", key)[0] == 200
        assert _get(f"{url}/models", key)[0] == 200
        assert _get(f"{url}/files/file-none", key)[0] == 404
        assert _get(f"{url}/files/file-none")[0] == 401  # refused by the guard, before any route
        assert _get(f"{url}/nowhere", key)[0] == 404
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(f"{url}/models", method="BREW", headers=key), timeout=10)
        status, text = _get(f"{url.removesuffix('/v1')}/metrics")
    assert status == 200
    samples = _samples(text.decode())

    def requests(route: str, method: str, code: int) -> Any:
        labels = frozenset({"route": route, "method": method, "status": str(code)}.items())
        return samples.get(("tokenmill_serve_requests_total", labels))

    assert requests("/v1/models", "GET", 200) == 2
    assert requests("/v1/files/{file_id}", "GET", 404) == 1
    assert requests("none", "GET", 401) == 1
    assert requests("none", "GET", 404) == 1
    assert requests("/v1/models", "other", 405) == 1, "methods outside HTTP's are one label"
    assert samples[("tokenmill_serve_requests_in_flight", frozenset())] == 1, "the scrape itself"
    latency = frozenset({"route": "/v1/models", "method": "GET"}.items())
    assert samples[("tokenmill_serve_request_duration_seconds_count", latency)] == 2
    assert samples[("process_resident_memory_bytes", frozenset())] > 0
