"""Decode steps at static shapes (the buffers CUDA graphs replay), run eagerly on the CPU: padded
buckets and the scratch block must not change a single token, nor touch a real block."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.attention import cpu_kernel
from engine.static_decode import StaticDecode, decode_buckets
from tests.e2e.parity_helpers import hf_greedy, load_reference, random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import VOCAB_SIZE

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not cpu_kernel.is_available(), reason="needs the CPU kernel")]


def eager(bucket: int, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return forward


def test_buckets_cover_every_batch_size() -> None:
    assert decode_buckets(1) == [1] and decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_padded_decode_steps_match_hf_generate(tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs["llama"]
    prompts = random_prompts(VOCAB_SIZE, 11, seed=3, max_len=60)
    reference = load_reference(path, torch.float64)
    expected = [hf_greedy(reference, p, 20) for p in prompts]
    engine = build_engine(str(path), device="cpu", dtype="float64", kv_cache_memory="8MiB", block_size=4,
                          max_num_seqs=6, attention_backend="cpu")
    runner = engine.runner
    static = StaticDecode(runner.forward, runner.kv_cache, runner.backend, decode_buckets(6), max_blocks_per_seq=64)
    static.prepare_runners(eager, "eager buckets")
    runner.static_decode = static
    scratch = runner.kv_cache.device_pool[:, :, runner.kv_cache.scratch_block_id].clone()
    used = []
    original_run = static.run

    def counting_run(chunks: list) -> torch.Tensor:  # type: ignore[type-arg]
        used.append(static.bucket_for(len(chunks)))
        return original_run(chunks)

    static.run = counting_run  # type: ignore[method-assign]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=20), progress=False)
    assert [o.token_ids for o in outputs] == expected
    assert {1, 2, 4, 6} & set(used), used  # several buckets, padding included
    assert not torch.equal(scratch, runner.kv_cache.device_pool[:, :, runner.kv_cache.scratch_block_id])
    assert engine.stats().num_used_gpu_blocks == 0
