"""Tensor parallelism (``[engine.model] tensor_parallel_size``): two ranks (CPU; all-reduces through shared
memory, and through gloo in one test) give the greedy tokens of
one rank, token for token, in float64, for a GQA model whose KV heads split across the ranks (llama: 4 heads,
2 KV heads) and one whose single KV head is replicated on both (qwen2: 4 heads, 1 KV head), over prompts of
mixed lengths with chunked prefill, prefix-cache hits and swap preemption. In float32 every rank runs the
native C++ decoder stack and gives the tokens of every rank running eagerly; a probe that disagrees keeps
every rank eager. A follower killed mid-run ends the engine with a clear error, never a hang, and no follower
outlives rank 0. Bad sizes are refused."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoConfig, LlamaConfig

from tests.e2e.parity_helpers import random_prompts
from tests.engine_helpers import build_engine, engine_config
from tests.tiny_models import VOCAB_SIZE, save_tiny_model
from tokenmill.engine import Engine, ModelConfig
from tokenmill.engine.core.step_io import ScheduledChunk
from tokenmill.engine.errors import EngineError, ModelLoadError
from tokenmill.engine.model import model_setup, native_decoder, shm_all_reduce
from tokenmill.engine.model.model_runner import ModelRunner
from tokenmill.engine.model.native_decoder import NativeDecoder
from tokenmill.engine.model.tensor_parallel import plan_shard
from tokenmill.engine.model.tp_group import ProcessGroups, TensorParallelLost
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
NUM_PROMPTS = 8

SCENARIOS: dict[str, dict[str, Any]] = {
    # chunks of 7 prompt tokens in blocks of 4; half the prompts share a 40-token prefix (prefix-cache hits)
    "chunked-prefix": dict(block_size=4, max_prefill_chunk=7, max_num_batched_tokens=64, kv_cache_memory="8MiB"),
    # a pool that holds the largest request but not all of them: requests are swapped out and back in
    "swap-preemption": dict(block_size=4, max_prefill_chunk=32, max_num_batched_tokens=64, preemption_mode="swap",
                            budget_kv=False),
}


def _prompts() -> list[list[int]]:
    prompts = random_prompts(VOCAB_SIZE, NUM_PROMPTS, seed=7, max_len=90)
    shared = random_prompts(VOCAB_SIZE, 1, seed=99, min_len=40, max_len=40)[0]
    return [shared + p if i % 2 else p for i, p in enumerate(prompts)]


def _settings(path: Path, scenario: str, tensor_parallel_size: int, dtype: str = "float64") -> dict[str, Any]:
    settings = dict(SCENARIOS[scenario], device="cpu", dtype=dtype, swap_space="8MiB",
                    tensor_parallel_size=tensor_parallel_size)
    if scenario == "swap-preemption":
        # NOTE: the KV budget is per rank, of that rank's KV heads: 200 tokens on every rank, which holds the
        # largest request (a 40-token prefix + 90 + 16 output) but far from all of them.
        config = AutoConfig.from_pretrained(path)
        kv_heads = max(1, config.num_key_value_heads // tensor_parallel_size)
        head_dim = config.hidden_size // config.num_attention_heads
        settings["kv_cache_memory"] = 200 * config.num_hidden_layers * 2 * kv_heads * head_dim * \
            torch.finfo(getattr(torch, dtype)).bits // 8
    return settings


def _generate(path: Path, settings: dict[str, Any]) -> tuple[list[list[int]], Any]:
    """Every prompt's greedy tokens; prompt 0 asks for two samples, which share its blocks until the first one
    writes a shared block (a copy-on-write block copy, sent to every rank)."""
    engine = build_engine(str(path), **settings)
    params = [SamplingParams(max_tokens=MAX_TOKENS, n=2 if i == 0 else 1) for i in range(NUM_PROMPTS)]
    try:
        outputs = engine.generate(_prompts(), params, progress=False)
        assert not engine.has_unfinished()
        samples = [sample.token_ids for sample in outputs[0].samples or []]
        assert len(samples) == 2
        return [out.token_ids for out in outputs] + samples, engine.stats()
    finally:
        engine.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_ranks_match_one(family: str, scenario: str, tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs[family]
    expected, _ = _generate(path, _settings(path, scenario, 1))
    got, stats = _generate(path, _settings(path, scenario, 2))
    for i, (out, ref) in enumerate(zip(got, expected)):
        assert out == ref, f"{family}/{scenario}: prompt {i} diverged with two ranks"
    assert stats.prefix.num_hit_tokens > 0, stats.prefix
    if scenario == "swap-preemption":
        assert stats.counters.num_swapped_out_blocks > 0 and stats.counters.num_swapped_in_blocks > 0, stats


@pytest.mark.timeout(300)
def test_gloo_all_reduce_gives_the_shared_memory_tokens(tiny_model_dirs: dict[str, Path]) -> None:
    """The CPU all-reduce's fast path (a shared-memory segment, the default) and its plain reference path (gloo)
    give the same tokens as one rank."""
    path = tiny_model_dirs["llama"]
    expected, _ = _generate(path, _settings(path, "chunked-prefix", 1))
    for transport in ("shared_memory", "gloo"):
        settings = dict(_settings(path, "chunked-prefix", 2), tensor_parallel_cpu_all_reduce=transport)
        engine = build_engine(str(path), **settings)
        try:
            uses_shared_memory = engine.runner.tensor_parallel.groups.uses_shared_memory  # type: ignore[attr-defined]
        finally:
            engine.close()
        assert uses_shared_memory == (transport == "shared_memory")
        got, _ = _generate(path, settings)
        assert got == expected, f"two ranks over {transport} diverged from one rank"


@pytest.fixture(scope="module")
def float32_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny float32 models: the dtype whose linear layers are packed, so the native decoder stack applies."""
    root = tmp_path_factory.mktemp("tiny-float32")
    return {family: save_tiny_model(family, root / family, dtype=torch.float32) for family in ("llama", "qwen2")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "scenario"), [("llama", "chunked-prefix"), ("qwen2", "swap-preemption")])
def test_the_native_stack_on_every_rank_gives_the_eager_tokens(family: str, scenario: str,
                                                               float32_models: dict[str, Path]) -> None:
    """With ``decode_fast_path = "auto"`` every rank runs its shard's layers through the C++ decoder stack (the probe at
    load agreed on every rank), and the tokens are those of every rank running eagerly: the stack is bitwise
    the eager forward, with the all-reduces between its blocks."""
    path = float32_models[family]
    settings = _settings(path, scenario, 2, dtype="float32")
    engine = build_engine(str(path), **settings)
    try:
        assert isinstance(engine.runner.native_decoder, NativeDecoder)  # type: ignore[attr-defined]
    finally:
        engine.close()
    native, stats = _generate(path, settings)
    eager, _ = _generate(path, dict(settings, decode_fast_path="off"))
    assert native == eager
    if scenario == "swap-preemption":
        assert stats.counters.num_swapped_out_blocks > 0, stats


@pytest.mark.timeout(300)
def test_a_probe_that_disagrees_on_rank_0_keeps_every_rank_in_step(float32_models: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0's stack disagrees with its eager forward with the fused MLP (a second probe, without it, every
    rank runs too) and then without it: every rank stays eager, and the engine still steps with its followers."""
    forward = NativeDecoder.forward

    def off_by_a_little(self: NativeDecoder, *args: Any) -> torch.Tensor:
        return forward(self, *args) * (1 + 1e-6)

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", torch.ops.tokenmill_native.vec_capability)
    monkeypatch.setattr(NativeDecoder, "forward", off_by_a_little)
    path = float32_models["llama"]
    settings = _settings(path, "chunked-prefix", 2, dtype="float32")
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.model.native_decoder"):
        engine = build_engine(str(path), **settings)
    try:
        assert engine.runner.native_decoder is None  # type: ignore[attr-defined]
        assert sum("differs from eager" in r.message for r in caplog.records) == 2, caplog.text
        outputs = engine.generate(_prompts()[:3], SamplingParams(max_tokens=4), progress=False)
        assert all(len(out.token_ids) == 4 for out in outputs)
    finally:
        engine.close()


@pytest.mark.parametrize("can", [False, True])
def test_a_follower_without_the_stack_runs_the_probe_eagerly_twice(can: bool, tiny_model_dirs: dict[str, Path],
                                                                   float32_models: dict[str, Path]) -> None:
    """A follower that cannot build the stack (here: float64, whose linear layers are not packed) runs its eager
    forward twice, so its all-reduces still pair with the others', and reports that it differs; one that can
    builds it and reports whether it agrees (here, without other ranks, an all-reduce that sums nothing)."""
    path = float32_models["llama"] if can else tiny_model_dirs["llama"]
    engine = build_engine(str(path), device="cpu", dtype="float32" if can else "float64", block_size=4,
                          kv_cache_memory="4MiB")
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    batch = runner.prepare([ScheduledChunk("p", [11, 12, 13], 0, [0], True, SamplingParams(), 0)])
    calls: list[int] = []

    def eager() -> torch.Tensor:
        calls.append(1)
        hidden: torch.Tensor = runner.model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                                  use_cache=False, tokenmill_step=batch.attention).last_hidden_state
        return hidden

    decoder, agrees = native_decoder.follower_probe(runner.model, runner.kv_cache, runner.backend.name,
                                                    fused_mlp=False, all_reduce=lambda tensor: None, eager=eager,
                                                    native_inputs=(batch.input_ids, batch.position_ids,
                                                                   batch.attention))
    assert (decoder is not None, agrees, len(calls)) == ((True, True, 1) if can else (False, False, 2))


def _running(pid: int) -> bool:
    """Whether a process exists and is not a zombie (a follower re-parented to an init that never reaps)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _running(pid)]


@pytest.mark.timeout(120)
def test_a_follower_that_cannot_map_the_segment_fails_the_load(tiny_model_dirs: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """A rank that cannot map the all-reduce's segment reports it as a failed load (rank 0 raises at once, no
    hang at the meeting)."""
    bad = tmp_path / "segment"
    bad.write_bytes(b"too short")
    monkeypatch.setattr(shm_all_reduce, "create_segment", lambda world_size: bad)
    monkeypatch.setattr(ProcessGroups, "use_shared_memory", lambda self, segment: None)  # rank 0 alone skips it
    path = tiny_model_dirs["llama"]
    with pytest.raises(ModelLoadError, match=r"rank 1: ValueError: shared-memory segment"):
        build_engine(str(path), **_settings(path, "chunked-prefix", 2))
    assert not bad.exists(), "rank 0 unlinks the segment whatever happened"


@pytest.mark.timeout(120)
def test_killed_follower_ends_the_engine_with_an_error(tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs["llama"]
    engine = build_engine(str(path), **_settings(path, "chunked-prefix", 2))
    followers = engine.runner.tensor_parallel.follower_pids  # type: ignore[attr-defined]
    try:
        for i, prompt in enumerate(_prompts()):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=64))
        for _ in range(3):
            engine.step()
        os.kill(followers[0], signal.SIGKILL)
        with pytest.raises(TensorParallelLost, match=r"rank 1 \(pid \d+\).*SIGKILL"):
            for _ in range(100):
                engine.step()
    finally:
        engine.close()
    assert _wait_gone(followers, 10) == []


@pytest.mark.timeout(120)
def test_followers_exit_when_rank_0_dies(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        from tests.engine_helpers import build_engine
        engine = build_engine({str(tiny_model_dirs["llama"])!r}, device="cpu", dtype="float64",
                              kv_cache_memory="8MiB", swap_space="8MiB", tensor_parallel_size=2)
        print(*engine.runner.tensor_parallel.follower_pids, flush=True)
        import time
        time.sleep(600)
    """)
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        assert rank0.stdout is not None
        followers = [int(pid) for pid in rank0.stdout.readline().split()]
        assert followers and all(_running(pid) for pid in followers)
    finally:
        rank0.kill()
        rank0.wait()
    assert _wait_gone(followers, 10) == [], "a follower outlived rank 0"


def test_config_rejects_bad_sizes(tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ModelConfig(tensor_parallel_size=0)
    with pytest.raises(ValidationError, match="echo model has no weights to shard"):
        ModelConfig(name="echo", tensor_parallel_size=2)
    # the tiny llama has 4 heads: 3 ranks cannot split them (rank 0 refuses, its followers are stopped)
    with pytest.raises(ModelLoadError, match=r"num_attention_heads \(4\) must divide by it"):
        build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float64", kv_cache_memory="8MiB",
                     tensor_parallel_size=3)
    with pytest.raises(ModelLoadError, match=r"intermediate_size \(130\) must divide by it"):
        plan_shard(LlamaConfig(hidden_size=64, intermediate_size=130, num_attention_heads=4), 130, 0, 4)
    with pytest.raises(ModelLoadError, match=r"num_key_value_heads \(3\) must divide by it, or divide it"):
        plan_shard(LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 128, 0, 2)
    with pytest.raises(ModelLoadError, match="needs Llama-style layers"):
        build_engine(str(tiny_model_dirs["gpt2"]), device="cpu", dtype="float64", kv_cache_memory="8MiB",
                     tensor_parallel_size=2)
    with pytest.raises(EngineError, match="fleet_cache] is not supported with tensor parallelism"):
        Engine.from_config(engine_config(str(tiny_model_dirs["llama"]), device="cpu", tensor_parallel_size=2,
                                         enabled=True))
    monkeypatch.setattr(model_setup, "resolve_device", lambda _: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ModelLoadError, match="needs one GPU per rank, but torch sees 1"):
        Engine.from_config(engine_config(str(tiny_model_dirs["llama"]), tensor_parallel_size=2))


def test_split_rules() -> None:
    """Query heads split evenly; each rank keeps the KV heads its query heads read (shared when fewer than ranks)."""
    gqa = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=4)
    assert [(p.heads, p.kv_heads) for p in (plan_shard(gqa, 128, rank, 2) for rank in range(2))] == \
        [(range(0, 4), range(0, 2)), (range(4, 8), range(2, 4))]
    mqa = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2)
    assert [p.kv_heads for p in (plan_shard(mqa, 128, rank, 4) for rank in range(4))] == \
        [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert plan_shard(mqa, 128, 3, 4).intermediate == range(96, 128)
