"""n > 1 through the queue: the result carries every sample, old readers still read n = 1 results."""

from __future__ import annotations

import msgpack
import redis

from tests.worker_helpers import make_settings, running_worker
from tokenmill.producer import Producer
from tokenmill.protocol.schema import GenerationResult, Sample, decode_result, encode_result


def test_submit_n_returns_every_sample(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    with running_worker(make_settings(redis_url, key_prefix)), Producer(redis_url, prefix=key_prefix) as producer:
        result = producer.result(producer.submit(prompt="twice", n=3, max_tokens=8), timeout=10)
    assert result.ok and result.samples is not None
    assert [s.index for s in result.samples] == [0, 1, 2]
    assert all(s.text == result.text == "twice" for s in result.samples)


def test_a_one_sample_result_carries_no_samples_field() -> None:
    """Readers built before ``samples`` existed reject unknown fields: n = 1 results never carry it."""
    plain = msgpack.unpackb(encode_result(GenerationResult(id="a", status="ok", text="x")), raw=False)
    assert "samples" not in plain
    with_samples = GenerationResult(id="b", status="ok", text="x",
                                    samples=[Sample(index=0, text="x", logprobs=[{5: -0.5}]), Sample(index=1)])
    decoded = decode_result(encode_result(with_samples))
    assert decoded.samples is not None and decoded.samples[0].logprobs == [{5: -0.5}]
