"""Greedy parity: the engine's tokens equal Hugging Face ``generate`` for every tiny architecture,
whatever the block size, chunking, or preemption (recompute and swap). Compared in float64,
because random tiny models have near-flat logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.oracle_drafts import OracleDrafts
from tests.e2e.parity_helpers import BACKENDS, DEVICES, attention_backend, hf_greedy, load_reference, random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import FAMILIES, VOCAB_SIZE
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 16
MAX_TOKENS = 24

SCENARIOS: dict[str, dict[str, Any]] = {
    "block16": dict(block_size=16),
    "block16-no-prefix-cache": dict(block_size=16, enable_prefix_caching=False),
    "block1": dict(block_size=1, max_prefill_chunk=256, max_num_batched_tokens=256),
    "block4-chunked": dict(block_size=4, max_prefill_chunk=7, max_num_batched_tokens=64),
    # NOTE: the preemption scenarios admit whatever fits (no predicted-KV budget), so the pool runs out.
    "recompute-preemption": dict(block_size=4, preemption_mode="recompute", max_prefill_chunk=32,
                                 max_num_batched_tokens=64, budget_kv=False),
    "swap-preemption": dict(block_size=4, preemption_mode="swap", max_prefill_chunk=32, max_num_batched_tokens=64,
                            budget_kv=False),
    # Output-length prediction is on in every scenario; here it also orders the backlog in a tight pool.
    "length-shortest-first": dict(block_size=4, max_prefill_chunk=32, max_num_batched_tokens=64, ordering="shortest",
                                  min_samples=2, budget_kv=True),
}


_REFERENCES: dict[tuple[str, str], tuple[list[list[int]], list[list[int]]]] = {}
NO_PREFIX_HITS = {"block16-no-prefix-cache"}


def _reference(family: str, path: Path, device: str) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and HF greedy continuations, computed once per (family, device)."""
    import torch

    if (family, device) not in _REFERENCES:
        # NOTE: half the prompts share a 40-token prefix, so prefix-cache hits happen.
        prompts = random_prompts(VOCAB_SIZE, NUM_PROMPTS, seed=len(family))
        shared = random_prompts(VOCAB_SIZE, 1, seed=99, min_len=40, max_len=40)[0]
        prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
        model = load_reference(path, torch.float64, device)
        _REFERENCES[family, device] = (prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts])
    return _REFERENCES[family, device]


def _kv_budget(path: Path, scenario: str) -> dict[str, Any]:
    """A KV pool that holds the largest request but far from all of them when preempting."""
    if "preemption" not in scenario and "length" not in scenario:
        return dict(kv_cache_memory="8MiB", swap_space="8MiB")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    bytes_per_token = config.num_hidden_layers * 2 * num_kv_heads * head_dim * 8  # float64
    tokens = 160 + MAX_TOKENS + 16 * 4  # the largest request (a 40-token prefix + 120) plus a little room
    return dict(kv_cache_memory=tokens * bytes_per_token, swap_space="8MiB")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(family: str, scenario: str, device: str, backend: str,
                                    tiny_model_dirs: dict[str, Path]) -> None:
    prompts, expected = _reference(family, tiny_model_dirs[family], device)
    engine = build_engine(str(tiny_model_dirs[family]), device=device, dtype="float64",
                          attention_backend=attention_backend(backend, device),
                          **SCENARIOS[scenario], **_kv_budget(tiny_model_dirs[family], scenario))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        assert out.finish_reason in ("stop", "length"), out
        assert out.token_ids == ref, f"{family}/{scenario}: prompt {i} diverged"
    stats = engine.stats()
    if "preemption" in scenario:
        assert stats.counters.num_preemptions > 0, stats
    if scenario == "swap-preemption":
        assert stats.counters.num_swapped_out_blocks > 0 and stats.counters.num_swapped_in_blocks > 0, stats
    if scenario == "recompute-preemption":
        assert stats.counters.num_recomputed_tokens > 0, stats
    if scenario not in NO_PREFIX_HITS:
        assert stats.prefix.num_hit_tokens > 0, stats.prefix
    if scenario == "block16-no-prefix-cache":
        assert stats.prefix.num_hit_tokens == 0 and stats.num_cached_blocks == 0, stats
    assert stats.length.num_observed == NUM_PROMPTS
    if scenario == "length-shortest-first":
        assert stats.length.num_deferred_admissions > 0, stats.length
    assert not engine.has_unfinished()
    assert stats.num_used_gpu_blocks == 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_parity_with_decode_attention_in_chunks(
    family: str, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference backend's CPU decode path attends a few rows at a time; force one row per group."""
    prompts, expected = _reference(family, tiny_model_dirs[family], "cpu")
    engine = build_engine(str(tiny_model_dirs[family]), device="cpu", dtype="float64", kv_cache_memory="8MiB",
                          attention_backend="reference")
    monkeypatch.setattr(engine.runner.backend, "cpu_chunk_bytes", 1)  # type: ignore[attr-defined]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
    assert [out.token_ids for out in outputs] == expected


@pytest.mark.parametrize("scenario", ["block16", "block4-chunked", "recompute-preemption", "swap-preemption"])
def test_the_overlapped_loop_matches_hf_generate(scenario: str, tiny_model_dirs: dict[str, Path]) -> None:
    """``[engine.execution] overlap = "on"`` (the forward on a device thread while the previous step's outputs are
    made and the next step is planned ahead, its input token filled in from the step before): the same tokens as
    Hugging Face, through chunking and both kinds of preemption, with speculation off (every steady step planned
    ahead) and on."""
    family = FAMILIES[0]
    prompts, expected = _reference(family, tiny_model_dirs[family], "cpu")
    for method in ("off", "auto"):
        engine = build_engine(str(tiny_model_dirs[family]), device="cpu", dtype="float64", overlap="on",
                              method=method, **SCENARIOS[scenario], **_kv_budget(tiny_model_dirs[family], scenario))
        assert engine.overlaps
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
        assert [out.token_ids for out in outputs] == expected, method
        counters = engine.stats().counters
        if "preemption" in scenario:
            assert counters.num_preemptions > 0
        if method == "off":
            assert counters.num_steps_ahead > 0, counters
        assert not engine.has_unfinished() and engine.stats().num_used_gpu_blocks == 0
        engine.close()


@pytest.mark.parametrize("scenario", ["block4-chunked", "recompute-preemption", "swap-preemption", "drafts"])
def test_the_plain_and_the_persistent_step_inputs_give_the_same_tokens(
        scenario: str, tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's block tables flattened from the chunks every step (the plain reference) and kept in its
    persistent batch (engine/model/input_batch.py, its assumptions checked every step): the same greedy tokens,
    Hugging Face's, through chunked prefill, both kinds of preemption and drafts (kept, partly kept, trimmed)."""
    from tokenmill.engine.model import input_batch, model_runner
    from tokenmill.engine.model.model_runner import ModelRunner
    from tokenmill.engine.spec.speculator import DraftSpeculator

    family = FAMILIES[0]
    path = tiny_model_dirs[family]
    prompts, expected = _reference(family, path, "cpu")
    settings = dict(SCENARIOS["block4-chunked" if scenario == "drafts" else scenario])
    monkeypatch.setattr(input_batch, "CHECK_ROWS", True)
    tokens = {}
    for persistent in (False, True):
        monkeypatch.setattr(model_runner, "PERSISTENT_BATCH", persistent)
        method = "auto" if scenario == "drafts" else "off"
        engine = build_engine(str(path), device="cpu", dtype="float64", method=method, **settings,
                              **_kv_budget(path, scenario))
        runner = engine.runner
        assert isinstance(runner, ModelRunner) and (runner.input_batch is not None) == persistent
        speculator = engine.scheduler.speculator
        if scenario == "drafts":
            assert isinstance(speculator, DraftSpeculator)
            # NOTE: an oracle, not the n-gram lookup: tiny random models seldom repeat themselves
            speculator.proposers = [OracleDrafts({tuple(p): e for p, e in zip(prompts, expected)}, wrong_every=3)]
            speculator.min_acceptance = 0.0
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
        tokens[persistent] = [out.token_ids for out in outputs]
        if "preemption" in scenario:
            assert engine.stats().counters.num_preemptions > 0
        if scenario == "drafts":
            assert isinstance(speculator, DraftSpeculator) and 0 < speculator.counters.num_accepted_tokens < \
                speculator.counters.num_draft_tokens
        if runner.input_batch is not None:
            assert runner.input_batch.num_entry_writes > 0 and runner.input_batch.num_releases > 0
        assert not engine.has_unfinished() and engine.stats().num_used_gpu_blocks == 0
    assert tokens[False] == tokens[True] == expected
