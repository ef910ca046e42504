"""Issue 13 through the real engine on the tiny models (float64): greedy with a repetition penalty
equals Hugging Face ``generate(repetition_penalty=...)`` token for token, under chunking and
preemption too; structured output and penalties survive preemption (swap and recompute) unchanged;
OpenAI-shaped logprobs; an invalid schema is a ``validation`` error output, never a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.parity_helpers import hf_greedy, load_reference, random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import FAMILIES, VOCAB_SIZE
from tokenmill.engine import Engine
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

MAX_TOKENS = 20
PENALTY = 1.3
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["mood", "n", "ok"],
          "properties": {"mood": {"enum": ["happy", "sad", "neutral"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}}}
# A pool that holds the largest request but not all of them (48 tokens for gpt2, 96 for llama): preemption.
# NOTE: no predicted-KV budget: admitting whatever fits is what makes the small pool preempt.
PREEMPTING = dict(block_size=4, max_prefill_chunk=9, max_num_batched_tokens=64, kv_cache_memory="96KiB",
                  swap_space="8MiB", budget_kv=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_repetition_penalty_matches_hf_generate(family: str, tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs[family]
    prompts = random_prompts(VOCAB_SIZE, 6, seed=13, max_len=24)
    reference = load_reference(path, torch.float64)
    expected = [hf_greedy(reference, p, MAX_TOKENS, repetition_penalty=PENALTY) for p in prompts]
    assert expected != [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]  # the penalty changes something
    for mode in ("swap", "recompute"):
        engine = build_engine(str(path), device="cpu", dtype="float64", preemption_mode=mode, **PREEMPTING)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=PENALTY),
                                  progress=False)
        assert [o.token_ids for o in outputs] == expected, f"{family}/{mode}"
        assert engine.stats().counters.num_preemptions > 0


def _mixed_batch() -> tuple[list[str], list[SamplingParams]]:
    structured = {"type": "json_schema", "json_schema": {"name": "m", "schema": SCHEMA}}
    params = [SamplingParams(max_tokens=40, response_format=structured),
              SamplingParams(max_tokens=40, temperature=0.9, seed=5, response_format=structured),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, presence_penalty=1.0, frequency_penalty=0.5),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=30, response_format={"type": "regex", "regex": "(yes|no), [0-9]{2,4}"})]
    prompts = ["The quick brown fox", "Write a haiku about the sea.", "Paged attention stores keys",
               "Redis streams deliver", "What is the capital of France?"]
    return prompts * 2, params * 2


def _run(engine: Engine) -> list[Any]:
    prompts, params = _mixed_batch()
    return engine.generate(prompts, params, progress=False)


@pytest.fixture(scope="module")
def unpreempted(tiny_model_dirs: dict[str, Path]) -> list[Any]:
    return _run(build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float64", kv_cache_memory="8MiB"))


def test_structured_output_parses_and_logprobs_have_openai_shape(unpreempted: list[Any]) -> None:
    for out in unpreempted[0:2] + unpreempted[5:7]:
        value = json.loads(out.text)
        assert out.finish_reason == "stop" and value["mood"] in ("happy", "sad", "neutral")
        assert isinstance(value["n"], int) and isinstance(value["ok"], bool)
    assert all(out.text.split(", ")[0] in ("yes", "no") for out in (unpreempted[4], unpreempted[9]))
    scored = unpreempted[3]
    assert len(scored.token_logprobs) == len(scored.token_ids) == MAX_TOKENS
    for token_id, entry in zip(scored.token_ids, scored.token_logprobs):
        assert entry.token_id == token_id and len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    assert unpreempted[0].token_logprobs is None


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_grammar_and_penalty_state_survive_preemption(mode: str, unpreempted: list[Any],
                                                      tiny_model_dirs: dict[str, Path]) -> None:
    engine = build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float64", preemption_mode=mode,
                          **PREEMPTING)
    outputs = _run(engine)
    assert engine.stats().counters.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in unpreempted]
    table = engine.runner.sampler.processors._penalty_table  # type: ignore[attr-defined]
    assert table is not None and table.num_used_slots == 0  # every finished request gave its row back


def test_invalid_schema_is_a_validation_error_output(tiny_model_dirs: dict[str, Path]) -> None:
    engine = build_engine(str(tiny_model_dirs["gpt2"]), device="cpu", dtype="float64", kv_cache_memory="4MiB")
    bad = SamplingParams(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                 "schema": {"type": "strng"}}})
    good = SamplingParams(max_tokens=4)
    outputs = engine.generate(["The quick brown fox"] * 2, [bad, good], progress=False)
    assert outputs[0].finish_reason == "error" and 'Unsupported type "strng"' in (outputs[0].error or "")
    assert outputs[1].finish_reason in ("stop", "length") and outputs[1].token_ids
