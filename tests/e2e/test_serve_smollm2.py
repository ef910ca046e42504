"""``tokenmill serve`` in front of a worker running the real SmolLM2-135M-Instruct: the openai
client gets a sensible chat answer, under the model's served name."""

from __future__ import annotations

import openai
import pytest

from tests.serve_helpers import running_server
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
    answer = reply.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert reply.model == "smollm2-135m" and reply.usage is not None and reply.usage.prompt_tokens > 10
    assert streamed == answer, "streaming and non-streaming give the same greedy text"
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    # NOTE: as in vLLM, the end-of-sequence token that stopped the generation has an entry too
    assert "".join(t.token for t in logprobs.content).startswith(answer), "one entry per token, with its text"
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in logprobs.content)
