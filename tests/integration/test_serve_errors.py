"""Every failure ``tokenmill serve`` meets is answered in OpenAI's error shape with an
``X-Request-Id``, never a plain-text 500: bodies Python's JSON parser refuses (200,000 levels
deep, a 5,000-digit integer), priorities that are neither a name nor a lane, stray keys under
serve's Redis namespaces, and a bug (the catch-all)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.serve_helpers import running_server
from tokenmill.protocol.keys import Keys
from tokenmill.serve import live_models, models

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def base_url(redis_url: str, key_prefix: str) -> Iterator[str]:
    with running_server(redis_url, key_prefix) as url:
        yield url


def _call(url: str, *, method: str = "GET", body: bytes | None = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """The status and the OpenAI error body of a call that fails (checked to be that shape)."""
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(request, timeout=30)
    error = failed.value
    assert error.headers["Content-Type"] == "application/json" and error.headers["X-Request-Id"]
    payload = json.loads(error.read())
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}
    return error.code, payload["error"]


@pytest.mark.parametrize("body", [
    b"[" * 200_000 + b"]" * 200_000,
    b'{"a": ' * 200_000 + b"1" + b"}" * 200_000,
    b'{"model": "echo", "max_tokens": 1' + b"0" * 5000 + b"}",
    b"\xff\xfe{",
], ids=["deep-list", "deep-object", "5000-digits", "not-utf8"])
def test_bodies_the_json_parser_refuses_are_400s(base_url: str, body: bytes) -> None:
    status, error = _call(f"{base_url}/chat/completions", method="POST", body=body)
    assert status == 400 and error["message"].startswith("the body is not valid JSON"), error


@pytest.mark.parametrize(("body", "headers", "param"), [
    ({**CHAT, "priority": [1]}, {}, "priority"),
    ({**CHAT, "priority": {"lane": 1}}, {}, "priority"),
    ({**CHAT, "priority": True}, {}, "priority"),
    ({**CHAT, "priority": 1.5}, {}, "priority"),
    ({**CHAT, "priority": "urgent"}, {}, None),
    ({**CHAT, "priority": 99}, {}, None),
    (CHAT, {"X-Tokenmill-Priority": "²"}, None),
    (CHAT, {"X-Tokenmill-Priority": "9" * 5000}, None),
], ids=["list", "object", "bool", "float", "unknown-name", "lane-out-of-range", "superscript-two", "digits"])
def test_priorities_that_name_no_lane_are_400s(base_url: str, body: dict[str, Any], headers: dict[str, str],
                                               param: str | None) -> None:
    status, error = _call(f"{base_url}/chat/completions", method="POST", body=json.dumps(body).encode(),
                          headers=headers)
    assert status == 400 and error["param"] == param and "priority" in error["message"], error


def test_stray_keys_under_serves_namespaces_are_404s(base_url: str, redis_client: redis.Redis,
                                                    key_prefix: str) -> None:
    """A string where a file's or a batch's hash belongs (listed too) reads as no object."""
    keys = Keys(prefix=key_prefix)
    redis_client.set(keys.file("file-stray"), "not a hash")
    redis_client.zadd(keys.files, {"file-stray": 1})
    redis_client.set(keys.batch("batch_stray"), "not a hash")
    redis_client.zadd(keys.batches, {"batch_stray": 1})
    for method, path in (("GET", "/files/file-stray"), ("GET", "/files/file-stray/content"),
                         ("DELETE", "/files/file-stray"), ("GET", "/batches/batch_stray"),
                         ("POST", "/batches/batch_stray/cancel")):
        status, error = _call(f"{base_url}{path}", method=method)
        assert status == 404 and error["code"] in ("file_not_found", "batch_not_found"), (path, error)
    status, error = _call(f"{base_url}/batches", method="POST",
                          body=json.dumps({"input_file_id": "file-stray", "endpoint": "/v1/chat/completions"}).encode())
    assert status == 404 and error["code"] == "file_not_found"
    for path in ("/files", "/batches"):
        with urllib.request.urlopen(f"{base_url}{path}", timeout=10) as response:
            assert json.loads(response.read())["data"] == []
    assert redis_client.zscore(keys.files, "file-stray") is None, "the stray id was dropped from the listing"


def test_a_bug_is_a_500_in_openai_shape(base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(request: object) -> dict[str, Any]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(models, "served_models", broken)
    status, error = _call(f"{base_url}/models")
    assert status == 500 and error["type"] == "server_error" and error["code"] == "internal_error"
    assert "RuntimeError" in error["message"] and "a bug" not in error["message"], "no internals leak"


def test_bad_batch_bodies_are_400s_naming_the_field(base_url: str) -> None:
    for body, param in (({"endpoint": "/v1/chat/completions"}, "input_file_id"),
                        ({"input_file_id": "f", "endpoint": "/v1/chat/completions", "metadata": {"a": [1]}},
                         "metadata.a"),
                        ({"input_file_id": "f", "endpoint": "/v1/embeddings"}, "endpoint")):
        status, error = _call(f"{base_url}/batches", method="POST", body=json.dumps(body).encode())
        assert status == 400 and error["param"] == param, error


def test_every_route_that_needs_redis_answers_503_while_redis_is_away(private_redis_url: str,
                                                                       key_prefix: str) -> None:
    """Redis goes away under a running server: each route that reads or writes Redis answers
    503 ``redis_unavailable`` in OpenAI's shape (``/v1/models`` answered 500 ``internal_error``), and
    the routes that need no Redis still answer."""
    with running_server(private_redis_url, key_prefix) as url:
        root = url.removesuffix("/v1")
        with urllib.request.urlopen(f"{url}/models", timeout=10) as response:
            assert response.status == 200
        redis.Redis.from_url(private_redis_url).shutdown(nosave=True)
        time.sleep(live_models.CACHE_S + 0.1)  # NOTE: the live workers read a moment ago are still served
        calls = [("GET", f"{url}/models", None), ("GET", f"{url}/models/echo", None),
                 ("POST", f"{url}/chat/completions", CHAT), ("POST", f"{url}/completions", {"prompt": "hi"}),
                 ("GET", f"{url}/files", None), ("GET", f"{url}/files/file-x", None),
                 ("GET", f"{url}/batches", None), ("GET", f"{url}/batches/batch_x", None),
                 ("GET", f"{root}/health", None)]
        for method, call_url, body in calls:
            status, error = _call(call_url, method=method, body=None if body is None else json.dumps(body).encode())
            assert status == 503, (method, call_url, status, error)
            assert error["type"] == "server_error" and error["code"] == "redis_unavailable", (call_url, error)
        for path in ("/version", "/metrics"):  # these read no Redis
            with urllib.request.urlopen(f"{root}{path}", timeout=10) as response:
                assert response.status == 200
