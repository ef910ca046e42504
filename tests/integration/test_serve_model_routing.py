"""``tokenmill serve`` on a queue serving two models: every chat request is answered by a worker of the
model it names, and a model no live worker serves is a 503 at once (never queued until the timeout)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis

from tests.serve_helpers import running_server
from tests.worker_helpers import announce, serving_models
from tokenmill.producer import Producer
from tokenmill.protocol.heartbeat import STOPPED, Heartbeat, encode_heartbeat
from tokenmill.protocol.keys import Keys
from tokenmill.serve.live_models import CACHE_S

MODELS = ("alpha", "beta")


@pytest.fixture
def base_url(redis_url: str, key_prefix: str) -> Iterator[str]:
    with running_server(redis_url, key_prefix) as url:
        yield url


def _post(url: str, body: dict[str, Any]) -> tuple[int, float, dict[str, Any]]:
    """Status, seconds taken and JSON body of one POST."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, time.monotonic() - started, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, time.monotonic() - started, json.loads(error.read())


def test_chat_requests_alternating_two_models_are_all_answered(base_url: str, redis_url: str, key_prefix: str) -> None:
    with serving_models(redis_url, key_prefix, *MODELS) as worker_of, \
            Producer(redis_url, prefix=key_prefix) as producer, \
            openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        assert sorted(m.id for m in client.models.list().data) == sorted(MODELS)
        answered = []
        for i in range(40):
            model = MODELS[i % 2]
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=16)
            result = producer.get(raw.headers["x-request-id"])
            assert result is not None
            answered.append((model, raw.parse().model, result.model, result.worker))
    assert answered == [(m, m, m, worker_of[m]) for m in (MODELS[i % 2] for i in range(40))]


def test_a_model_no_live_worker_serves_is_a_503_at_once(base_url: str, redis_client: redis.Redis,
                                                        key_prefix: str) -> None:
    keys = Keys(key_prefix)
    chat = {"model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, took_s, answer = _post(f"{base_url}/chat/completions", chat)
    assert (status, answer["error"]["code"]) == (503, "model_not_available") and took_s < 1.0
    assert "none (no live worker)" in answer["error"]["message"]
    time.sleep(CACHE_S)  # serve reads the heartbeats again
    announce(redis_client, keys, "alive", "alpha")
    gone = Heartbeat(name="gone", ts=time.time() - 60, model="beta", model_names=["beta"])  # stale: 60 s silent
    stopped = Heartbeat(name="stopped", ts=time.time(), state=STOPPED, model="beta", model_names=["beta"])
    for beat in (gone, stopped):
        redis_client.hset(keys.workers, beat.name, encode_heartbeat(beat))
    calls = [("chat/completions", chat), ("chat/completions", {**chat, "stream": True}),
             ("completions", {"model": "beta", "prompt": "hi", "stream": True})]
    for path, body in calls:
        status, took_s, answer = _post(f"{base_url}/{path}", body)
        assert status == 503 and took_s < 1.0, (status, took_s, answer)
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["code"], error["param"]) == ("model_not_available", "model")
        assert "'beta'" in error["message"] and "'alpha'" in error["message"], "names the model served"
    assert all(redis_client.xlen(keys.lane(k, "beta")) == 0 for k in range(keys.num_lanes)), "nothing was queued"


def test_the_openai_sdk_with_its_default_retries_fails_at_once(base_url: str) -> None:
    # NOTE: the SDK retries a 503 twice with backoff unless the answer says x-should-retry: false
    with openai.OpenAI(base_url=base_url, api_key="none") as client:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="nobody-serves-this", max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])
        took_s = time.monotonic() - started
    assert refused.value.status_code == 503 and refused.value.response.headers["x-should-retry"] == "false"
    assert took_s < 1.0, f"{took_s:.2f} s: the SDK retried"
