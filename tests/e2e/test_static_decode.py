"""Decode steps at static shapes (the buffers CUDA graphs replay), run eagerly on the CPU: padded
buckets and the scratch block must not change a single token, nor touch a real block, and a step
with a prompt clipped to one token runs eagerly. On CUDA (marked ``gpu``): the graphs are captured
at start-up and replayed, with Hugging Face's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.parity_helpers import hf_greedy, load_reference, random_prompts, static_engine
from tests.engine_helpers import build_engine
from tests.tiny_models import VOCAB_SIZE
from tokenmill.engine.core.step_io import ModelOutput, ScheduledChunk, SchedulerOutput
from tokenmill.engine.kernels.attention import cpu_kernel
from tokenmill.engine.kernels.attention.reference import ReferenceBackend
from tokenmill.engine.model.kv_cache import KVCache, KVCacheSpec
from tokenmill.engine.model.model_runner import ModelRunner
from tokenmill.engine.model.static_decode import (
    MAX_VERIFY_TOKENS,
    CapturedStep,
    StaticDecode,
    decode_buckets,
    verify_query_lens,
)
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e
NEEDS_CPU_KERNEL = pytest.mark.skipif(not cpu_kernel.is_available(), reason="needs the CPU kernel")


def test_buckets_cover_every_batch_size() -> None:
    assert decode_buckets(1) == [1] and decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_verification_lengths_cover_every_draft_length() -> None:
    assert verify_query_lens(0) == [] and verify_query_lens(1) == [2]
    assert verify_query_lens(10) == [2, 3, 5, 9, 11]


def test_large_verification_shapes_are_left_eager() -> None:
    """A verification step of more than MAX_VERIFY_TOKENS tokens keeps no graph (its logits alone would hold a
    row per token in graph memory): such steps run through the flattened batch."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=4, dtype=torch.float32)
    static = StaticDecode(lambda *args: torch.zeros(0), KVCache(spec, 4, 0, torch.device("cpu")), ReferenceBackend(),
                          decode_buckets(256), max_blocks_per_seq=8, query_lens=[1, *verify_query_lens(10)])
    assert {(bucket, 1) for bucket in decode_buckets(256)} <= set(static.shapes)
    assert (32, 11) in static.shapes and (64, 11) not in static.shapes and (256, 2) in static.shapes
    assert all(q == 1 or bucket * q <= MAX_VERIFY_TOKENS for bucket, q in static.shapes)

    def verification(n: int) -> list[ScheduledChunk]:
        return [ScheduledChunk(f"r{i}", [1] * 11, 4, [i, i + 1, i + 2, i + 3], True, SamplingParams(), 1,
                               num_draft_tokens=10) for i in range(n)]

    assert static.shape_for(verification(32)) == (32, 11) and static.shape_for(verification(33)) is None


@NEEDS_CPU_KERNEL
def test_padded_decode_steps_match_hf_generate(tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs["llama"]
    prompts = random_prompts(VOCAB_SIZE, 11, seed=3, max_len=60)
    reference = load_reference(path, torch.float64)
    expected = [hf_greedy(reference, p, 20) for p in prompts]
    engine = static_engine(path, max_num_seqs=6)
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.static_decode is not None
    scratch = runner.kv_cache.device_pool[:, :, runner.kv_cache.scratch_block_id].clone()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=20), progress=False)
    assert [o.token_ids for o in outputs] == expected
    used = runner.static_decode.num_runs
    assert used and set(used) <= {(1, 1), (2, 1), (4, 1), (6, 1)}, used
    # padding rows ran: they write into the scratch block
    assert not torch.equal(scratch, runner.kv_cache.device_pool[:, :, runner.kv_cache.scratch_block_id])
    assert engine.stats().num_used_gpu_blocks == 0


@NEEDS_CPU_KERNEL
def test_a_prompt_clipped_to_one_token_is_not_a_decode(tiny_model_dirs: dict[str, Path]) -> None:
    """A step budget of 4 tokens with 3 decodes running leaves one token for the next prompt: that
    chunk samples nothing, so the step must not run as a static decode step (which returns a token
    for every row: the scheduler then raised InvariantError)."""
    path = tiny_model_dirs["llama"]
    prompts = random_prompts(VOCAB_SIZE, 6, seed=8, min_len=6, max_len=12)
    reference = load_reference(path, torch.float64)
    expected = [hf_greedy(reference, p, 12) for p in prompts]
    engine = static_engine(path, max_num_seqs=4, max_num_batched_tokens=4, max_prefill_chunk=4)
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.static_decode is not None
    clipped = []
    original_execute = runner.execute

    def recording_execute(output: SchedulerOutput) -> ModelOutput:
        if output.chunks and all(c.num_tokens == 1 for c in output.chunks):
            clipped.extend(c for c in output.chunks if not c.needs_sample)
        return original_execute(output)

    runner.execute = recording_execute  # type: ignore[method-assign]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12), progress=False)
    assert clipped, "the workload never clipped a prompt to one token beside decodes"
    assert [o.token_ids for o in outputs] == expected
    assert sum(runner.static_decode.num_runs.values()) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cuda_graphs_are_captured_and_replayed(family: str, tiny_model_dirs: dict[str, Path]) -> None:
    """On CUDA with the Triton kernel, decode steps are captured per bucket at start-up and replayed:
    tokens equal Hugging Face's, and every decode step that fit a bucket replayed its graph."""
    path = tiny_model_dirs[family]
    prompts = random_prompts(VOCAB_SIZE, 11, seed=5, max_len=60)
    reference = load_reference(path, torch.float64, "cuda")
    expected = [hf_greedy(reference, p, 20) for p in prompts]
    engine = build_engine(str(path), device="cuda", dtype="float64", kv_cache_memory="64MiB", block_size=4,
                          max_num_seqs=6, attention_backend="triton")
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.static_decode is not None
    runners = runner.static_decode.runners
    assert sorted(runners) == [(bucket, 1) for bucket in decode_buckets(6)]
    assert all(isinstance(r, CapturedStep) for r in runners.values())
    outputs = engine.generate(prompts, SamplingParams(max_tokens=20), progress=False)
    assert [o.token_ids for o in outputs] == expected
    replays = {shape: r.num_replays for shape, r in runners.items() if isinstance(r, CapturedStep)}
    runs = {shape: runner.static_decode.num_runs[shape] for shape in runners}
    assert sum(replays.values()) > 0 and replays == runs, (replays, runs)
