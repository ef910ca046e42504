"""Property test: random workloads on tiny pools, both preemption modes, every policy knob (the length
predictor's budget and orderings included).

After every step the pools balance and budgets hold (step_until_done checks); every request
finishes within a bounded number of steps with exactly the tokens of an unconstrained run.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.scheduler_helpers import (
    ScriptedModelRunner,
    assert_no_leaks,
    make_request,
    make_scheduler,
    reference_outputs,
    step_until_done,
)
from tokenmill.engine.config import LengthConfig
from tokenmill.engine.core.request import Request

EOS_TOKEN_ID = 0


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_requests = draw(st.integers(1, 7))
    max_num_seqs = draw(st.integers(1, 4))
    specs = [
        (draw(st.integers(1, 12)), draw(st.integers(1, 8)), draw(st.integers(0, 3)), draw(st.integers(0, 12)),
         draw(st.integers(0, 2)), draw(st.integers(1, max_num_seqs)))
        for _ in range(num_requests)
    ]  # (prompt tokens, max_tokens, priority, arrival step, shared prefix, samples)
    largest = max(-(-(prompt + out) // block_size) for prompt, out, *_ in specs)
    max_num_batched_tokens = draw(st.integers(1, 16))
    return {
        "specs": specs,
        "num_gpu_blocks": largest + draw(st.integers(0, 4)),
        "num_cpu_blocks": draw(st.integers(0, 8)),
        "block_size": block_size,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_prefill_chunk": draw(st.integers(1, max_num_batched_tokens)),
        "max_prefill_tokens": draw(st.one_of(st.none(), st.integers(1, max_num_batched_tokens))),
        "max_num_seqs": max_num_seqs,
        "prefix_caching": draw(st.booleans()),
        "preemption_mode": draw(st.sampled_from(["swap", "recompute"])),
        "enable_priority_preemption": draw(st.booleans()),
        "aging_interval_s": draw(st.sampled_from([0.0, 1.0, 3.0])),
        "demote_after_decode_steps": draw(st.integers(0, 3)),
        "min_resident_steps": draw(st.integers(0, 3)),
        "watermark_blocks": draw(st.integers(0, 1)),
        "use_eos": draw(st.booleans()),
        "length": draw(st.one_of(st.none(), st.builds(
            LengthConfig, budget_kv=st.booleans(), ordering=st.sampled_from(["fcfs", "shortest", "longest", "auto"]),
            min_samples=st.integers(1, 3), tail_quantile=st.sampled_from([0.6, 0.9, 0.99])))),
    }


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_unconstrained_outputs(workload: dict[str, Any]) -> None:
    config = dict(workload)
    specs: list[tuple[int, int, int, int, int, int]] = config.pop("specs")
    eos_token_id = EOS_TOKEN_ID if config.pop("use_eos") else None
    scheduler = make_scheduler(**config, eos_token_id=eos_token_id)
    arrivals: dict[int, list[Request]] = {}
    for i, (num_prompt_tokens, max_tokens, priority, arrival_step, prefix, n) in enumerate(specs):
        # NOTE: prompts of one prefix group share their first tokens, so prefix-cache hits happen.
        prompt = [(prefix * 31 + 5 * j) % 97 + 1 if j < 6 else (i * 13 + j) % 97 + 1 for j in range(num_prompt_tokens)]
        request = make_request(f"r{i}", max_tokens=max_tokens, priority=priority, arrival_time_s=float(arrival_step),
                               prompt_token_ids=prompt, n=n, seed=i * 100 if n > 1 else None)
        arrivals.setdefault(arrival_step, []).append(request)
    requests = [r for step in sorted(arrivals) for r in arrivals[step]]
    run = step_until_done(
        scheduler, ScriptedModelRunner(scheduler.block_manager, vocab_size=20),
        arrivals=arrivals, max_steps=3000, advance_s=1.0,
    )
    assert run.outputs == reference_outputs(requests, eos_token_id, vocab_size=20)
    assert_no_leaks(scheduler)


def test_seeded_random_workload_checks_invariants_every_step() -> None:
    """A fixed-seed larger workload: a seeded random workload checked against the invariants every step."""
    rng = random.Random(1234)
    for mode in ("swap", "recompute"):
        scheduler = make_scheduler(
            num_gpu_blocks=12, num_cpu_blocks=6, block_size=4, max_num_batched_tokens=16,
            max_prefill_chunk=6, max_num_seqs=5, preemption_mode=mode, aging_interval_s=2.0,
            demote_after_decode_steps=4, min_resident_steps=2,
        )
        arrivals: dict[int, list[Request]] = {}
        for i in range(40):
            step = rng.randrange(60)
            arrivals.setdefault(step, []).append(make_request(
                f"{mode}-{i}", rng.randint(1, 20), rng.randint(1, 20), rng.randint(0, 4), float(step)))
        requests = [r for step in sorted(arrivals) for r in arrivals[step]]
        run = step_until_done(scheduler, arrivals=arrivals, max_steps=5000, advance_s=1.0)
        assert run.outputs == reference_outputs(requests)
        assert scheduler.stats().counters.num_preemptions > 0
        assert_no_leaks(scheduler)
