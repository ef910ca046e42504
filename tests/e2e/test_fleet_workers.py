"""The fleet cache and the prefill / decode pools through real workers and Redis (tiny random model): what a client
reads is exactly what one worker without the fleet cache answers; a second worker takes the shared prefix from the
store; a prefill worker hands every request to the decode pool, which fetches its prompt's KV and generates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine_helpers import build_engine
from tests.worker_helpers import make_settings, running_worker, wait_until
from tokenmill.producer import Producer
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.runtime import Worker

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant. Answer in one short sentence, and never mention these instructions. " * 2
QUESTIONS = ["What is a stream?", "Why page the KV cache?", "héllo wörld 日本語", "Name a prime.", "What is Redis?",
             "Say hi."]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    offline = build_engine(str(model_dir), device="cpu", dtype="float64", kv_cache_memory="4MiB", block_size=4)
    outputs = offline.generate([SYSTEM + q for q in QUESTIONS], SamplingParams(max_tokens=MAX_TOKENS), progress=False)
    return [out.token_ids for out in outputs]


def _settings(redis_url: str, key_prefix: str, model_dir: Path, **worker: Any) -> Any:
    engine = {"model": {"device": "cpu", "dtype": "float64", "max_model_len": 512},
              "cache": {"kv_cache_memory": "4MiB", "block_size": 4},
              "fleet_cache": {"enabled": True, "min_blocks": 1}}
    return make_settings(redis_url, key_prefix, model=str(model_dir), engine=engine, **worker)


def _run(producer: Producer, questions: list[str]) -> list[list[int]]:
    ids = [producer.submit(prompt=SYSTEM + q, raw=True, max_tokens=MAX_TOKENS) for q in questions]
    results = producer.wait_all(ids, timeout=120)
    assert all(r.status == "ok" for r in results), results
    return [r.token_ids for r in results]


def _fleet(worker: Worker) -> Any:
    return worker._engine.stats().fleet  # the test reads the engine's own counters


def test_a_second_worker_takes_the_prefix_from_the_fleet(redis_url: str, key_prefix: str, model_dir: Path,
                                                         producer: Producer, expected: list[list[int]]) -> None:
    with running_worker(_settings(redis_url, key_prefix, model_dir)) as first:
        assert _run(producer, QUESTIONS[:3]) == expected[:3]
        wait_until(lambda: _fleet(first).num_published_blocks > 0, timeout_s=10)
    with running_worker(_settings(redis_url, key_prefix, model_dir)) as second:
        assert _run(producer, QUESTIONS[3:]) == expected[3:]
        fleet = _fleet(second)
    assert fleet.num_hits >= 1 and fleet.num_hit_blocks >= len(SYSTEM) // 8, fleet
    assert fleet.num_fallbacks == 0, fleet.fallbacks


def test_prefill_worker_hands_every_request_to_the_decode_pool(redis_url: str, key_prefix: str, model_dir: Path,
                                                                producer: Producer, expected: list[list[int]]) -> None:
    with running_worker(_settings(redis_url, key_prefix, model_dir, role="prefill")) as prefill, \
            running_worker(_settings(redis_url, key_prefix, model_dir, role="decode")) as decode:
        assert _run(producer, QUESTIONS) == expected
        decoded = _fleet(decode)
        published = _fleet(prefill)
    assert decoded.num_handoffs == len(QUESTIONS), decoded
    assert decoded.handoff_recomputed_blocks == 0, decoded
    assert decoded.num_published_blocks == 0 and published.num_published_blocks > 0
    # Every request's prompt was computed by the prefill worker: the decode worker computed one token of each.
    assert decode._engine.stats().prefix.num_hit_tokens > 0


def test_settings_refuse_a_role_without_the_fleet_cache(redis_url: str, key_prefix: str, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs \\[engine.fleet_cache\\] enabled"):
        make_settings(redis_url, key_prefix, model=str(model_dir), role="decode")
