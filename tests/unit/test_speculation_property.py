"""Property test: speculative decoding changes no output, whatever the engine's knobs.

Random small pools, token budgets, chunk sizes, block sizes, seat counts, preemption modes, priority lanes,
the starvation limit, prefix caching, the length predictor's budget and ordering, draft depths, and request
parameters (n, stop strings, stop ids, min_tokens, logprobs, max_tokens) over the echo model: greedy output with
``method = "auto"`` is the output with ``off``, token for token (text, ids, logprobs, finish reasons, samples),
and every block comes back.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.engine import Engine, EngineConfig
from tokenmill.protocol.sampling import SamplingParams

WORDS = ["ab", "abc", "the cat ", "sat ", "on ", "mat", "0123", "stop", "!", " "]


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_batched_tokens = draw(st.integers(4, 48))
    sections = {
        "model": {"name": "echo", "max_model_len": 96},
        "cache": {"block_size": block_size, "kv_cache_memory": draw(st.integers(96, 400)),
                  "swap_space": draw(st.sampled_from([0, 64, 4096])),
                  "enable_prefix_caching": draw(st.booleans())},
        "scheduler": {"max_num_batched_tokens": max_num_batched_tokens,
                      "max_prefill_chunk": draw(st.integers(1, max_num_batched_tokens)),
                      "max_num_seqs": draw(st.integers(1, 6)),
                      "preemption_mode": draw(st.sampled_from(["swap", "recompute"])),
                      "demote_after_decode_steps": draw(st.integers(0, 4))},
        "length": {"budget_kv": draw(st.booleans()),
                   "ordering": draw(st.sampled_from(["fcfs", "shortest", "longest"])),
                   "min_samples": draw(st.integers(1, 3))},
    }
    prompts = [draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map("".join))
               for _ in range(draw(st.integers(1, 6)))]
    max_tokens = draw(st.integers(1, 40))
    params = {
        "max_tokens": max_tokens,
        "n": draw(st.integers(1, 3)),
        "ignore_eos": draw(st.booleans()),
        "min_tokens": draw(st.integers(0, min(5, max_tokens))),
        "stop": draw(st.lists(st.sampled_from(["cat", "0", "t s", "ab"]), max_size=2)),
        "stop_token_ids": draw(st.lists(st.sampled_from([ord("!"), ord("m")]), max_size=1)),
        "logprobs": draw(st.sampled_from([None, 1])),
    }
    return {"sections": sections, "prompts": prompts, "params": params,
            "num_speculative_tokens": draw(st.integers(1, 8)), "priorities": draw(st.booleans())}


def _run(case: dict[str, Any], method: str) -> tuple[list[tuple[Any, ...]], Engine]:
    speculative = {"method": method, "num_speculative_tokens": case["num_speculative_tokens"], "min_acceptance": 0.0}
    engine = Engine.from_config(EngineConfig.model_validate({**case["sections"], "speculative": speculative}))
    params = SamplingParams(**case["params"])
    prompts = case["prompts"]
    priorities = [i % 3 for i in range(len(prompts))] if case["priorities"] else None
    outputs = engine.generate(prompts, params, progress=False, priorities=priorities)
    return [(o.finish_reason, o.error, o.text, o.token_ids, o.token_logprobs,
             [(s.finish_reason, s.text, s.token_ids) for s in o.samples or []]) for o in outputs], engine


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_greedy_output_is_the_same_with_and_without_speculation(case: dict[str, Any]) -> None:
    off, _ = _run(case, "off")
    on, engine = _run(case, "auto")
    assert on == off
    stats = engine.stats()
    assert stats.num_used_gpu_blocks == 0 and stats.num_used_cpu_blocks == 0 and not engine.has_unfinished()
