"""No value the schema accepts may kill a worker, and no poison may spread, on the real
model: two SmolLM2 workers on one queue are fed every numeric edge of the sampling fields and a
request that makes the engine fail, among good requests. Every edge is answered (ok, or a
validation error for what the vocabulary refuses), every good request is ok, both workers stay
alive and nothing is dead-lettered."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import redis

from tests.worker_helpers import make_settings, running_worker, wait_result
from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.core.step_io import ModelOutput, SchedulerOutput
from tokenmill.engine.output.prompts import TextPrompt
from tokenmill.protocol.sampling import MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MIN_REPETITION_PENALTY
from tokenmill.protocol.schema import GenerationRequest, encode_request
from tokenmill.worker.runtime import Worker

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POISON = "THIS PROMPT BREAKS THE ENGINE"
# (sampling fields, what the answer must be): the domains' edges, and their neighbours.
EDGES: list[tuple[dict[str, Any], str]] = [
    ({"temperature": 1.0, "top_p": 1e-46}, "ok"),
    ({"temperature": 1.0, "top_p": 5e-324}, "ok"),
    ({"temperature": 1e-300, "top_p": 0.9}, "ok"),
    ({"temperature": 1e-38}, "ok"),
    ({"temperature": 5e-324, "top_k": 3}, "ok"),
    ({"temperature": MAX_TEMPERATURE, "top_k": 5, "seed": 1}, "ok"),
    ({"temperature": MAX_TEMPERATURE, "top_p": 1e-9}, "ok"),
    ({"repetition_penalty": MIN_REPETITION_PENALTY}, "ok"),
    ({"repetition_penalty": MAX_REPETITION_PENALTY, "temperature": 0.7}, "ok"),
    ({"presence_penalty": 2.0, "frequency_penalty": -2.0, "temperature": 1.0}, "ok"),
    ({"repetition_penalty": 1e-300}, "validation"),
    ({"repetition_penalty": 1e300}, "validation"),
    ({"top_p": 0.0}, "validation"),
    ({"temperature": -1e-300}, "validation"),
    ({"top_k": -1}, "validation"),
]


def _random_params(rng: random.Random) -> dict[str, Any]:
    """A draw over the whole accepted domain, log-uniform where the edges are orders of magnitude."""
    return {"temperature": rng.choice([0.0, 10 ** rng.uniform(-320, 2)]) if rng.random() < 0.5 else rng.uniform(0, 2),
            "top_p": min(1.0, 10 ** rng.uniform(-320, 0)), "top_k": rng.choice([0, 1, 2, 50, 2**31 - 1]),
            "repetition_penalty": 10 ** rng.uniform(-2, 2), "presence_penalty": rng.uniform(-2, 2),
            "seed": rng.randrange(2**63)}


class PoisonedRunner:
    """The real runner, raising inside every forward that holds the poison prompt's tokens."""

    def __init__(self, engine: Engine) -> None:
        self.runner = engine.runner
        self.marker = engine.tokenize(TextPrompt(POISON))[-3:]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        for chunk in scheduler_output.chunks:
            tokens = chunk.token_ids
            if any(tokens[i:i + 3] == self.marker for i in range(len(tokens) - 2)):
                raise RuntimeError("gather(): index -1 is out of bounds for dimension 1")
        return self.runner.execute(scheduler_output)


@pytest.fixture(scope="module")
def engines() -> list[Engine]:
    built = [Engine.from_config(EngineConfig(model={"name": "smollm2-135m", "device": "cpu"},
                                             cache={"kv_cache_memory": "256MiB"})) for _ in range(2)]
    for engine in built:
        engine.runner = PoisonedRunner(engine)  # type: ignore[assignment]
    return built


@pytest.fixture
def workers(redis_url: str, key_prefix: str, engines: list[Engine]) -> Iterator[list[Worker]]:
    settings = [make_settings(redis_url, key_prefix, model="smollm2-135m") for _ in engines]
    with running_worker(settings[0], engine=engines[0]) as first, \
            running_worker(settings[1], engine=engines[1]) as second:
        yield [first, second]


def _xadd(client: redis.Redis, lane: str, prompt: str, params: dict[str, Any]) -> str:
    """Enqueue as a raw client would: params the producer would refuse still reach the workers."""
    request = GenerationRequest(messages=[{"role": "user", "content": prompt}])
    fields = encode_request(request)
    data = msgpack.unpackb(fields["d"])
    data["params"] = {"max_tokens": 8, **params}
    fields["d"] = msgpack.packb(data, use_bin_type=True)
    client.xadd(lane, fields)  # type: ignore[arg-type]
    return request.id


def test_numeric_edges_and_a_poison_request_among_good_ones(redis_client: redis.Redis, key_prefix: str,
                                                           workers: list[Worker]) -> None:
    keys = workers[0].settings.queue.keys
    rng = random.Random(24)
    good = [_xadd(redis_client, keys.lane(1), f"Name a colour, number {i}.", {}) for i in range(12)]
    edges = [(_xadd(redis_client, keys.lane(1), "Say hello.", params), expected) for params, expected in EDGES]
    drawn = [_xadd(redis_client, keys.lane(1), "Count to three.", _random_params(rng)) for _ in range(12)]
    poison = _xadd(redis_client, keys.lane(1), POISON, {})
    good += [_xadd(redis_client, keys.lane(1), f"Name a river, number {i}.", {}) for i in range(12)]

    for request_id in good:
        result = wait_result(redis_client, keys, request_id, timeout_s=120)
        assert result.status == "ok" and result.text.strip(), result
    for request_id, expected in edges:
        result = wait_result(redis_client, keys, request_id, timeout_s=120)
        if expected == "ok":
            assert result.status == "ok" and len(result.token_ids) >= 1, result
            assert "\x00" not in result.text
        else:
            assert result.status == "error" and result.error is not None and result.error.code == "validation", result
    for request_id in drawn:
        result = wait_result(redis_client, keys, request_id, timeout_s=120)
        assert result.status == "ok" and len(result.token_ids) >= 1, result
    failed = wait_result(redis_client, keys, poison, timeout_s=120)
    assert failed.status == "error" and failed.error is not None and failed.error.code == "internal"
    assert "index -1 is out of bounds" in failed.error.message
    assert redis_client.xlen(keys.dead) == 0
    assert all(not worker._failed.is_set() for worker in workers)  # both engine threads alive
