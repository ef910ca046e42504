"""Greedy parity on the real SmolLM2-135M-Instruct (float32): the engine's tokens equal Hugging
Face ``generate``, except where the reference's top two logits are a near-tie (< 1e-4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.doubles import LocalBlockStore
from tests.e2e.parity_helpers import DEVICES, assert_parity, attention_backend, hf_greedy, load_reference
from tests.engine_helpers import build_engine
from tokenmill.engine import Engine
from tokenmill.engine.model.model_runner import ModelRunner
from tokenmill.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three primary colors.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer briefly, please, in one or two sentences for a curious teenager.",
    "Name a planet in our solar system.",
    "What does a bee make?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Suggest a name for a pet goldfish.",
    "What is the boiling point of water in Celsius?",
    "Write one sentence about autumn leaves falling in a quiet park while children play nearby.",
    "Who wrote Hamlet?",
    "How many legs does a spider have?",
    # Copy-heavy: the n-gram lookup drafts from the prompt (speculative decoding, on by default).
    "Repeat exactly: The quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "Rewrite as JSON with keys name and city: name: Alice Martin, city: Lyon",
    "Fix the spelling: The comittee will meet on Wensday to discus the new bugdet.",
]

SCENARIOS: dict[str, dict[str, Any]] = {
    "block16": dict(block_size=16),
    "block4-chunked": dict(block_size=4, max_prefill_chunk=16, max_num_batched_tokens=128),
    "block16-no-prefix-cache": dict(block_size=16, enable_prefix_caching=False),
    # The preemption scenarios admit whatever fits (no predicted-KV budget), so the pool runs out.
    "recompute-preemption": dict(block_size=4, preemption_mode="recompute", kv_cache_memory=80 * 4 * 46080,
                                 budget_kv=False),
    "swap-preemption": dict(block_size=4, preemption_mode="swap", kv_cache_memory=80 * 4 * 46080, budget_kv=False),
    # Output-length prediction is on everywhere; here it budgets a tight pool and orders shortest first.
    "length-shortest-first": dict(block_size=4, kv_cache_memory=80 * 4 * 46080, ordering="shortest", min_samples=2,
                                  budget_kv=True),
    # The base engine runs the device's kernel; the reference backend once, on the base scenario.
    "block16-reference": dict(block_size=16, attention_backend="reference"),
    # Every other scenario runs the captured step (CPU: the native decoder stack); eager once.
    "block16-eager": dict(block_size=16, decode_fast_path="off"),
    # Speculative decoding is on ("auto") in every scenario above; here the plain one-token decode.
    "block16-no-speculation": dict(block_size=16, method="off"),
}


@pytest.fixture(scope="module", params=DEVICES)
def engine_and_reference(
    request: pytest.FixtureRequest,
) -> tuple[Engine, torch.nn.Module, list[list[int]], list[list[int]], str]:
    device = request.param
    engine = build_engine("smollm2-135m", device=device, dtype="float32", kv_cache_memory="256MiB",
                          attention_backend=attention_backend("kernel", device))
    tokenizer = engine.tokenizer
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"])
        for q in QUESTIONS
    ]
    reference = load_reference(engine.limits.source, torch.float32, device)
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    return engine, reference, prompts, expected, device


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_smollm2_greedy_matches_hf_generate(scenario: str, engine_and_reference: Any) -> None:
    base_engine, reference, prompts, expected, device = engine_and_reference
    if scenario == "block16":
        engine = base_engine
    else:
        settings = {"kv_cache_memory": "256MiB", "attention_backend": attention_backend("kernel", device),
                    **SCENARIOS[scenario]}
        engine = build_engine("smollm2-135m", device=device, dtype="float32", **settings)
    if device == "cpu":
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        eager = scenario in ("block16-eager", "block16-reference")
        assert (runner.native_decoder is None) == eager, scenario
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
    for out, prompt, want in zip(outputs, prompts, expected):
        assert_parity(out.token_ids, want, prompt, reference)
    stats = engine.stats()
    if "preemption" in scenario:
        assert stats.counters.num_preemptions > 0, stats
    if scenario == "swap-preemption":
        assert stats.counters.num_swapped_out_blocks > 0, stats
    if scenario == "block4-chunked":  # later prompts find the chat template's system prompt cached
        assert stats.prefix.num_hit_tokens > 0, stats.prefix
    if scenario == "block16-no-prefix-cache":
        assert stats.prefix.num_hit_tokens == 0, stats.prefix
    if scenario == "length-shortest-first":
        assert stats.length.num_observed == len(prompts) and stats.counters.num_preemptions == 0, stats
    if scenario == "block16-no-speculation":
        assert stats.speculation.num_drafts == 0
    elif scenario == "block16" or "preemption" in scenario:  # NOTE: block16's engine is shared by other tests
        assert stats.speculation.num_accepted_tokens > 0, stats.speculation


def test_smollm2_outputs_read_well(engine_and_reference: Any) -> None:
    engine = engine_and_reference[0]
    outputs = engine.generate(
        [[{"role": "user", "content": "What is the capital of France?"}]], SamplingParams(max_tokens=24), progress=False
    )
    assert "Paris" in outputs[0].text
    assert outputs[0].finish_reason == "stop"


def test_smollm2_fleet_cache_and_prefill_handoff_match_hf(engine_and_reference: Any) -> None:
    """A second engine fetches the chat template's prefix from the fleet's store, and a decode engine continues
    requests a prefill engine computed the prompts of (one token each, as a prefill worker runs them): both
    still match Hugging Face."""
    _, reference, prompts, expected, device = engine_and_reference
    settings = {"kv_cache_memory": "256MiB", "attention_backend": attention_backend("kernel", device),
                "block_size": 4, "min_blocks": 1}
    store = LocalBlockStore()
    # NOTE: publish "all", as a prefill worker does (worker/runtime.py): every computed prompt block travels
    first = build_engine("smollm2-135m", block_store=store, device=device, dtype="float32", publish="all",
                         **settings)
    first.generate(prompts[:4], SamplingParams(max_tokens=1), progress=False)  # the prefill pool's part
    assert first.fleet is not None and first.fleet.flush(timeout_s=30)
    second = build_engine("smollm2-135m", block_store=store, device=device, dtype="float32", **settings)
    for i, prompt in enumerate(prompts):
        second.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS), is_handed_off=i < 4)
    outputs: dict[str, list[int]] = {}
    while second.has_unfinished():
        for out in second.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        assert_parity(outputs[f"r{i}"], want, prompt, reference)
    fleet = second.stats().fleet
    assert fleet.num_handoffs == 4 and fleet.handoff_recomputed_blocks == 0, fleet
    assert fleet.num_hit_blocks > 0 and fleet.num_fallbacks == 0, fleet
