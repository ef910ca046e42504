"""The KV sizing with a draft model: on CUDA the pool
is what ``gpu_memory_utilization`` leaves once the weights of both models are in and the draft model's batched
forwards are set aside, and the budget holds both models' caches token for token; a budget in bytes
(``kv_cache_memory``, the CPU's default) is split the same way. Arithmetic only: CUDA's free memory is faked."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.config import CacheConfig
from tokenmill.engine.model.kv_cache import KVCacheSpec
from tokenmill.engine.model.memory_profile import StepProfile, kv_pool_bytes
from tokenmill.engine.model.model_setup import DEFAULT_CPU_KV_BYTES, size_kv_cache
from tokenmill.engine.spec.draft_model import draft_kv_bytes_per_token, draft_working_bytes

GIB = 1 << 30
MIB = 1 << 20
TARGET = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)  # 2 MiB
DRAFT = KVCacheSpec(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16)


def test_the_draft_models_share_of_the_pool() -> None:
    assert TARGET.bytes_per_block == 2 * MIB
    assert draft_kv_bytes_per_token(DRAFT) == 32 * 1024  # a quarter of the target's
    assert draft_working_bytes(DRAFT, num_heads=32, max_batch_tokens=1024) == 1024 * (2 * 8 + 2 * 32) * 64 * 2


def test_on_cuda_the_pool_leaves_the_draft_models_weights_cache_and_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """80 GiB, 0.9 of it: 16 GiB of target weights and a 2 GiB step leave 54 GiB of pool without a draft
    model; its 3 GiB of weights (in use when free memory is read) and 1 GiB for its forwards leave 50 GiB,
    shared token for token with its cache (a quarter of the target's bytes per token): 40 GiB of pool."""
    steps = [StepProfile("largest step", [512], 2 * GIB, captured=False)]
    config = CacheConfig(gpu_memory_utilization=0.9)
    cuda = torch.device("cuda")
    total = 80 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - 16 * GIB, total))
    assert kv_pool_bytes(total - 16 * GIB, total, 0.9, steps) == int(72 * GIB) - 18 * GIB
    blocks, _ = size_kv_cache(config, TARGET, cuda, steps)
    assert blocks * TARGET.bytes_per_block == 54 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - 19 * GIB, total))
    assert kv_pool_bytes(total - 19 * GIB, total, 0.9, steps, reserved_bytes=GIB) == 50 * GIB
    blocks, _ = size_kv_cache(config, TARGET, cuda, steps, draft_token_bytes=draft_kv_bytes_per_token(DRAFT),
                              reserved_bytes=GIB)
    assert blocks * TARGET.bytes_per_block == 40 * GIB
    draft_cache = blocks * TARGET.block_size * draft_kv_bytes_per_token(DRAFT)  # as many tokens as the pool
    assert draft_cache == 10 * GIB and blocks * TARGET.bytes_per_block + draft_cache == 50 * GIB


def test_a_budget_in_bytes_holds_both_caches() -> None:
    """``kv_cache_memory`` (and the CPU's default 1 GiB) is both models' KV: 409 blocks of 2.5 MiB (2 of pool,
    0.5 of draft cache) in 1 GiB, where the pool alone had 512."""
    cpu = torch.device("cpu")
    for config in (CacheConfig(kv_cache_memory=GIB), CacheConfig()):
        blocks, _ = size_kv_cache(config, TARGET, cpu, draft_token_bytes=draft_kv_bytes_per_token(DRAFT),
                                  reserved_bytes=GIB)  # NOTE: a budget in bytes is the caches' alone
        assert blocks == DEFAULT_CPU_KV_BYTES // (2 * MIB + MIB // 2) == 409
        assert size_kv_cache(config, TARGET, cpu)[0] == 512
