"""Producer -> Redis -> worker -> real engine (tiny random model) -> result, end to end:
the queue returns exactly what the engine generates offline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_helpers import build_engine
from tests.worker_helpers import make_settings, running_worker
from tokenmill.producer import Producer
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.runtime import Worker

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "Paged attention stores keys", "héllo wörld 日本語", "Redis streams deliver"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture
def worker(redis_url: str, key_prefix: str, model_dir: Path) -> Iterator[Worker]:
    engine_cfg = {"model": {"device": "cpu", "dtype": "float64", "max_model_len": 256},
                  "cache": {"kv_cache_memory": "4MiB"}}
    with running_worker(make_settings(redis_url, key_prefix, model=str(model_dir), engine=engine_cfg)) as running:
        yield running


def test_queue_results_equal_offline_engine(worker: Worker, producer: Producer, model_dir: Path) -> None:
    offline = build_engine(str(model_dir), device="cpu", dtype="float64", kv_cache_memory="4MiB")
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=12), progress=False)
    ids = [producer.submit(prompt=p, raw=True, max_tokens=12, priority=i % 3) for i, p in enumerate(PROMPTS)]
    results = producer.wait_all(ids, timeout=120)
    for result, want in zip(results, expected):
        assert result.status == "ok", result
        assert result.token_ids == want.token_ids
        assert result.text == want.text
        assert result.usage.completion_tokens == len(want.token_ids)
        assert result.usage.prompt_tokens == want.prompt_token_count
        assert result.timings.total is not None and result.timings.total > 0


def test_chat_messages_and_token_streaming(worker: Worker, producer: Producer) -> None:
    request_id = producer.submit(messages=[{"role": "user", "content": "hello"}], max_tokens=10, stream_tokens=True)
    streamed = "".join(producer.stream(request_id, timeout=120))
    result = producer.result(request_id, timeout=120)
    assert result.status == "ok" and result.usage.completion_tokens > 0
    assert streamed == result.text


def test_prompt_too_long_is_an_error_result_and_worker_keeps_serving(worker: Worker, producer: Producer) -> None:
    too_long = producer.submit(prompt_token_ids=list(range(5, 300)), max_tokens=8)
    fine = producer.submit(prompt="The quick brown fox", max_tokens=4)
    bad = producer.result(too_long, timeout=120)
    assert bad.status == "error" and bad.error is not None and bad.error.code == "prompt_too_long"
    assert producer.result(fine, timeout=120).status == "ok"


def test_structured_output_logprobs_and_penalties_through_the_queue(worker: Worker, producer: Producer) -> None:
    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"]}
    json_schema = {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}
    structured = producer.submit(prompt="The quick brown fox", max_tokens=24, logprobs=2, repetition_penalty=1.2,
                                 response_format=json_schema)
    invalid = producer.submit(prompt="The quick brown fox", response_format={"type": "regex", "regex": "a("})
    result = producer.result(structured, timeout=120)
    assert result.status == "ok" and json.loads(result.text)["mood"] in ("happy", "sad"), result
    assert result.token_logprobs is not None and len(result.token_logprobs) == len(result.token_ids)
    assert all(len(t.top_logprobs) == 2 for t in result.token_logprobs)
    error = producer.result(invalid, timeout=120).error
    assert error is not None and error.code == "validation" and "parenthesis" in error.message
