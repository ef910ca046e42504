"""The CPU's native decoder stack (engine/model/native_decoder) against the eager forward it replaces:
bitwise-equal logits on random mixed batches (decodes and prefill chunks over a cached prefix,
random block tables, block sizes 1 / 4 / 16, GQA, biases), the same generated tokens through
preemption, and the models and settings that must stay eager."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.e2e.parity_helpers import random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import VOCAB_SIZE, build_tokenizer
from tokenmill.engine import Engine
from tokenmill.engine.core.step_io import ScheduledChunk
from tokenmill.engine.kernels import cpu_linear
from tokenmill.engine.model import native_decoder
from tokenmill.engine.model.model_runner import ModelRunner
from tokenmill.engine.model.native_decoder import NativeDecoder
from tokenmill.engine.sample.sampler import greedy_token_ids
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

NATIVE_FAMILIES = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with every bias on (q/k/v, o-projection, MLP): the stack's optional inputs; and
    widths whose fused loops take their vector loop and their scalar tail: a hidden size of 80
    (RMSNorm) and heads of 80, not hidden / heads, whose rotary halves are 40 (the other tiny
    models' halves are all tail)."""
    path = tmp_path_factory.mktemp("biased-llama")
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=80, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=80, attention_bias=True, mlp_bias=True,
                         max_position_embeddings=1024)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _runner(engine: Engine) -> ModelRunner:
    assert isinstance(engine.runner, ModelRunner)
    return engine.runner


def _model_path(name: str, tiny_model_dirs: dict[str, Path], biased_llama: Path) -> Path:
    return biased_llama if name == "biased-llama" else tiny_model_dirs[name]


def _random_batch(rng: random.Random, block_size: int, num_blocks: int) -> list[ScheduledChunk]:
    """Decodes over contexts of 1-40 tokens, then prefill chunks of 2-20 tokens over 0-30 cached
    ones; each sequence gets distinct random blocks."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    shapes = [(rng.randint(0, 39), 1) for _ in range(rng.randint(1, 5))]
    shapes += [(rng.randint(0, 30), rng.randint(2, 20)) for _ in range(rng.randint(0, 3))]
    chunks = []
    for i, (start, length) in enumerate(shapes):
        blocks = [free.pop() for _ in range((start + length + block_size - 1) // block_size)]
        tokens = [rng.randrange(VOCAB_SIZE) for _ in range(length)]
        chunks.append(ScheduledChunk(f"r{i}", tokens, start, blocks, rng.random() < 0.8 or length == 1,
                                     SamplingParams(), 0))
    return chunks


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", [*NATIVE_FAMILIES, "biased-llama"])
def test_native_logits_are_bitwise_the_eager_ones(model: str, dtype: str, block_size: int,
                                                  tiny_model_dirs: dict[str, Path], biased_llama: Path) -> None:
    engine = build_engine(str(_model_path(model, tiny_model_dirs, biased_llama)), device="cpu", dtype=dtype,
                          block_size=block_size, kv_cache_memory="4MiB")
    runner = _runner(engine)
    native = runner.native_decoder
    assert isinstance(native, NativeDecoder), "a Llama-family CPU model should run natively"
    # The fused SiLU-gated MLP is compared too wherever ATen runs at the stack's vector width
    # (biased-llama's 96-wide MLP also takes its scalar tail in bfloat16).
    assert native.fused_mlp == (torch.backends.cpu.get_cpu_capability() ==
                                torch.ops.tokenmill_native.vec_capability())
    rng = random.Random(f"{model}-{dtype}-{block_size}")
    num_blocks = runner.kv_cache.scratch_block_id
    for _ in range(6):
        runner.kv_cache.device_pool.normal_()  # the cached prefixes both paths read
        batch = runner.prepare(_random_batch(rng, block_size, num_blocks))
        args = (batch.input_ids, batch.position_ids, batch.sample_indices, batch.attention)
        eager = runner.forward(*args)
        pool_after_eager = runner.kv_cache.device_pool.clone()
        got = native.forward(*args)
        assert torch.equal(got, eager)
        assert torch.equal(runner.kv_cache.device_pool, pool_after_eager), "the stack wrote other keys/values"


@pytest.mark.parametrize("kernel", ["onednn", "panels"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["llama", "biased-llama"])
def test_native_logits_are_bitwise_the_eager_ones_with_each_linear_kernel(
        model: str, dtype: str, kernel: str, tiny_model_dirs: dict[str, Path], biased_llama: Path) -> None:
    """Whichever kernel this CPU picks above, both are checked here (the stack calls the same one)."""
    chosen = cpu_linear.KERNELS[kernel]
    if not cpu_linear.packing_works(getattr(torch, dtype), chosen):
        pytest.skip(f"{kernel} cannot pack {dtype} here")
    engine = build_engine(str(_model_path(model, tiny_model_dirs, biased_llama)), device="cpu", dtype=dtype,
                          block_size=4, kv_cache_memory="4MiB", linear_kernel=kernel)
    runner = _runner(engine)
    native = runner.native_decoder
    assert isinstance(native, NativeDecoder) and runner.model.lm_head.kernel is chosen
    rng = random.Random(f"{model}-{dtype}-{kernel}")
    for _ in range(4):
        runner.kv_cache.device_pool.normal_()
        batch = runner.prepare(_random_batch(rng, 4, runner.kv_cache.scratch_block_id))
        args = (batch.input_ids, batch.position_ids, batch.sample_indices, batch.attention)
        assert torch.equal(native.forward(*args), runner.forward(*args))


def _generate(path: Path, **settings: Any) -> tuple[list[list[int]], Engine]:
    # 40 blocks of 4 tokens (tiny Llama: 2 layers x K/V x 2 heads x 16 dims x 4 bytes = 512 bytes a
    # token): room for the longest request (120 + 20 tokens), not for all twelve.
    engine = build_engine(str(path), device="cpu", dtype="float32", block_size=4, max_prefill_chunk=7,
                          max_num_batched_tokens=48, preemption_mode="swap", kv_cache_memory=40 * 4 * 512,
                          swap_space="4MiB", budget_kv=False, **settings)
    prompts = random_prompts(VOCAB_SIZE, 12, seed=5)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), progress=False)
    return [out.token_ids for out in outputs], engine


def test_generation_through_preemption_is_the_same_native_and_eager(tiny_model_dirs: dict[str, Path]) -> None:
    native_tokens, native_engine = _generate(tiny_model_dirs["llama"])
    eager_tokens, eager_engine = _generate(tiny_model_dirs["llama"], decode_fast_path="off")
    assert _runner(native_engine).native_decoder is not None
    assert _runner(eager_engine).native_decoder is None
    assert native_engine.stats().counters.num_preemptions > 0
    assert native_tokens == eager_tokens


@pytest.mark.parametrize(("model", "settings", "reason"), [
    ("gpt2", dict(dtype="float32"), "model type 'gpt2'"),
    ("llama", dict(dtype="float32", attention_backend="reference"), "C++ attention backend"),
    ("llama", dict(dtype="float64"), "packed"),
    ("llama", dict(dtype="float32", decode_fast_path="off"), None),
])
def test_other_models_and_settings_run_eagerly(model: str, settings: dict[str, Any], reason: str | None,
                                               tiny_model_dirs: dict[str, Path],
                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.model.native_decoder"):
        engine = build_engine(str(tiny_model_dirs[model]), device="cpu", kv_cache_memory="4MiB", **settings)
    assert _runner(engine).native_decoder is None
    if reason is not None:
        assert any("decoder layers run eagerly" in r.message and reason in r.message for r in caplog.records)
    outputs = engine.generate(random_prompts(VOCAB_SIZE, 2, seed=1), SamplingParams(max_tokens=4), progress=False)
    assert all(len(out.token_ids) == 4 for out in outputs)


def test_without_the_built_extension_the_layers_run_eagerly(tiny_model_dirs: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(native_decoder._EXTENSION, "is_available", lambda: False)  # no compiler, failed build
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.model.native_decoder"):
        engine = build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", kv_cache_memory="4MiB")
    assert _runner(engine).native_decoder is None
    assert any("could not be built" in r.message for r in caplog.records)
    outputs = engine.generate(random_prompts(VOCAB_SIZE, 2, seed=2), SamplingParams(max_tokens=4), progress=False)
    assert all(len(out.token_ids) == 4 for out in outputs)


def test_a_model_with_layers_packed_for_different_kernels_is_not_eligible(tiny_model_dirs: dict[str, Path]) -> None:
    engine = build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", kv_cache_memory="4MiB")
    model = _runner(engine).model
    assert native_decoder.ineligible_reason(model, "cpu") is None
    down = model.model.layers[-1].mlp.down_proj
    down.kernel = cpu_linear.PANELS if down.kernel is cpu_linear.ONEDNN else cpu_linear.ONEDNN
    assert "packed for different kernels" in str(native_decoder.ineligible_reason(model, "cpu"))


def test_a_stack_that_disagrees_on_the_probe_is_not_used(tiny_model_dirs: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    forward = NativeDecoder.forward

    def off_by_a_little(self: NativeDecoder, *args: Any) -> torch.Tensor:
        return forward(self, *args) * (1 + 1e-6)

    monkeypatch.setattr(NativeDecoder, "forward", off_by_a_little)
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine.model.native_decoder"):
        engine = build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", kv_cache_memory="4MiB")
    assert _runner(engine).native_decoder is None
    assert any("differs from eager" in r.message for r in caplog.records)


def test_a_fused_mlp_that_disagrees_leaves_the_stack_on_without_it(tiny_model_dirs: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fused silu(gate) * up would not round as ATen's kernels (another vector width),
    the probe rejects it and the stack runs with ATen's silu and mul instead of going eager."""
    forward = NativeDecoder.forward

    def fused_is_off(self: NativeDecoder, *args: Any) -> torch.Tensor:
        logits = forward(self, *args)
        return logits * (1 + 1e-6) if self.fused_mlp else logits

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", torch.ops.tokenmill_native.vec_capability)
    monkeypatch.setattr(NativeDecoder, "forward", fused_is_off)
    engine = build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", kv_cache_memory="4MiB")
    native = _runner(engine).native_decoder
    assert isinstance(native, NativeDecoder) and not native.fused_mlp
    outputs = engine.generate(random_prompts(VOCAB_SIZE, 2, seed=3), SamplingParams(max_tokens=4), progress=False)
    assert all(len(out.token_ids) == 4 for out in outputs)


def test_the_sampler_picks_greedy_tokens_natively_when_the_stack_is_on(tiny_model_dirs: dict[str, Path]) -> None:
    engine = build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32")
    assert _runner(engine).native_decoder is not None
    assert _runner(engine).sampler.argmax is native_decoder.greedy_token_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 7), (3, 32), (64, 1000), (5, 49_157)])
def test_native_greedy_token_ids_match_torch(dtype: torch.dtype, rows: int, vocab: int) -> None:
    """The C++ greedy choice is torch's ``max(dim=-1).indices``: first index of ties, first NaN,
    infinities, rows of a wider tensor."""
    assert native_decoder._EXTENSION.is_available()
    generator = torch.Generator().manual_seed(rows * vocab)
    wide = torch.randint(-3, 4, (rows, vocab + 5), generator=generator).to(dtype)  # many tied maxima
    logits = wide[:, 2:vocab + 2]  # contiguous columns, rows further apart
    if rows > 2:
        logits[0, vocab // 2] = logits[0, vocab - 1] = float("nan")
        logits[1, :] = float("-inf")
        logits[2, vocab - 1] = float("inf")
    got = native_decoder.greedy_token_ids(logits)
    assert torch.equal(got, logits.max(dim=-1).indices)
    assert torch.equal(got, logits.argmax(dim=-1))


def test_the_runner_is_built_with_its_fast_path_and_says_which_once(tiny_model_dirs: dict[str, Path],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The fast path is chosen as the runner is constructed (nothing is attached afterwards), its
    greedy choice comes with it, and the start-up log names the choice in one line."""
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.model.model_setup"):
        native = build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", kv_cache_memory="4MiB")
        eager = build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float32", kv_cache_memory="4MiB",
                             decode_fast_path="off")
    lines = [r.message for r in caplog.records if r.message.startswith("fast paths:")]
    assert lines == ["fast paths: forward=native C++ decoder stack, decode steps=as any step, attention=cpu",
                     "fast paths: forward=eager, decode steps=as any step, attention=cpu"], lines
    assert _runner(native).sampler.argmax is native_decoder.greedy_token_ids
    assert _runner(eager).sampler.argmax is greedy_token_ids and _runner(eager).native_decoder is None
