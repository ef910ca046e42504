"""Speculative decoding without a model: which verified tokens a request keeps, the
draftless proposers, the goodput rule that sizes drafts by step cost, and the real scheduler over
the echo model: drafts inside the token budget, KV reserved and given back, nothing unverified in
the prefix cache, stop rules token by token, and the same output as without speculation."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.unit.draft_helpers import draft_lengths
from tests.unit.scheduler_helpers import make_request
from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.config import SpeculativeConfig
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.speculation import DraftRoom
from tokenmill.engine.core.stats import SpeculationCounters
from tokenmill.engine.core.step_io import ModelOutput, SchedulerOutput
from tokenmill.engine.spec.draft_length import (
    PROBE_EVERY_STEPS,
    PROBE_TOKENS,
    Acceptance,
    StepCost,
    drafting_pays,
)
from tokenmill.engine.spec.ngram import LazyNgramIndex, NgramIndex
from tokenmill.engine.spec.speculator import DraftSpeculator, build_speculator, draft_state
from tokenmill.engine.spec.suffix_pool import SuffixPool
from tokenmill.engine.spec.verification import accept_drafts
from tokenmill.protocol.outcomes import FinishReason
from tokenmill.protocol.sampling import SamplingParams

# ------------------------------------------------------------------------------ verification


def test_a_request_keeps_the_rows_up_to_the_first_that_is_not_the_draft() -> None:
    assert accept_drafts([5, 6, 7], [5, 6, 7, 8]) == 4  # every draft token, then the bonus
    assert accept_drafts([5, 6, 7], [5, 9, 7, 8]) == 2  # d1 kept, then the model's own token
    assert accept_drafts([5, 6, 7], [4, 6, 7, 8]) == 1  # only the model's own token
    assert accept_drafts([], [3]) == 1
    with pytest.raises(ValueError, match="sampled rows"):
        accept_drafts([5, 6], [5, 6])


# ------------------------------------------------------------------------------ proposers


def test_ngram_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    index = NgramIndex(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    # [1, 2, 3] occurred at 0..2 (followed by 4, 5); [2, 3] later at 6..7 (followed by 7) but the
    # longest suffix wins.
    assert index.propose(tokens, 2) == [4, 5]
    assert index.propose(tokens + [4], 3) == [5, 9, 2]  # grown incrementally: [2, 3, 4] -> 5, 9, 2
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 4) == []  # no repeated n-gram
    assert NgramIndex(2, 3).propose([7, 7, 7, 7], 2) == [7]  # the continuation stops at the end
    assert NgramIndex(1, 2).propose([1, 2], 0) == []
    # The index the speculator runs, over the request's prompt and output lists (tests/unit/test_spec_fast_paths.py
    # holds it to the plain one's drafts in general).
    lazy = LazyNgramIndex(min_n=2, max_n=3)
    output = [9, 2, 3, 7, 1, 2, 3]
    assert lazy.propose([1, 2, 3, 4, 5], output, 2) == [4, 5]
    output.append(4)
    assert lazy.propose([1, 2, 3, 4, 5], output, 3) == [5, 9, 2]
    assert lazy.propose([1, 2, 3, 4, 5], output, 3, min_n=4) == []  # a tier asking for longer matches only
    with pytest.raises(ValueError, match="min_n"):
        LazyNgramIndex(min_n=0, max_n=3)



def test_a_short_requests_search_matches_whole_tokens_only() -> None:
    """A short request's lookups search its tokens' bytes: a byte match across two tokens is no occurrence."""
    first, second = 0x04030201, 0x08070605  # bytes 01 02 03 04 | 05 06 07 08 (4-byte ids, little-endian)
    across = 0x06050403  # bytes 03 04 05 06: in the two above, straddling them
    for scan_tokens in (0, 100):  # indexed, searched
        lazy = LazyNgramIndex(min_n=1, max_n=2, scan_tokens=scan_tokens)
        assert lazy.propose([first, second], [across], 2) == []
        assert lazy.propose([first, second], [across, first], 2) == [second, across]  # a whole token's match
        assert NgramIndex(1, 2).propose([first, second, across, first], 2) == [second, across]

def test_the_suffix_pool_drafts_from_earlier_outputs_and_forgets_the_oldest() -> None:
    pool = SuffixPool(min_n=2, max_n=3, continuation_len=4, capacity=1000)
    pool.add(prompt_token_ids=[100, 101], output_token_ids=[10, 11, 12, 13, 14, 15])
    assert pool.propose([50, 10, 11], 3) == [12, 13, 14]
    assert pool.propose([101, 10], 2) == [11, 12]  # the prompt's tail leads into the output
    assert pool.propose([50, 51], 3) == []
    small = SuffixPool(min_n=2, max_n=2, continuation_len=2, capacity=3)
    small.add([0], [1, 2, 3, 4, 5, 6])
    assert len(small) == 3 and small.propose([5, 6], 2) == [] and small.propose([4, 5], 2) == [6]
    assert small.propose([1, 2], 2) == []  # forgotten


# ------------------------------------------------------------------------------ the goodput rule


def test_the_step_cost_model_fits_a_line() -> None:
    cost = StepCost()
    for tokens in [1, 64, 8, 300, 2, 512, 33] * 5:
        cost.observe(tokens, 0.020 + 0.0005 * tokens, "flat", drafted=tokens > 8)
    assert cost.fixed_s == pytest.approx(0.020, rel=1e-3)
    assert cost.per_token_s == pytest.approx(0.0005, rel=1e-3)


def test_each_way_a_step_runs_has_its_own_cost_line() -> None:
    """Captured steps (``static``) cost a tenth of eager ones (``flat``) here: each fits its own line, one line over
    both would price neither. Draft tokens are charged on the line of the way drafted steps run."""
    cost = StepCost()
    for tokens in [1, 2, 4, 8, 16, 32] * 5:
        cost.observe(tokens, 0.002 + 0.0001 * tokens, "static", drafted=False)
    assert (cost.fixed_s, cost.plain_path, cost.drafted_path) == (pytest.approx(0.002, rel=1e-3), "static", None)
    assert not cost.switches_path
    for tokens in [8, 24, 40, 72, 136] * 5:
        cost.observe(tokens, 0.020 + 0.0005 * tokens, "flat", drafted=True)
    assert cost.switches_path and cost.drafted_path == "flat"
    assert cost.fixed_s == pytest.approx(0.020, rel=1e-3) and cost.per_token_s == pytest.approx(0.0005, rel=1e-3)
    assert cost.plain_seconds(8) == pytest.approx(0.002 + 0.0008, rel=1e-3)
    assert cost.lines["static"].per_token_s == pytest.approx(0.0001, rel=1e-3)


def test_drafts_that_move_a_step_off_its_cheaper_path_must_pay_for_the_move() -> None:
    """Plain steps replay graphs at 2.8 ms for 8 requests; with drafts the step runs eagerly at 20 ms + 0.5 ms a
    token: 3 drafts each at 50% acceptance almost double the tokens, not the 10x time. On one path, they pay."""
    switching = StepCost()
    for tokens in [1, 2, 4, 8, 16] * 5:
        switching.observe(tokens, 0.002 + 0.0001 * tokens, "static", drafted=False)
    for tokens in [8, 24, 40, 72] * 5:
        switching.observe(tokens, 0.020 + 0.0005 * tokens, "flat", drafted=True)
    lengths = {f"r{i}": 3 for i in range(8)}
    rates = {f"r{i}": 0.5 for i in range(8)}
    assert not drafting_pays(lengths, rates, num_scheduled_tokens=8, num_decodes=8, cost=switching)
    one_way = StepCost()
    for tokens in [1, 2, 4, 8, 16, 24, 40] * 5:
        one_way.observe(tokens, 0.002 + 0.0001 * tokens, "static", drafted=tokens > 16)
    assert drafting_pays(lengths, rates, num_scheduled_tokens=8, num_decodes=8, cost=one_way)
    # on a cheap eager path the move pays: 15 expected tokens in 4.1 ms against 8 in 2.8 ms
    cheap = StepCost()
    for tokens in [1, 2, 4, 8, 16] * 5:
        cheap.observe(tokens, 0.002 + 0.0001 * tokens, "static", drafted=False)
    for tokens in [8, 24, 40, 72] * 5:
        cheap.observe(tokens, 0.0025 + 0.00005 * tokens, "flat", drafted=True)
    assert drafting_pays(lengths, rates, num_scheduled_tokens=8, num_decodes=8, cost=cheap)

    class Oracle:
        name = "oracle"

        def propose(self, wanted: list[tuple[Request, list[int], int]]) -> dict[str, list[int]]:
            return {request.request_id: [1, 2, 3] for request, _, _ in wanted}

        def finished(self, request: Request) -> None:
            pass

    speculator = DraftSpeculator([Oracle()], num_speculative_tokens=3, min_acceptance=0.0)
    speculator.cost = switching
    requests = [(make_request(f"r{i}"), 3) for i in range(8)]
    room = DraftRoom(num_tokens_left=4096, num_scheduled_tokens=8, num_decodes=8)
    assert speculator.draft(requests, room) == {}
    speculator.cost = cheap
    drafts = speculator.draft(requests, room)
    assert set(drafts) == {f"r{i}" for i in range(8)} and all(drafts.values())


def test_acceptance_counts_recent_drafts() -> None:
    acceptance = Acceptance()
    assert acceptance.rate == 0.5
    for _ in range(10):
        acceptance.observe(num_drafted=4, num_accepted=4, step=1)
    assert acceptance.rate > 0.95
    for _ in range(20):
        acceptance.observe(num_drafted=4, num_accepted=0, step=2)
    assert acceptance.rate < 0.1


def _cost(fixed_s: float, per_token_s: float) -> StepCost:
    cost = StepCost()
    cost.fixed_s, cost.per_token_s = fixed_s, per_token_s
    return cost


def test_the_cost_of_a_step_not_acceptance_decides_how_deep_to_draft() -> None:
    """The same 80% acceptance: a weight-bound small batch drafts every proposed token; a compute-bound
    batch of 64 drafts only the first positions of a few; free drafting drafts everything."""
    cpu = _cost(fixed_s=0.030, per_token_s=0.0008)
    one = draft_lengths([("a", 6, 0.8)], 4096, num_scheduled_tokens=1, num_decodes=1, cost=cpu)
    assert one == {"a": 6}
    batch = [(f"r{i}", 6, 0.8) for i in range(64)]
    large = draft_lengths(batch, 4096, num_scheduled_tokens=64, num_decodes=64, cost=cpu)
    assert max(large.values()) == 1  # only the first position pays
    huge = [(f"r{i}", 6, 0.6) for i in range(256)]
    assert draft_lengths(huge, 4096, num_scheduled_tokens=256, num_decodes=256, cost=cpu) == {}
    assert draft_lengths(batch, 4096, 64, 64, _cost(0.030, 0.0)) == {f"r{i}": 6 for i in range(64)}
    # Better acceptance is drafted first; the budget bounds the total.
    mixed = draft_lengths([("low", 6, 0.3), ("high", 6, 0.95)], 3, 2, 2, cpu)
    assert mixed == {"high": 3}


# ------------------------------------------------------------------------------ the echo engine


def _echo(method: str = "auto", **sections: Any) -> Engine:
    return Engine.from_config(EngineConfig.model_validate(
        {"model": {"name": "echo"}, "speculative": {"method": method}, **sections}))


PROMPTS = ["the cat sat on the mat and the cat sat on the hat", "abcabcabcabcabcabc",
           "no repeats here: 0123456789", "say stop here and stop there, stop!"]


def _generate(engine: Engine, prompts: list[str], **params: Any) -> list[tuple[Any, ...]]:
    outputs = engine.generate(prompts, SamplingParams(**params), progress=False)
    return [(o.finish_reason, o.text, o.token_ids, o.token_logprobs,
             [(s.text, s.token_ids) for s in o.samples or []]) for o in outputs]


@pytest.mark.parametrize("params", [
    dict(max_tokens=64),
    dict(max_tokens=40, ignore_eos=True),
    dict(max_tokens=100, min_tokens=60),
    dict(max_tokens=64, stop=["stop", "hat"]),
    dict(max_tokens=64, stop_token_ids=[ord("9"), ord("!")]),
    dict(max_tokens=7),
    dict(max_tokens=30, ignore_eos=True, logprobs=1),
    dict(max_tokens=30, n=3, ignore_eos=True),
], ids=["eos", "ignore_eos", "min_tokens", "stop_strings", "stop_ids", "max_tokens", "logprobs", "n3"])
@pytest.mark.parametrize("ngram_index", ["auto", "python"])
def test_echo_output_is_the_same_with_and_without_speculation(params: dict[str, Any], ngram_index: str) -> None:
    """With the C++ n-gram index (auto) and the Python one (its reference)."""
    off = _generate(_echo("off"), PROMPTS, **params)
    engine = Engine.from_config(EngineConfig.model_validate(
        {"model": {"name": "echo"}, "speculative": {"method": "auto", "ngram_index": ngram_index}}))
    on = _generate(engine, PROMPTS, **params)
    assert on == off
    stats = engine.stats()
    assert stats.speculation.num_accepted_tokens > 0, stats.speculation  # drafts ran and were kept
    assert stats.num_used_gpu_blocks == 0 and not engine.has_unfinished()


def test_nothing_past_a_stop_string_is_emitted_from_a_verified_draft() -> None:
    engine = _echo("auto")
    prompt = "repeat: abcdefgh abcdefgh abcdefgh"
    [(reason, text, token_ids, _, _)] = _generate(engine, [prompt], max_tokens=64, stop=["fgh abc"])
    assert reason is FinishReason.STOP and text == "repeat: abcde"
    assert bytes(token_ids).decode() == "repeat: abcdefgh abc"  # ends at the token that completed the stop
    assert engine.stats().speculation.num_accepted_tokens > 0


def test_requests_that_opt_out_never_draft() -> None:
    engine = _echo("auto")
    assert _generate(engine, PROMPTS, max_tokens=40, speculative=False) == _generate(_echo("off"), PROMPTS,
                                                                                     max_tokens=40)
    assert engine.stats().speculation.num_drafts == 0


class _Recorder:
    """Wraps a runner: checks each step against the budget and the KV invariants as it runs."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.runner = engine, engine.runner
        self.max_batched_tokens = 0
        self.num_draft_chunks = 0

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        scheduler = self.engine.scheduler
        assert plan.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        self.max_batched_tokens = max(self.max_batched_tokens, plan.num_batched_tokens)
        self.num_draft_chunks += sum(1 for c in plan.chunks if c.num_draft_tokens)
        for chunk in plan.chunks:  # the slots of every draft token are reserved
            end = chunk.start_position + chunk.num_tokens
            assert len(chunk.block_ids) * scheduler.block_manager.block_size >= end
        scheduler.check_invariants()
        return self.runner.execute(plan)


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
def test_drafts_fit_the_budget_and_the_blocks_through_preemption(preemption_mode: str) -> None:
    """A tight budget and a small KV pool: drafts are cut to fit, preemption happens with drafts in
    flight, and the output is still the same as without speculation."""
    sections = {"scheduler": {"max_num_batched_tokens": 24, "max_prefill_chunk": 8, "max_num_seqs": 6,
                              "preemption_mode": preemption_mode},
                "cache": {"block_size": 4, "kv_cache_memory": 160, "swap_space": 4096},
                "model": {"name": "echo", "max_model_len": 128}, "length": {"budget_kv": False}}
    prompts = [p * 2 for p in PROMPTS] + ["xyzxyzxyzxyz" * 3, "hello hello hello hello"]
    off = _generate(_echo("off", **sections), prompts, max_tokens=60, ignore_eos=True)
    engine = _echo("auto", **sections)
    recorder = _Recorder(engine)
    engine.runner = recorder
    on = _generate(engine, prompts, max_tokens=60, ignore_eos=True)
    assert on == off
    stats = engine.stats()
    assert stats.counters.num_preemptions > 0 and recorder.num_draft_chunks > 0
    assert recorder.max_batched_tokens == 24  # drafts filled the budget, never past it
    assert stats.num_used_gpu_blocks == 0 and stats.num_used_cpu_blocks == 0


class _WrongDrafts:
    """A proposer whose drafts are always wrong (token 200 is in no prompt here)."""

    name = "wrong"

    def propose(self, wanted: list[tuple[Request, list[int], int]]) -> dict[str, list[int]]:
        return {request.request_id: [200] * num_tokens for request, _, num_tokens in wanted}

    def finished(self, request: Request) -> None:
        pass


def test_rejected_drafts_give_their_blocks_back_and_never_reach_the_prefix_cache() -> None:
    sections = {"cache": {"block_size": 2}, "speculative": {"method": "auto", "min_acceptance": 0.0}}
    engine = Engine.from_config(EngineConfig.model_validate({"model": {"name": "echo"}, **sections}))
    speculator = engine.scheduler.speculator
    assert isinstance(speculator, DraftSpeculator)
    speculator.proposers = [_WrongDrafts()]
    off = _generate(_echo("off", cache={"block_size": 2}), PROMPTS, max_tokens=50, ignore_eos=True)
    assert _generate(engine, PROMPTS, max_tokens=50, ignore_eos=True) == off
    assert speculator.counters.num_draft_tokens > 0 and speculator.counters.num_accepted_tokens == 0
    prefix_cache = engine.scheduler.prefix_cache
    assert prefix_cache is not None and prefix_cache.num_cached_blocks > 0
    cached_tokens = {t for key in prefix_cache._key_to_entry for t in key[1]}
    assert 200 not in cached_tokens
    assert engine.stats().num_used_gpu_blocks == 0
    # What the cache kept is right: the same prompts again hit it and still echo the same.
    assert _generate(engine, PROMPTS, max_tokens=50, ignore_eos=True) == off
    assert engine.stats().prefix.num_hit_tokens > 0


def test_speculation_stats_count_drafts_by_position_and_length() -> None:
    engine = _echo("auto")
    _generate(engine, ["abcdefgh" * 8], max_tokens=60, ignore_eos=True)
    spec = engine.stats().speculation
    assert spec.num_drafts > 0 and spec.num_accepted_tokens == spec.num_draft_tokens  # echo drafts are right
    assert spec.acceptance_rate == 1.0 and spec.mean_accepted_length > 1
    assert spec.acceptance_by_position()[0] == 1.0
    assert sum(spec.draft_length_counts.values()) >= spec.num_drafts
    assert spec.drafted_by_position[0] == spec.num_drafts


class _Broken:
    name = "broken"

    def propose(self, wanted: list[tuple[Request, list[int], int]]) -> dict[str, list[int]]:
        raise RuntimeError("a proposer bug")

    def finished(self, request: Request) -> None:
        pass


def test_a_failing_speculator_costs_the_drafts_not_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    """Drafts only speed decoding up: a proposer that raises leaves the step without drafts, logged."""
    engine = _echo("auto")
    speculator = engine.scheduler.speculator
    assert isinstance(speculator, DraftSpeculator)
    speculator.proposers = [_Broken()]
    with caplog.at_level("WARNING", logger="tokenmill.engine.core.scheduler"):
        assert _generate(engine, PROMPTS, max_tokens=30) == _generate(_echo("off"), PROMPTS, max_tokens=30)
    assert any("the speculator failed" in r.getMessage() for r in caplog.records)


def test_a_fresh_speculator_drafts_before_any_step_was_timed() -> None:
    """No decode step measured yet (the cost model is empty): drafting is taken as free, not divided by zero."""
    assert draft_lengths([("a", 3, 0.5)], 100, 1, 1, StepCost()) == {"a": 3}


def test_a_first_draft_token_pays_for_its_proposing_out_of_the_steps_wall_time() -> None:
    """4 decodes, a 1.04 ms forward and 4 ms of host time per step. Proposing at 0.2 ms a request: three 0.9 drafts
    still pay, and lift the step's goodput to where a 0.3 draft's first token no longer buys its 0.21 ms; at 2 ms a
    request no draft pays. Until the host time is known, proposing is taken as free; known, with free proposing,
    it makes a draft token cheaper than the forward alone says."""
    proposals = [("a", 4, 0.9), ("b", 4, 0.9), ("c", 4, 0.9), ("weak", 4, 0.3)]
    cost = _cost(fixed_s=0.001, per_token_s=0.00001)
    assert draft_lengths(proposals, 4096, 4, 4, cost) == {"a": 4, "b": 4, "c": 4, "weak": 1}
    cost.proposal_s = 0.0002
    assert draft_lengths(proposals, 4096, 4, 4, cost) == {"a": 4, "b": 4, "c": 4, "weak": 1}
    cost.host_s = 0.004
    assert draft_lengths(proposals, 4096, 4, 4, cost) == {"a": 4, "b": 4, "c": 4}
    cost.proposal_s = 0.002
    assert draft_lengths(proposals, 4096, 4, 4, cost) == {}
    cost.proposal_s = 0.0
    assert draft_lengths(proposals, 4096, 4, 4, cost) == {"a": 4, "b": 4, "c": 4, "weak": 3}


def test_requests_the_goodput_rule_could_not_draft_for_are_not_proposed_for() -> None:
    """A compute-bound step (every token costs what the step makes per token): no draft token can pay, and the
    proposers are not run at all; the requests are counted as drafting nothing, and proposing is not timed."""
    asked: list[str] = []

    class Recording:
        name = "recording"

        def propose(self, wanted: list[tuple[Request, list[int], int]]) -> dict[str, list[int]]:
            asked.extend(request.request_id for request, _, _ in wanted)
            return {request.request_id: [1, 2] for request, _, _ in wanted}

        def finished(self, request: Request) -> None:
            pass

    speculator = DraftSpeculator([Recording()], num_speculative_tokens=4, min_acceptance=0.0)
    requests = [(make_request(f"r{i}"), 4) for i in range(8)]
    room = DraftRoom(num_tokens_left=4096, num_scheduled_tokens=8, num_decodes=8)
    speculator.cost.fixed_s, speculator.cost.per_token_s = 1e-6, 0.001
    assert speculator.cost.draft_threshold(8, 8) > 0.99
    assert speculator.draft(requests, room) == {} and asked == []
    assert speculator.counters.draft_length_counts == {0: 8}
    assert speculator.cost.proposal_s == 0.0
    speculator.cost.fixed_s = 0.1  # weight-bound: drafting pays again
    assert speculator.draft(requests, room) == {f"r{i}": [1, 2] for i in range(8)}
    assert asked == [f"r{i}" for i in range(8)]


def test_the_engines_host_time_per_step_is_measured_between_two_steps() -> None:
    """From one step's forward to the next, with one draft call between: that step's wall time; less its forward,
    the host's. A gap with no draft call, or two, is not one step, and is left out."""
    speculator = build_speculator(SpeculativeConfig(method="ngram"))
    assert speculator is not None
    room = DraftRoom(num_tokens_left=4096, num_scheduled_tokens=1, num_decodes=1)
    speculator.observe_step(1, 0.001, "flat", drafted=False)
    time.sleep(0.02)
    speculator.draft([(make_request("r", prompt_token_ids=[1, 2, 1]), 4)], room)
    speculator.observe_step(2, 0.005, "flat", drafted=True)
    assert speculator.cost.host_s >= 0.015
    speculator.observe_step(1, 0.001, "flat", drafted=False)  # no draft call between
    speculator.draft([], room)
    speculator.draft([], room)
    speculator.observe_step(1, 0.001, "flat", drafted=False)  # two
    assert len(speculator.cost._host) == 1


def test_the_proposers_cost_is_a_median_one_slow_step_does_not_set_it() -> None:
    """The step that first indexes a batch of prompts costs many times a steady one: a median over recent steps,
    and none until a few were seen, keeps it from standing for the proposers' cost."""
    cost = StepCost()
    cost.observe_proposals(4, 0.004)  # 1 ms a request: new prompts indexed
    cost.observe_proposals(256, 0.000512)
    assert cost.proposal_s == 0.0
    cost.observe_proposals(256, 0.000512)
    assert cost.proposal_s == pytest.approx(2e-6)
    cost.observe_proposals(0, 0.001)  # nobody asked: nothing to learn
    assert len(cost._proposals) == 3


# ------------------------------------------------------------------------------ lookup tiers


_ROOM = DraftRoom(num_tokens_left=4096, num_scheduled_tokens=1, num_decodes=1)


def test_single_token_matches_draft_only_where_no_longer_match_is_found() -> None:
    speculator = build_speculator(SpeculativeConfig(method="auto"))
    assert speculator is not None
    assert [p.name for p in speculator.proposers] == ["ngram", "suffix", "ngram-1", "suffix-1"]
    # [1, 2] occurred before (followed by 3, 9): the long tier drafts; a fresh speculator drafts it all.
    long_match = make_request("long", prompt_token_ids=[5, 1, 2, 3, 9, 1, 2])
    assert speculator.draft([(long_match, 10)], _ROOM) == {"long": [3, 9, 1, 2]}
    assert draft_state(long_match).proposer == "ngram"
    # Only the last token repeats: the single-token tier drafts what followed its latest occurrence.
    single = make_request("single", prompt_token_ids=[4, 7, 8, 4])
    assert speculator.draft([(single, 10)], _ROOM) == {"single": [7, 8, 4]}
    assert draft_state(single).proposer == "ngram-1"
    # The pool's single tokens come after the request's own, and only where the own tokens have none.
    speculator.finished(make_request("earlier", prompt_token_ids=[30, 31]))  # no output: nothing learnt
    done = make_request("done", prompt_token_ids=[30, 31])
    done.output_token_ids.extend([6, 60, 61])
    speculator.finished(done)
    fresh = make_request("fresh", prompt_token_ids=[50, 51, 6])
    assert speculator.draft([(fresh, 10)], _ROOM) == {"fresh": [60, 61]}
    assert draft_state(fresh).proposer == "suffix-1"
    # ngram_min 2: no single-token tier.
    strict = build_speculator(SpeculativeConfig(method="auto", ngram_min=2))
    assert strict is not None and [p.name for p in strict.proposers] == ["ngram", "suffix"]
    assert strict.draft([(make_request("s", prompt_token_ids=[4, 7, 8, 4]), 10)], _ROOM) == {}
    assert [p.name for p in build_speculator(SpeculativeConfig(method="ngram")).proposers] == ["ngram", "ngram-1"]


class _Named:
    """Proposes ``draft`` on the steps ``when`` says yes to."""

    def __init__(self, name: str, draft: list[int], when: Any) -> None:
        self.name, self.draft, self.when = name, draft, when
        self.step = 0

    def propose(self, wanted: list[tuple[Request, list[int], int]]) -> dict[str, list[int]]:
        return {r.request_id: self.draft[:n] for r, _, n in wanted if self.when(self.step)}

    def finished(self, request: Request) -> None:
        pass


def test_a_proposer_whose_drafts_miss_stops_alone() -> None:
    """Acceptance is kept per proposer: a weak guess that keeps missing drafts only probes, while the
    strong proposer before it keeps drafting in full; the counters say who drafted what."""
    strong = _Named("strong", [1, 2, 3], lambda step: step % 2 == 0)
    weak = _Named("weak", [9, 9, 9], lambda step: True)
    speculator = DraftSpeculator([strong, weak], num_speculative_tokens=3, min_acceptance=0.2)
    request = make_request("r")
    weak_tokens = []
    for step in range(48):
        strong.step = weak.step = step
        drafts = speculator.draft([(request, 3)], _ROOM)
        draft = drafts.get("r", [])
        if step % 2 == 0:
            assert draft == [1, 2, 3] and draft_state(request).proposer == "strong"
        elif draft:
            weak_tokens.append((step, len(draft)))
        if draft:
            speculator.observe([(request, len(draft), len(draft) if draft[0] == 1 else 0)])
    late = [length for step, length in weak_tokens if step >= 16]
    assert late and max(late) <= PROBE_TOKENS and len(late) <= 32 // PROBE_EVERY_STEPS + 1  # probes only
    counters = speculator.counters
    assert counters.accepted_tokens_by_proposer == {"strong": 72, "weak": 0}
    assert counters.draft_tokens_by_proposer["strong"] == 72
    assert counters.draft_tokens_by_proposer["weak"] == sum(length for _, length in weak_tokens)


def test_by_position_counts_follow_from_the_draft_length_counts():
    counters = SpeculationCounters(drafts_by_length=[0, 1, 0, 2], drafts_by_num_kept=[1, 1, 1, 0])
    # NOTE: drafts of 1, 3 and 3 tokens reach position 1 three times, positions 2 and 3 twice; kept 0, 1 and 2
    assert counters.drafted_by_position == [3, 2, 2]
    assert counters.accepted_by_position == [2, 1, 0]
    assert counters.acceptance_by_position() == [2 / 3, 1 / 2, 0.0]
    assert SpeculationCounters().drafted_by_position == []


def test_the_suffix_pool_forgets_whole_older_outputs_first():
    pool = SuffixPool(min_n=1, max_n=2, continuation_len=2, capacity=4)
    pool.add([9], [1, 2])  # (9,) -> (1, 2), (1,) -> (2,), (9, 1) -> (2,)
    pool.add([8], [3, 4])  # (8,) -> (3, 4), (3,) -> (4,), (8, 3) -> (4,): the first output's two oldest go
    assert len(pool) == 4
    assert pool.propose([9], 2) == [] and pool.propose([5, 1], 1, min_n=1) == []
    assert pool.propose([9, 1], 1) == [2]
    assert pool.propose([8], 2) == [3, 4] and pool.propose([8, 3], 1) == [4]


def test_the_suffix_pool_logs_only_the_outputs_its_tables_could_hold():
    """Outputs wait in a log until a lookup reads their length's table; the log keeps the latest outputs that give the
    longest length its share of the capacity, so a table read late takes what it would still hold, nothing older."""
    pool = SuffixPool(min_n=1, max_n=1, continuation_len=1, capacity=2)
    pool.add([0], [1])
    pool.add([2], [3])
    pool.add([4], [5])  # NOTE: nothing read yet: the first output leaves the log unread, as a table would forget it
    assert pool.propose([0], 1) == [] and pool.propose([2], 1) == [3] and pool.propose([4], 1) == [5]
    assert len(pool) == 2
    pool.add([2], [6])  # the newest continuation wins, in the table already read
    assert pool.propose([2], 1) == [6]
