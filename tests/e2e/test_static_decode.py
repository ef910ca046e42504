"""Decode steps at static shapes (the buffers CUDA graphs replay), run eagerly on the CPU: padded
buckets and the scratch block must not change a single token, nor touch a real block, and a step
with a prompt clipped to one token runs eagerly. On CUDA (marked ``gpu``): the graphs are captured
at start-up and replayed, with Hugging Face's tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.e2e.parity_helpers import hf_greedy, load_reference, random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import VOCAB_SIZE
from tokenmill.engine import Engine
from tokenmill.engine.core.step_io import ModelOutput, SchedulerOutput
from tokenmill.engine.kernels.attention import cpu_kernel
from tokenmill.engine.model.model_runner import ModelRunner
from tokenmill.engine.model.static_decode import CapturedStep, StaticDecode, decode_buckets
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e
NEEDS_CPU_KERNEL = pytest.mark.skipif(not cpu_kernel.is_available(), reason="needs the CPU kernel")


def eager(bucket: int, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return forward


def test_buckets_cover_every_batch_size() -> None:
    assert decode_buckets(1) == [1] and decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def static_engine(path: Path, **settings: object) -> Engine:
    """A CPU engine whose decode steps run through StaticDecode's buffers (eagerly, as CUDA replays them)."""
    engine = build_engine(str(path), device="cpu", dtype="float64", kv_cache_memory="8MiB", block_size=4,
                          attention_backend="cpu", **settings)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    static = StaticDecode(runner.forward, runner.kv_cache, runner.backend,
                          decode_buckets(engine.scheduler.config.max_num_seqs), max_blocks_per_seq=64)
    static.prepare_runners(eager, "eager buckets")
    engine.runner = ModelRunner(runner.loaded, runner.kv_cache, runner.sampler, runner.backend, static_decode=static)
    return engine


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
    assert used and set(used) <= {1, 2, 4, 6}, used
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
    assert sorted(runners) == decode_buckets(6) and all(isinstance(r, CapturedStep) for r in runners.values())
    outputs = engine.generate(prompts, SamplingParams(max_tokens=20), progress=False)
    assert [o.token_ids for o in outputs] == expected
    replays = {bucket: r.num_replays for bucket, r in runners.items() if isinstance(r, CapturedStep)}
    runs = {bucket: runner.static_decode.num_runs[bucket] for bucket in runners}
    assert sum(replays.values()) > 0 and replays == runs, (replays, runs)
