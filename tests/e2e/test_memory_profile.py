"""The profiling pass that sizes the KV pool on CUDA, run on the CPU through the same code path: the
largest step and the largest decode bucket go through a model runner's ``execute`` on a pool of
their own, every sequence sampling through the sampler's largest path (top-p)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill.engine.config import CacheConfig, SchedulerConfig
from tokenmill.engine.core.step_io import ModelOutput
from tokenmill.engine.errors import EngineError
from tokenmill.engine.kernels.attention import ReferenceBackend
from tokenmill.engine.model.hf_attention import register
from tokenmill.engine.model.kv_cache import KVCacheSpec
from tokenmill.engine.model.memory_profile import largest_step, profile_steps
from tokenmill.engine.model.model_loader import load_model
from tokenmill.engine.model.model_setup import kv_cache_spec, size_kv_cache
from tokenmill.engine.model.static_decode import largest_verification
from tokenmill.engine.sample import sampler

pytestmark = pytest.mark.e2e


def sampled_rows(step: Callable[[], object]) -> int:
    """A Measure for the CPU: the rows the step sampled (the CPU has no allocator peak to read)."""
    output = step()
    assert isinstance(output, ModelOutput)
    assert all(len(tokens) == 1 for tokens in output.sampled_token_ids.values())
    return len(output.sampled_token_ids)


@pytest.mark.parametrize("with_decode_bucket", [False, True])
def test_profile_runs_the_largest_steps_through_execute(tiny_model_dirs: dict[str, Path],
                                                        with_decode_bucket: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row samples the sampler's largest way (top-p: a sort of the whole vocabulary), not greedy's argmax."""
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", attn_implementation=register())
    spec = kv_cache_spec(loaded, block_size=4)
    config = SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8, max_prefill_chunk=32)
    filtered: list[int] = []
    top_k_top_p = sampler._apply_top_k_top_p

    def spy(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        filtered.append(sum(p < 1.0 for p in top_p))
        return top_k_top_p(logits, top_k, top_p)

    monkeypatch.setattr(sampler, "_apply_top_k_top_p", spy)
    profiles = profile_steps(loaded, spec, ReferenceBackend(), config, with_decode_bucket, sampled_rows)
    assert filtered == [8] * len(profiles)  # each profiled step sorted every row's vocabulary
    expected = [("largest step", largest_step(config), False)]
    if with_decode_bucket:
        expected.append(("largest decode bucket", [1] * 8, True))
    assert [(p.name, p.query_lengths, p.captured) for p in profiles] == expected
    assert [p.peak_bytes for p in profiles] == [8] * len(expected)  # every sequence sampled
    assert sum(largest_step(config)) == 96


def test_the_largest_verification_shape_is_profiled_with_a_row_per_token(tiny_model_dirs: dict[str, Path]) -> None:
    """With speculation's verification steps captured, their largest shape is profiled too: every token a draft
    but the first, every row sampled (its logits are what a captured verification keeps beside the decode's)."""
    loaded = load_model(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", attn_implementation=register())
    spec = kv_cache_spec(loaded, block_size=4)
    config = SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=8, max_prefill_chunk=32)
    shape = largest_verification(config.max_num_seqs, num_speculative_tokens=4)
    assert shape == (8, 5)

    def rows_sampled(step: Callable[[], object]) -> int:
        output = step()
        assert isinstance(output, ModelOutput)
        return sum(len(tokens) for tokens in output.sampled_token_ids.values())

    profiles = profile_steps(loaded, spec, ReferenceBackend(), config, True, rows_sampled, verification=shape)
    verification = profiles[-1]
    assert (verification.name, verification.query_lengths, verification.captured) == (
        "largest verification shape", [5] * 8, True)
    assert 8 <= verification.peak_bytes <= 40  # each sequence keeps 1 to 5 of its rows; every row was sampled
    assert largest_verification(8, 0) is None and largest_verification(256, 10) == (256, 2)


def test_a_budget_without_room_for_a_block_is_a_clear_error() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    with pytest.raises(EngineError, match="holds no block"):
        size_kv_cache(CacheConfig(kv_cache_memory=100), spec, torch.device("cpu"))
