"""Speculative decoding on real (tiny, random) models: greedy output token-identical to
Hugging Face ``generate`` with drafts in flight -- accepted, partly rejected, across block sizes,
chunked prefill, swap and recompute preemption, prefix caching, n > 1, the native decoder stack and
the eager reference -- sampled output that keeps the target distribution (chi-square) and seeded
output identical with and without drafts, and a draft model drafting for itself accepted fully.

Random tiny models rarely repeat themselves, so the n-gram lookup seldom drafts for them: these
tests draft with an oracle that knows the greedy continuation and corrupts some of its tokens, so
every path of verification (all kept, some kept, none kept) runs many times."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.oracle_drafts import OracleDrafts
from tests.e2e.parity_helpers import (
    DEVICES,
    attention_backend,
    hf_greedy,
    load_reference,
    random_prompts,
    static_engine,
)
from tests.engine_helpers import build_engine
from tests.tiny_models import VOCAB_SIZE
from tokenmill.engine import Engine
from tokenmill.engine.core.step_io import ScheduledChunk
from tokenmill.engine.kernels.attention import cpu_kernel
from tokenmill.engine.model.model_runner import ModelRunner
from tokenmill.engine.model.static_decode import verify_query_lens
from tokenmill.engine.spec.draft_model import DraftModelProposer
from tokenmill.engine.spec.speculator import DraftSpeculator
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24


def _with_oracle(engine: Engine, continuations: dict[tuple[int, ...], list[int]], wrong_every: int) -> DraftSpeculator:
    speculator = engine.scheduler.speculator
    assert isinstance(speculator, DraftSpeculator)
    speculator.proposers = [OracleDrafts(continuations, wrong_every)]
    speculator.min_acceptance = 0.0  # keep drafting even where the oracle lies often
    return speculator


_REFERENCES: dict[str, tuple[list[list[int]], list[list[int]]]] = {}


def _reference(family: str, path: Path) -> tuple[list[list[int]], list[list[int]]]:
    if family not in _REFERENCES:
        prompts = random_prompts(VOCAB_SIZE, 10, seed=7)
        shared = random_prompts(VOCAB_SIZE, 1, seed=98, min_len=24, max_len=24)[0]
        prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
        model = load_reference(path, torch.float64)
        _REFERENCES[family] = (prompts, [hf_greedy(model, p, MAX_TOKENS) for p in prompts])
    return _REFERENCES[family]


SCENARIOS: dict[str, dict[str, Any]] = {
    "block16": dict(block_size=16),
    "block1": dict(block_size=1, max_prefill_chunk=256, max_num_batched_tokens=256),
    "block4-chunked": dict(block_size=4, max_prefill_chunk=7, max_num_batched_tokens=40),
    "recompute-preemption": dict(block_size=4, preemption_mode="recompute", max_prefill_chunk=32,
                                 max_num_batched_tokens=64,
                                 kv_cache_memory="tight", budget_kv=False),
    "swap-preemption": dict(block_size=4, preemption_mode="swap", max_prefill_chunk=32, max_num_batched_tokens=64,
                            kv_cache_memory="tight", budget_kv=False),
    "eager-reference": dict(block_size=4, decode_fast_path="off", attention_backend="reference"),
}


def _settings(path: Path, scenario: str, prompts: list[list[int]]) -> dict[str, Any]:
    settings = dict(SCENARIOS[scenario])
    if settings.get("kv_cache_memory") == "tight":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        per_token = config.num_hidden_layers * 2 * num_kv_heads * (config.hidden_size // config.num_attention_heads) * 8
        # the largest request and a little more: far from all of them
        settings["kv_cache_memory"] = (max(map(len, prompts)) + MAX_TOKENS + 16) * per_token
        settings["swap_space"] = "8MiB"
    return settings


@pytest.mark.parametrize("wrong_every", [0, 3], ids=["right", "every-third-wrong"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedy_with_drafts_matches_hf_generate(family: str, scenario: str, wrong_every: int,
                                                tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs[family]
    prompts, expected = _reference(family, path)
    engine = build_engine(str(path), device="cpu", dtype="float64", method="auto", **_settings(path, scenario, prompts))
    speculator = _with_oracle(engine, {tuple(p): e for p, e in zip(prompts, expected)}, wrong_every)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
    assert [o.token_ids for o in outputs] == expected
    counters = speculator.counters
    assert counters.num_draft_tokens > 0
    if wrong_every:
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    else:
        assert counters.num_accepted_tokens == counters.num_draft_tokens
    stats = engine.stats()
    if "preemption" in scenario:
        assert stats.counters.num_preemptions > 0
    assert stats.num_used_gpu_blocks == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("wrong_every", [0, 3], ids=["right", "every-third-wrong"])
def test_the_native_decoder_runs_drafts_as_the_eager_reference_does(wrong_every: int,
                                                                    tiny_model_dirs: dict[str, Path]) -> None:
    """float32 (the native decoder stack's dtype): drafts through the C++ stack and attention kernel
    give the tokens the eager reference gives without drafts."""
    path = tiny_model_dirs["llama"]
    prompts, _ = _reference("llama", path)
    settings = dict(device="cpu", dtype="float32", block_size=4, max_prefill_chunk=9)
    eager = build_engine(str(path), decode_fast_path="off", attention_backend="reference", method="off", **settings)
    want = [o.token_ids for o in eager.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)]
    engine = build_engine(str(path), method="auto", **settings)
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.native_decoder is not None
    speculator = _with_oracle(engine, {tuple(p): w for p, w in zip(prompts, want)}, wrong_every)
    got = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)]
    assert got == want
    assert speculator.counters.num_accepted_tokens > 0


@pytest.mark.parametrize("device", DEVICES)
def test_drafts_through_the_device_kernel_and_captured_steps_match_hf_generate(
        device: str, tiny_model_dirs: dict[str, Path]) -> None:
    """The device's attention kernel (CPU: C++; CUDA: Triton) runs the draft chunks, and on CUDA the
    steps without drafts and those with replay captured graphs: the tokens are still Hugging Face's."""
    path = tiny_model_dirs["llama"]
    prompts, expected = _reference("llama", path)
    engine = build_engine(str(path), device=device, dtype="float64", method="auto", block_size=4,
                          max_prefill_chunk=16, max_num_batched_tokens=64, attention_backend=attention_backend(
                              "kernel", device))
    speculator = _with_oracle(engine, {tuple(p): e for p, e in zip(prompts, expected)}, wrong_every=3)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
    assert [o.token_ids for o in outputs] == expected
    assert 0 < speculator.counters.num_accepted_tokens < speculator.counters.num_draft_tokens
    runner = engine.runner
    if device == "cuda":
        assert isinstance(runner, ModelRunner) and runner.static_decode is not None
        runs = runner.static_decode.num_runs
        assert sum(n for (_, q), n in runs.items() if q == 1) > 0  # captured decode steps ran between the drafts
        assert sum(n for (_, q), n in runs.items() if q > 1) > 0  # and steps with drafts replayed theirs


@pytest.mark.skipif(not cpu_kernel.is_available(), reason="needs the CPU kernel")
@pytest.mark.parametrize("wrong_every", [0, 3], ids=["right", "every-third-wrong"])
def test_verification_steps_at_static_shapes_match_hf_generate(wrong_every: int, tiny_model_dirs: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps with drafts run in the shapes CUDA graphs replay (engine/model/static_decode.py), here eagerly on the
    CPU: each request's newest token and drafts padded to the step's query length, shorter drafts' tails and the
    bucket's spare sequences in the scratch block. Hugging Face's tokens, with drafts kept in full, in part and not
    at all, and steps of mixed draft lengths among them."""
    path = tiny_model_dirs["llama"]
    prompts, expected = _reference("llama", path)
    engine = static_engine(path, query_lens=[1, *verify_query_lens(4)], method="auto", num_speculative_tokens=4,
                           max_num_seqs=6, max_prefill_chunk=16, max_num_batched_tokens=64)
    speculator = _with_oracle(engine, {tuple(p): e for p, e in zip(prompts, expected)}, wrong_every)
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.static_decode is not None
    static = runner.static_decode
    padded_steps = []
    fill = static._fill

    def recording_fill(chunks: list[ScheduledChunk], shape: tuple[int, int], rows: Any = None) -> int:
        if shape[1] > 1 and any(c.num_tokens < shape[1] for c in chunks):
            padded_steps.append((shape, [c.num_tokens for c in chunks]))
        return fill(chunks, shape, rows)

    monkeypatch.setattr(static, "_fill", recording_fill)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
    assert [o.token_ids for o in outputs] == expected
    verified = {shape: runs for shape, runs in static.num_runs.items() if shape[1] > 1}
    assert verified, static.num_runs
    assert padded_steps, "no step mixed draft lengths"
    counters = speculator.counters
    assert counters.num_accepted_tokens > 0
    if wrong_every:
        assert counters.num_accepted_tokens < counters.num_draft_tokens


def test_n_samples_and_logprobs_with_drafts(tiny_model_dirs: dict[str, Path]) -> None:
    """n > 1 (copy-on-write blocks) and logprobs: the same as without drafts."""
    path = tiny_model_dirs["llama"]
    prompts, expected = _reference("llama", path)
    params = SamplingParams(max_tokens=MAX_TOKENS, n=3, logprobs=2)
    off = build_engine(str(path), device="cpu", dtype="float64", block_size=4, method="off")
    want = off.generate(prompts[:4], params, progress=False)
    engine = build_engine(str(path), device="cpu", dtype="float64", block_size=4, method="auto")
    speculator = _with_oracle(engine, {tuple(p): e for p, e in zip(prompts, expected)}, wrong_every=4)
    got = engine.generate(prompts[:4], params, progress=False)
    for a, b in zip(got, want):
        assert [s.token_ids for s in a.samples or []] == [s.token_ids for s in b.samples or []]
        assert a.token_logprobs is not None and b.token_logprobs is not None
        assert [t.token for t in a.token_logprobs] == [t.token for t in b.token_logprobs]
        assert [t.logprob for t in a.token_logprobs] == pytest.approx([t.logprob for t in b.token_logprobs])
    assert speculator.counters.num_accepted_tokens > 0


def test_seeded_sampling_is_the_same_with_and_without_drafts(tiny_model_dirs: dict[str, Path]) -> None:
    """Each kept token is drawn from the target at its own position with the row's own seed: drafts
    change how many tokens a step keeps, never which ones."""
    path = tiny_model_dirs["llama"]
    prompts, _ = _reference("llama", path)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, seed=100 + i)
              for i in range(len(prompts))]
    _assert_same_with_partly_wrong_drafts(path, prompts, params, wrong_every=3)


def _assert_same_with_partly_wrong_drafts(path: Path, prompts: list[list[int]],
                                          params: SamplingParams | list[SamplingParams], wrong_every: int) -> None:
    """Tokens with spec off, then with the oracle drafting them (every ``wrong_every``-th wrong): equal,
    with drafts both kept and rejected."""
    off = build_engine(str(path), device="cpu", dtype="float64", method="off")
    want = [o.token_ids for o in off.generate(prompts, params, progress=False)]
    engine = build_engine(str(path), device="cpu", dtype="float64", method="auto")
    speculator = _with_oracle(engine, {tuple(p): w for p, w in zip(prompts, want)}, wrong_every)
    assert [o.token_ids for o in engine.generate(prompts, params, progress=False)] == want
    assert 0 < speculator.counters.num_accepted_tokens < speculator.counters.num_draft_tokens


def _chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2), torch.tensor(statistic / 2)))


@torch.inference_mode()
def test_sampled_tokens_keep_the_target_distribution(tiny_model_dirs: dict[str, Path]) -> None:
    """Unseeded sampling, every request drafting the same [d2, d3] after its first token: among the
    requests whose first token was the likeliest one (a), the pairs of second and third tokens follow
    the model's exact p(t2 | a) p(t3 | a, t2) (chi-square), though the draft is often rejected."""
    path = tiny_model_dirs["llama"]
    prompt = random_prompts(VOCAB_SIZE, 1, seed=5, min_len=12, max_len=12)[0]
    temperature, top_k = 1.0, 4
    model = load_reference(path, torch.float64)

    def probs(token_ids: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([token_ids])).logits[0, -1] / temperature
        kept = logits.topk(top_k)
        return torch.zeros_like(logits).scatter(0, kept.indices, kept.values.softmax(-1))

    a = int(probs(prompt).argmax())
    second = probs(prompt + [a])
    exact = {(t2, t3): float(second[t2] * p3) for t2 in second.nonzero().flatten().tolist()
             for t3, p3 in enumerate(probs(prompt + [a, t2]).tolist()) if p3 > 0}
    d2 = int(second.argmax())
    d3 = int(probs(prompt + [a, d2]).argmax())
    engine = build_engine(str(path), device="cpu", dtype="float64", method="auto", max_num_seqs=64)
    speculator = _with_oracle(engine, {tuple(prompt): [a, d2, d3]}, wrong_every=0)
    torch.manual_seed(0)
    params = SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True)
    outputs = engine.generate([prompt] * 4000, params, progress=False)
    counts: dict[tuple[int, int], int] = {}
    for out in outputs:
        if out.token_ids[0] == a:
            pair = (out.token_ids[1], out.token_ids[2])
            counts[pair] = counts.get(pair, 0) + 1
    assert set(counts) <= set(exact)
    counters = speculator.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    num_samples = sum(counts.values())
    pairs = sorted(exact)
    observed = [counts.get(pair, 0) for pair in pairs]
    p_value = _chi_square_p_value(observed, [exact[pair] * num_samples for pair in pairs])
    assert p_value > 1e-3, (p_value, num_samples, list(zip(pairs, observed)))


def test_a_model_drafting_for_itself_is_accepted_fully(tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs["llama"]
    prompts, expected = _reference("llama", path)
    engine = build_engine(str(path), device="cpu", dtype="float64", method="draft", draft_model=str(path))
    speculator = engine.scheduler.speculator
    assert isinstance(speculator, DraftSpeculator)
    [draft] = [p for p in speculator.proposers if isinstance(p, DraftModelProposer)]  # after the grammar-forced one
    speculator.min_acceptance = 0.0
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
    assert [o.token_ids for o in outputs] == expected
    counters = speculator.counters
    assert counters.num_draft_tokens > 0 and counters.num_accepted_tokens == counters.num_draft_tokens
    assert draft.num_cached_requests == 0 and draft.num_used_blocks == 0  # every request's draft cache went with it


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.3), dict(frequency_penalty=0.8, presence_penalty=0.5),
    dict(temperature=0.9, seed=7, repetition_penalty=1.2, top_k=30),
], ids=["repetition", "frequency-presence", "seeded-sampled"])
def test_penalties_count_the_draft_tokens_before_each_row(params: dict[str, Any],
                                                          tiny_model_dirs: dict[str, Path]) -> None:
    """A penalized row after draft tokens counts them as generated: the tokens are those of plain decoding."""
    path = tiny_model_dirs["llama"]
    prompts, _ = _reference("llama", path)
    _assert_same_with_partly_wrong_drafts(path, prompts, SamplingParams(max_tokens=MAX_TOKENS, **params),
                                          wrong_every=4)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "count", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("wrong_every", [0, 2], ids=["grammar-forced", "oracle-every-second-wrong"])
def test_structured_output_with_drafts_is_the_same(wrong_every: int, tiny_model_dirs: dict[str, Path]) -> None:
    """JSON-schema output: the grammar forces the keys and punctuation (drafted and kept); drafts the
    grammar refuses are never kept; the JSON is token for token that of plain decoding."""
    from tokenmill.protocol.sampling import ResponseFormat

    path = tiny_model_dirs["llama"]
    prompts, _ = _reference("llama", path)
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    sampling = SamplingParams(max_tokens=64, response_format=fmt)
    off = build_engine(str(path), device="cpu", dtype="float64", method="off")
    want = off.generate(prompts[:6], sampling, progress=False)
    assert all(o.text.startswith('{"name": "') for o in want), [o.text for o in want]  # the grammar held
    engine = build_engine(str(path), device="cpu", dtype="float64", method="auto")
    if wrong_every:
        speculator = _with_oracle(engine, {tuple(p): w.token_ids for p, w in zip(prompts, want)}, wrong_every)
    else:
        speculator = engine.scheduler.speculator
        assert isinstance(speculator, DraftSpeculator)
    got = engine.generate(prompts[:6], sampling, progress=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert speculator.counters.num_accepted_tokens > 0
