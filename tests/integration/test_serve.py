"""``tokenmill serve`` through the real openai client, with a real echo worker: chat, completions,
streaming, models, errors in OpenAI's shape, API keys, priority and deadlines, and a client
disconnect that cancels its request."""

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
from tests.worker_helpers import announce, make_settings, running_worker
from tokenmill.producer import Producer
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import decode_request

SLOW_ECHO = "echo:step_delay_s=0.02"


@pytest.fixture
def base_url(redis_url: str, key_prefix: str) -> Iterator[str]:
    with running_server(redis_url, key_prefix) as url:
        yield url


@pytest.fixture
def client(base_url: str, redis_url: str, key_prefix: str) -> Iterator[openai.OpenAI]:
    with running_worker(make_settings(redis_url, key_prefix)), openai.OpenAI(base_url=base_url, api_key="none") as c:
        yield c


def test_chat_and_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["echo"]
    raw = client.chat.completions.with_raw_response.create(
        model="echo", messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=64,
        presence_penalty=0, frequency_penalty=0, response_format={"type": "text"}, user="u1", seed=7)
    reply = raw.parse()
    assert reply.object == "chat.completion" and reply.model == "echo"
    assert reply.id == f"chatcmpl-{raw.headers['x-request-id']}"
    [choice] = reply.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "Name three rivers.",
                                                                                  "stop")
    assert reply.usage is not None and reply.usage.completion_tokens == len("Name three rivers.") + 1  # and EOS


def test_completions_come_back_as_text_completions(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="echo", prompt="The capital of France is", max_tokens=40)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.choices[0].text == "The capital of France is"
    by_ids = client.completions.create(model="echo", prompt=[72, 105], max_tokens=8)  # token ids: echo's bytes
    assert by_ids.choices[0].text == "Hi"


def test_streaming_chunks_then_usage_then_done(redis_url: str, key_prefix: str, base_url: str) -> None:
    with running_worker(make_settings(redis_url, key_prefix, model=SLOW_ECHO)), \
            openai.OpenAI(base_url=base_url, api_key="none") as client:
        chunks = list(client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "stream me"}], max_tokens=32, stream=True,
            stream_options={"include_usage": True}))
        completion_chunks = list(client.completions.create(model="echo", prompt="abc", max_tokens=8, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(texts) == "stream me" and len(texts) > 1, "one chunk per token as the worker writes it"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert "".join(c.choices[0].text for c in completion_chunks) == "abc"
    assert all(c.object == "text_completion" for c in completion_chunks)


def test_errors_come_in_openai_shape(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.InternalServerError) as unknown:  # no live worker serves it: 503 at once
        client.with_options(max_retries=0).chat.completions.create(model="gpt-4o",
                                                                   messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.status_code == 503 and unknown.value.code == "model_not_available"
    assert "gpt-4o" in unknown.value.message and "'echo'" in unknown.value.message
    with pytest.raises(openai.BadRequestError) as tools:  # only function tools are supported
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "retrieval"}])  # type: ignore[list-item]
    assert tools.value.param == "tools[0]"
    with pytest.raises(urllib.error.HTTPError) as not_json:
        urllib.request.urlopen(_post(f"{base_url}/chat/completions", b"{not json"), timeout=10)
    assert not_json.value.code == 400
    assert set(json.loads(not_json.value.read())["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="echo", prompt="x" * 5000, max_tokens=4)
    assert too_long.value.code == "context_length_exceeded"


def test_n_choices_logprobs_and_the_served_model_name(redis_url: str, key_prefix: str, base_url: str) -> None:
    """n > 1 comes back as n choices (parallel samples of one request); logprobs carry token strings;
    penalties pass through; the reply names the model that answered, not the name the client used."""
    with running_worker(make_settings(redis_url, key_prefix, served_model_name="house-echo")), \
            openai.OpenAI(base_url=base_url, api_key="none") as client:
        question: list[Any] = [{"role": "user", "content": "Hi you"}]
        chat = client.chat.completions.create(model="echo", messages=question, n=3, max_tokens=16, temperature=0.7,
                                              seed=1, presence_penalty=0.5, frequency_penalty=0.1, logprobs=True,
                                              top_logprobs=1)
        completion = client.completions.create(model="house-echo", prompt="abc", n=2, max_tokens=8, logprobs=1)
        with pytest.raises(openai.BadRequestError) as streamed_n:
            client.chat.completions.create(model="echo", messages=question, n=2, stream=True)
        with pytest.raises(openai.BadRequestError) as too_many:
            client.chat.completions.create(model="echo", messages=question, n=17)
    assert chat.model == "house-echo" and completion.model == "house-echo"
    assert [(c.index, c.message.content) for c in chat.choices] == [(0, "Hi you"), (1, "Hi you"), (2, "Hi you")]
    assert chat.usage is not None and chat.usage.completion_tokens == 3 * (len("Hi you") + 1), "every choice's tokens"
    for choice in chat.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert "".join(t.token for t in choice.logprobs.content) == "Hi you</s>"  # EOS is a token of the output
        assert all(t.logprob == 0.0 and [a.token for a in t.top_logprobs] == [t.token] for t in choice.logprobs.content)
    assert [c.text for c in completion.choices] == ["abc", "abc"]
    logprobs = completion.choices[1].logprobs
    assert logprobs is not None and logprobs.tokens == ["a", "b", "c", "</s>"] and logprobs.text_offset == [0, 1, 2, 3]
    assert logprobs.top_logprobs == [{"a": 0.0}, {"b": 0.0}, {"c": 0.0}, {"</s>": 0.0}]
    assert streamed_n.value.param == "n"
    assert too_many.value.code == "validation" and "params.n" in too_many.value.message


def test_api_keys(redis_url: str, key_prefix: str) -> None:
    with running_server(redis_url, key_prefix, api_keys=["sk-right"]) as url:
        with openai.OpenAI(base_url=url, api_key="sk-wrong") as wrong, pytest.raises(openai.AuthenticationError) as no:
            wrong.models.list()
        assert no.value.code == "invalid_api_key"
        with openai.OpenAI(base_url=url, api_key="sk-right") as right:
            assert right.models.list().data == []  # no worker: no model


def _queued(client: redis.Redis, keys: Keys, lane: int) -> list[tuple[str, float | None]]:
    entries = client.xrange(keys.lane(lane, "echo"))
    return [(r.id, r.deadline) for r in (decode_request(fields) for _, fields in entries)]


def test_a_disconnect_cancels_the_request_and_the_timeout_is_its_deadline(
        base_url: str, redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    """No worker reads yet (one announces echo): the client gives up after 1 s. The SDK's timeout became
    the request's deadline; a longer X-Tokenmill-Timeout keeps the request alive, and then the disconnect
    cancels it."""
    keys = Keys(prefix=key_prefix)
    announce(redis_client, keys, "busy", "echo")
    with openai.OpenAI(base_url=base_url, api_key="none", timeout=1.0, max_retries=0) as client:
        for timeout_header in ({}, {"X-Tokenmill-Timeout": "30"}):
            with pytest.raises(openai.APITimeoutError):
                client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}],
                                               extra_headers={"X-Tokenmill-Priority": "high", **timeout_header})
    sent_s = time.time()
    [(short_id, short_deadline), (long_id, long_deadline)] = _queued(redis_client, keys, lane=0)  # high: lane 0
    assert short_deadline is not None and sent_s - 3 < short_deadline <= sent_s
    assert long_deadline is not None and sent_s + 25 < long_deadline <= sent_s + 30
    for _ in range(200):
        if redis_client.zscore(keys.cancel, long_id) is not None:
            break
        time.sleep(0.01)
    assert redis_client.zscore(keys.cancel, long_id) is not None, "the disconnect cancelled the request"
    with openai.OpenAI(base_url=base_url, api_key="none", timeout=0.5, max_retries=0) as client, \
            pytest.raises(openai.APITimeoutError):  # the body's priority (an extension field) wins over the header
        client.completions.create(model="echo", prompt="hi", extra_headers={"X-Tokenmill-Priority": "high"},
                                  extra_body={"priority": "low"})
    assert len(_queued(redis_client, keys, lane=2)) == 1, "low: lane 2"
    with running_worker(make_settings(redis_url, key_prefix)), Producer(redis_url, prefix=key_prefix) as producer:
        assert producer.result(long_id, timeout=10).status == "cancelled"
        assert producer.result(short_id, timeout=10).status in ("expired", "cancelled")


def _post(url: str, data: bytes) -> urllib.request.Request:
    return urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")


def test_a_stream_closed_early_cancels_the_generation(base_url: str, redis_url: str, key_prefix: str) -> None:
    body: dict[str, Any] = {"model": "echo", "prompt": "z" * 400, "max_tokens": 400, "stream": True}
    with running_worker(make_settings(redis_url, key_prefix, model=SLOW_ECHO)), \
            Producer(redis_url, prefix=key_prefix) as producer:
        request = _post(f"{base_url}/completions", json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=10) as response:
            first = next(line for line in response if line.startswith(b"data: "))
        request_id = json.loads(first.removeprefix(b"data: "))["id"].removeprefix("cmpl-")
        result = producer.result(request_id, timeout=10)
    assert result.status == "cancelled" and 0 < result.usage.completion_tokens < 400
