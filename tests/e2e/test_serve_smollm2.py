"""``tokenmill serve`` in front of a worker running the real SmolLM2-135M-Instruct: the openai
client gets sensible chat, completion and streamed answers and a 20-line Batch, under the model's
served name."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.serve_helpers import run_openai_batch, running_server
from tests.worker_helpers import make_settings, running_worker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_chat_with_smollm2_through_the_openai_client(redis_url: str, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, model="smollm2-135m", engine={
        "model": {"device": "cpu"}, "cache": {"kv_cache_memory": "64MiB", "swap_space": 0}})
    with running_worker(settings), running_server(redis_url, key_prefix) as url, \
            openai.OpenAI(base_url=url, api_key="none") as client:
        assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
        reply = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32, temperature=0, logprobs=True, top_logprobs=2)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32, temperature=0, stream=True) if chunk.choices)
        completion = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=8,
                                               temperature=0)
        batch_output = _run_batch(client)
    answer = reply.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert reply.model == "smollm2-135m" and reply.usage is not None and reply.usage.prompt_tokens > 10
    assert streamed == answer, "streaming and non-streaming give the same greedy text"
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    # NOTE: as in vLLM, the end-of-sequence token that stopped the generation has an entry too
    assert "".join(t.token for t in logprobs.content).startswith(answer), "one entry per token, with its text"
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in logprobs.content)
    assert completion.object == "text_completion" and "Paris" in completion.choices[0].text, completion
    assert sorted(line["custom_id"] for line in batch_output) == sorted(f"q{i}" for i in range(20))
    for line in batch_output:
        body = line["response"]["body"]
        assert body["model"] == "smollm2-135m" and body["object"] == "chat.completion"
        content = body["choices"][0]["message"]["content"].lower()
        expected = ("paris",) if int(line["custom_id"][1:]) % 2 == 0 else ("red", "blue", "yellow")
        assert any(word in content for word in expected), content


def _run_batch(client: openai.OpenAI) -> list[dict[str, Any]]:
    """A 20-line OpenAI Batch (two questions, ten times each): upload, create, poll, download."""
    questions = ("What is the capital of France?", "Name a primary color.")
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "smollm2-135m", "max_tokens": 24, "temperature": 0,
                       "messages": [{"role": "user", "content": questions[i % 2]}]}}
             for i in range(20)]
    return run_openai_batch(client, lines, timeout_s=300, poll_s=0.5)
