"""Output-length prediction: the history's estimates, the predicted-KV admission budget, ordering by
predicted length inside a priority level, and the aging bound that still holds with it.

The scripted runner stops each request with EOS at a scripted length, so lengths are heavy-tailed and
unrelated to ``max_tokens``, as a model's are.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.scheduler_helpers import (
    ScriptedModelRunner,
    assert_no_leaks,
    make_request,
    make_scheduler,
    step_until_done,
)
from tokenmill.engine.config import EngineConfig, LengthConfig
from tokenmill.engine.core.clock import ManualClock
from tokenmill.engine.core.kv_budget import PredictedKvBudget
from tokenmill.engine.core.length_history import LengthEstimate, LengthSamples
from tokenmill.engine.core.length_predictor import LengthPredictor
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.scheduler_policy import admission_key
from tokenmill.engine.core.step_io import ModelOutput, SchedulerOutput
from tokenmill.engine.kv.block_manager import BlockManager

EOS = 0
SHORT, LONG = 3, 30  # output lengths of the two templates
TEMPLATE = {"short": [11] * 16, "long": [22] * 16}  # the first 16 prompt tokens name the template


class EosAtLength(ScriptedModelRunner):
    """The scripted model, ending each request with EOS at its scripted length (never earlier)."""

    def __init__(self, block_manager: BlockManager, lengths: dict[str, int]) -> None:
        super().__init__(block_manager)
        self.lengths = lengths
        self.counts: dict[str, int] = {}

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        output = super().execute(scheduler_output)
        for request_id, token_ids in output.sampled_token_ids.items():
            count = self.counts[request_id] = self.counts.get(request_id, 0) + 1
            token_ids[:] = [EOS if count >= self.lengths[request_id] else max(1, token_ids[0])]
        return output


def templated(request_id: str, kind: str, row: int, max_tokens: int = 64, **options: object) -> Request:
    """A request of template ``kind`` with a row-specific tail (as a bulk job's rows are)."""
    prompt = TEMPLATE[kind] + [(row * 7 + i) % 40 + 1 for i in range(6)]
    return make_request(request_id, prompt_token_ids=prompt, max_tokens=max_tokens, **options)  # type: ignore[arg-type]


def lengths_of(requests: list[Request]) -> dict[str, int]:
    return {r.request_id: SHORT if r.prompt_token_ids[0] == TEMPLATE["short"][0] else LONG for r in requests}


def warm_history(predictor: LengthPredictor, num_each: int = 8) -> None:
    """Finished requests of both templates, as an earlier part of the job would leave."""
    for row in range(num_each):
        for kind, length in (("short", SHORT), ("long", LONG)):
            request = templated(f"old-{kind}-{row}", kind, 100 + row)
            request.output_token_ids = [1] * length
            predictor.observe(request)


def run_backlog(scheduler: Scheduler, requests: list[Request], **options: object):  # type: ignore[no-untyped-def]
    runner = EosAtLength(scheduler.block_manager, lengths_of(requests))
    return step_until_done(scheduler, runner, arrivals={0: requests}, **options)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- the history


def _estimate(samples: LengthSamples, num_generated: int = 0, max_tokens: int = 1000, min_samples: int = 1,
              live_ages: list[int] | None = None) -> LengthEstimate | None:
    return samples.estimate(num_generated, max_tokens, min_samples=min_samples, quantile=0.75, source="all",
                            live_ages=live_ages)


def test_samples_keep_a_bounded_window_and_estimate_conditionally() -> None:
    samples = LengthSamples(capacity=4)
    for length in (10, 20, 30, 40, 50):
        samples.add(length)
    assert len(samples) == 4  # 10 left the window
    estimate = _estimate(samples)
    assert estimate is not None and (estimate.median_total, estimate.mean_total, estimate.high_total) == (30, 35, 40)
    older = _estimate(samples, num_generated=35, min_samples=2)  # 35 generated: only the longer ones predict it
    assert older is not None and (older.median_total, older.mean_total) == (40.0, 45.0)
    assert _estimate(samples, num_generated=35, min_samples=3) is None
    capped = _estimate(samples, max_tokens=25)  # its own max_tokens caps every sample
    assert capped is not None and capped.median_total == 25.0 and capped.mean_total == pytest.approx(23.75)


def test_requests_still_running_count_as_censored_lengths() -> None:
    """Four short answers finished while four long ones still run: the history alone says "short", the
    running ones (longer than their ages) put half the probability past every finished length, at the cap."""
    samples = LengthSamples(capacity=64)
    for length in (5, 6, 7, 8):
        samples.add(length)
    naive = _estimate(samples, max_tokens=500)
    assert naive is not None and naive.high_total == 7
    censored = _estimate(samples, max_tokens=500, live_ages=[40, 60, 90, 120])
    assert censored is not None
    assert censored.median_total == 8 and censored.high_total == 500
    assert censored.mean_total == pytest.approx((5 + 6 + 7 + 8) / 8 + 500 / 2)
    young = _estimate(samples, max_tokens=500, live_ages=[0, 0, 6])  # waiting ones carry no information
    assert young is not None and young.mean_total == pytest.approx(5 / 5 + 6 / 5 + (1 - 2 / 5) * 7.5)


def test_running_requests_refine_an_estimate_but_do_not_make_one() -> None:
    """Three short answers finished and two requests run young: five lengths are "known", but nothing past 8
    tokens is, so a key needing five answers nothing yet (a cold job's first answers must not speak for every
    row); five finished lengths do, with the running ones counted as censored."""
    samples = LengthSamples(capacity=64)
    for length in (5, 6, 8):
        samples.add(length)
    assert _estimate(samples, max_tokens=500, min_samples=5, live_ages=[20, 30]) is None
    for length in (7, 9):
        samples.add(length)
    estimate = _estimate(samples, max_tokens=500, min_samples=5, live_ages=[20, 30])
    assert estimate is not None and estimate.high_total == 500  # the two running ones may run to the cap


def test_the_most_specific_history_with_enough_samples_predicts() -> None:
    predictor = LengthPredictor(LengthConfig(min_samples=4))
    fresh = templated("fresh", "short", 1)
    assert predictor.current(fresh).source == "prior" and fresh.length_state.estimate is not None
    assert fresh.length_state.estimate.median_total == 64  # no history: plan for max_tokens
    warm_history(predictor)
    short, long = templated("s", "short", 2), templated("l", "long", 3)
    assert (predictor.estimate(short).median_total, predictor.estimate(short).source) == (SHORT, "prefix")
    assert predictor.estimate(long).median_total == LONG
    stranger = make_request("x", prompt_token_ids=[33] * 20, max_tokens=64)
    assert predictor.estimate(stranger).source == "all"  # an unseen template: every request's lengths
    grouped = templated("g", "long", 4)
    grouped.length_state.group = "job-1"
    assert predictor.estimate(grouped).source == "prefix"  # the job has no history yet
    for row in range(4):
        done = templated(f"job-{row}", "long", 200 + row)
        done.length_state.group, done.output_token_ids = "job-1", [1] * 12
        predictor.observe(done)
    grouped.length_state.keys = ()
    assert (predictor.estimate(grouped).source, predictor.estimate(grouped).median_total) == ("group+prefix", 12)
    assert predictor.group_mean_length("job-1") == 12


def test_a_request_that_outlives_its_estimate_is_re_estimated_upward() -> None:
    predictor = LengthPredictor(LengthConfig(min_samples=4))
    warm_history(predictor)
    request = templated("r", "short", 5)
    assert predictor.current(request).median_total == SHORT
    request.output_token_ids = [1] * (SHORT + 2)  # longer than every short one before it
    estimate = predictor.current(request)
    assert predictor.num_outlived == 1
    assert estimate.median_total > SHORT + 2 and estimate.mean_remaining(SHORT + 2) >= 1
    assert estimate.source == "all"  # the long requests of the shared history still predict it


def test_waiting_estimates_are_redone_as_the_history_grows() -> None:
    predictor = LengthPredictor(LengthConfig(min_samples=4))
    waiting = templated("w", "short", 6)
    assert predictor.current(waiting).source == "prior"
    warm_history(predictor)  # 16 finished since: more than twice the history it was estimated with
    assert predictor.current(waiting).source == "prefix"


def test_waiting_requests_are_re_estimated_after_every_finish() -> None:
    """A waiting request's estimate orders admission, so it follows each finished request (not only each
    doubling of the history, as a running request's does); requests of one template share the per-key work."""
    predictor = LengthPredictor(LengthConfig(min_samples=4))
    warm_history(predictor)  # 16 finished
    first, second = templated("w1", "short", 6), templated("w2", "short", 7)
    assert predictor.current(first).median_total == predictor.current(second).median_total == SHORT
    for row in range(10):  # the template's answers got longer: 10 more finished, fewer than doubling the history
        done = templated(f"later-{row}", "short", 300 + row)
        done.output_token_ids = [1] * 9
        predictor.observe(done)
    assert predictor.current(first).median_total == predictor.current(second).median_total == 9
    running = templated("r", "short", 8)
    running.output_token_ids = [1]
    before = predictor.current(running)
    predictor.observe(templated("one-more", "short", 400))
    assert predictor.current(running) is before  # a running request keeps its estimate until it is stale


def test_a_template_whose_requests_all_run_past_the_others_is_not_predicted_short() -> None:
    """The first requests of a long template still run while the short answers of the job finish: the job's
    history alone would predict a new long request as short as those. The template's running requests say it
    is longer than their age, so the coarser history predicts it from lengths past that age only."""
    predictor = LengthPredictor(LengthConfig(min_samples=4))
    for row in range(8):
        done = templated(f"old-short-{row}", "short", 100 + row)
        done.output_token_ids = [1] * SHORT
        predictor.observe(done)
    for row in range(4):
        running = templated(f"long-{row}", "long", row)
        running.output_token_ids = [1] * 20
        predictor.estimate(running)  # now tracked as live: a censored length of its keys
    new_long, new_short = templated("new-long", "long", 50), templated("new-short", "short", 51)
    assert predictor.current(new_short).median_total == SHORT
    estimate = predictor.current(new_long)
    assert estimate.median_total > 20 and estimate.mean_remaining(0) > 20
    assert estimate.source == "outlived"  # no finished length past 20 anywhere: as long again as its template ran


def test_prediction_errors_compare_with_planning_by_max_tokens() -> None:
    predictor = LengthPredictor(LengthConfig(min_samples=4))
    warm_history(predictor)
    for row in range(10):
        request = templated(f"e{row}", "short", row)
        request.length_state.admitted_estimate = predictor.current(request)
        request.output_token_ids = [1] * SHORT
        predictor.observe(request)
    error, baseline = predictor.errors()
    assert error == 0.0 and baseline is not None and baseline > 2.0  # log(64 / 3)


def test_prediction_errors_are_the_medians_over_the_last_records() -> None:
    """``errors(last)``: the median absolute log-length error of the last ``last`` records' predictions and of
    their ``max_tokens``, as the records themselves give them (kept per record, read from the newest)."""
    predictor = LengthPredictor(LengthConfig(min_samples=4))
    warm_history(predictor)
    for row in range(300):
        request = templated(f"m{row}", "long" if row % 3 else "short", row, max_tokens=64 + row % 7)
        request.length_state.admitted_estimate = predictor.current(request)
        request.output_token_ids = [1] * (1 + (row * 37) % 60)
        predictor.observe(request)
    for last in (1, 50, 200, 10_000):
        records = list(predictor.records)[-last:]

        def median_error(predicted_of: Any, records: list[Any] = records) -> float:
            return statistics.median(abs(math.log(max(1.0, predicted_of(r))) - math.log(max(1.0, r.actual)))
                                     for r in records)

        assert predictor.errors(last) == (median_error(lambda r: r.predicted), median_error(lambda r: r.max_tokens))


# ----------------------------------------------------------------------------- the scheduler


def _heavy_tailed_backlog(num: int) -> list[Request]:
    return [templated(f"r{i}", "long" if i % 4 == 0 else "short", i) for i in range(num)]


def test_the_predicted_kv_budget_avoids_the_preemptions_of_admitting_whatever_fits() -> None:
    """Same backlog, same pool: admitting whenever the next chunk fits runs out of blocks and preempts;
    the budget admits by predicted peak KV instead. Every request still gets the same tokens."""
    results = {}
    for name, length in (("off", None), ("on", LengthConfig(min_samples=4, budget_kv=True))):
        scheduler = make_scheduler(num_gpu_blocks=40, num_cpu_blocks=80, block_size=4, max_num_seqs=16,
                                   eos_token_id=EOS, length=length)
        if scheduler.length_predictor is not None:
            warm_history(scheduler.length_predictor)
        run = run_backlog(scheduler, _heavy_tailed_backlog(32))
        assert_no_leaks(scheduler)
        assert all(status is RequestStatus.FINISHED_STOPPED for status in run.statuses.values())
        results[name] = (run.outputs, scheduler.stats(), len(run.steps))
    assert results["on"][0] == results["off"][0]
    off, on = results["off"][1], results["on"][1]
    assert off.counters.num_preemptions >= 5
    assert on.counters.num_preemptions * 5 <= off.counters.num_preemptions
    assert on.counters.num_deferred_admissions > 0 and on.length.num_observed == 32 + 16


# Lengths of 100 tokens, or 2,000 one time in ten (mean 290, standard deviation 570, 0.9 quantile 2,000); and
# lengths of 2,000 tokens always.
TAILED = LengthEstimate(0, 100.0, 290.0, 2000.0, 50, "prefix", std_total=570.0)
CERTAIN = LengthEstimate(0, 2000.0, 2000.0, 2000.0, 50, "prefix", std_total=0.0)


def budget_over(estimates: dict[str, LengthEstimate], num_pool_blocks: int) -> PredictedKvBudget:
    """A budget (blocks of 4 tokens, planned at the 0.9 quantile) whose estimates are ``estimates`` by request id."""
    return PredictedKvBudget(num_pool_blocks=num_pool_blocks, block_size=4,
                             estimate_of=lambda r: estimates[r.request_id], confidence=0.9)


def long_requests(prefix: str, count: int, estimates: dict[str, LengthEstimate],
                  estimate: LengthEstimate) -> list[Request]:
    """``count`` requests of 8 prompt tokens and max_tokens 2,000, each estimated at ``estimate``."""
    requests = [make_request(f"{prefix}{i}", prompt_token_ids=[1] * 8, max_tokens=2000) for i in range(count)]
    estimates.update((request.request_id, estimate) for request in requests)
    return requests


def test_the_budget_plans_the_tail_of_the_set_not_of_every_request() -> None:
    """Twenty requests whose lengths are 100 tokens, or 2,000 one time in ten (mean 290, standard deviation 570,
    0.9 quantile 2,000): planning each at its quantile would need ~40,000 tokens, but a few of twenty run long,
    not all, so the budget plans their mean plus z = 1.28 standard deviations of their total (~9,100 tokens:
    the mean covers 2 of them looping, the margin about 2 more; 4 or more loop 13% of the time). One request
    alone is planned at its quantile, a request that always runs to the end adds no margin, and an estimate
    without a deviation counts its tail past the mean as z of them."""
    estimates: dict[str, LengthEstimate] = {}
    budget = budget_over(estimates, 4000)
    requests = long_requests("r", 20, estimates, TAILED)
    blocks = budget.predicted_peak_blocks(requests)
    margin = 1.2816 * 570 * 20 ** 0.5
    assert 20 * 290 + margin <= blocks * 4 <= 20 * (290 + 8 + 4) + margin + 8  # the mean plus the set's tail
    assert 2000 * 20 / 4 > 4 * blocks  # far below every request at its quantile
    alone = budget.predicted_peak_blocks(requests[:1])
    assert 2000 <= alone * 4 <= 2000 + 8 + 8  # its quantile (plus its prompt and rounding)
    estimates["r0"] = CERTAIN
    assert budget.predicted_peak_blocks(requests[:1]) * 4 <= 2000 + 8 + 4
    unknown = LengthEstimate(0, 100.0, 290.0, 2000.0, 50, "outlived")
    for request in requests:
        estimates[request.request_id] = unknown
    assert budget.predicted_peak_blocks(requests) * 4 >= 20 * 290 + (2000 - 290) * 20 ** 0.5


def test_a_short_request_runs_beside_a_set_whose_own_peak_passes_the_pool() -> None:
    """Four requests that will run to 2,000 tokens passed the budget before the history knew them (their peak,
    8,000 tokens, is twice the pool's 4,000). Holding a short request back would not lower that peak: one
    predicted done (at its quantile) before their growth uses the room it takes is admitted; a long one is not,
    nor a short one once the room is nearly gone. Pacing is counted from a request's mean length, not its tail."""
    short = LengthEstimate(0, 10.0, 12.0, 20.0, 50, "prefix", std_total=4.0)
    estimates: dict[str, LengthEstimate] = {}
    budget = budget_over(estimates, 1000)
    committed = long_requests("c", 4, estimates, CERTAIN)
    candidate = make_request("short", prompt_token_ids=[1] * 8, max_tokens=2000)
    estimates["short"] = short
    assert budget.predicted_peak_blocks([*committed, candidate]) > budget.num_pool_blocks
    assert budget.admits(candidate, committed)  # 5 x (8 + 20) tokens fit
    estimates["short"] = CERTAIN
    assert not budget.admits(candidate, committed)
    estimates["short"] = short
    for request in committed:
        request.output_token_ids = [1] * 980  # 4 x 988 tokens held now: 20 more steps of growth do not fit
    assert not budget.admits(candidate, committed)
    estimates["short"] = TAILED
    assert budget.pacing_tokens(candidate) == pytest.approx(290 * (8 + 145) / 4000)


def test_rows_of_a_template_the_history_does_not_know_vary_together() -> None:
    """A job's first rows of a new template are predicted from the job's history (its short answers): whether
    they are short or essays, they are all one or the other, so the budget adds their deviations before squaring
    (ten of them: a margin ten deviations wide, not the square root of ten). Once the template has its own
    history its rows vary independently again."""
    predictor = LengthPredictor(LengthConfig(min_samples=4))
    for row in range(8):
        done = templated(f"old-short-{row}", "short", 100 + row)
        done.output_token_ids = [1] * SHORT
        predictor.observe(done)
    rows = [templated(f"long-{row}", "long", row) for row in range(10)]
    for request in rows:
        predictor.estimate(request)
    for request in rows:  # each now shares its template's prefix with the others
        assert predictor.estimate(request).source == "all"
        assert request.length_state.correlation is not None
    assert len({request.length_state.correlation for request in rows}) == 1
    short = templated("short-new", "short", 50)
    assert predictor.estimate(short).source == "prefix" and short.length_state.correlation is None  # its own history
    tailed = LengthEstimate(0, 100.0, 290.0, 2000.0, 50, "all", std_total=500.0)
    budget = PredictedKvBudget(num_pool_blocks=100_000, block_size=4, estimate_of=lambda r: tailed, confidence=0.9)
    correlated = budget.predicted_peak_blocks(rows)
    for request in rows:
        request.length_state.correlation = None
    independent = budget.predicted_peak_blocks(rows)
    z = 1.2816
    assert (correlated - independent) * 4 == pytest.approx(z * 500 * (10 - 10 ** 0.5), abs=8)


def test_an_estimate_carries_its_distribution_s_deviation() -> None:
    history = LengthSamples(64)
    for length in [100] * 9 + [2000]:
        history.add(length)
    estimate = history.estimate(0, 2000, min_samples=5, quantile=0.9, source="prefix")
    assert estimate is not None and estimate.std_total is not None
    assert abs(estimate.mean_total - 290) < 1e-6 and abs(estimate.std_total - 570) < 1
    later = history.estimate(150, 2000, min_samples=1, quantile=0.9, source="prefix")  # past the short ones
    assert later is not None and later.mean_total == 2000 and later.std_total == 0


def test_a_cold_predictor_admits_the_first_request_and_learns() -> None:
    scheduler = make_scheduler(num_gpu_blocks=40, num_cpu_blocks=80, block_size=4, max_num_seqs=16,
                               eos_token_id=EOS, length=LengthConfig(min_samples=4, budget_kv=True))
    run = run_backlog(scheduler, _heavy_tailed_backlog(24))
    assert len(run.outputs) == 24
    assert_no_leaks(scheduler)


def test_the_budget_never_holds_back_a_more_urgent_request() -> None:
    """Long bulk work fills the predicted budget; an urgent request is admitted at once (the bulk
    requests would yield their room to it)."""
    scheduler = make_scheduler(num_gpu_blocks=40, num_cpu_blocks=80, block_size=4, max_num_seqs=16,
                               eos_token_id=EOS, length=LengthConfig(min_samples=4, budget_kv=True),
                               min_resident_steps=1)
    assert scheduler.length_predictor is not None
    warm_history(scheduler.length_predictor)
    bulk = [templated(f"bulk{i}", "long", i, priority=5) for i in range(8)]
    urgent = templated("urgent", "long", 99, priority=0)
    runner = EosAtLength(scheduler.block_manager, lengths_of([*bulk, urgent]))
    run = step_until_done(scheduler, runner, arrivals={0: bulk, 3: [urgent]})
    assert run.admitted_step["urgent"] == 3
    assert scheduler.stats().counters.num_deferred_admissions > 0  # the bulk backlog itself was budgeted
    assert_no_leaks(scheduler)


def test_a_swapped_request_behind_a_held_back_one_does_not_stall_the_queue() -> None:
    """A long request preempted by the starvation limit ages behind the waiting ones (its wait starts again).
    Counted as committed, it held the first waiting request back on a plan in which it runs, while it could not
    come back behind a held-back request: nothing ran again. (Found by the property test with length knobs.)"""
    scheduler = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=4, block_size=1, max_num_batched_tokens=2,
                               max_prefill_chunk=1, max_prefill_tokens=None, max_num_seqs=1, aging_interval_s=1.0,
                               demote_after_decode_steps=1, min_resident_steps=0, watermark_blocks=0,
                               preemption_mode="swap", enable_priority_preemption=False,
                               length=LengthConfig(budget_kv=True, min_samples=1, tail_quantile=0.6))
    requests = [make_request(f"r{i}", prompt_token_ids=[1], max_tokens=max_tokens)
                for i, max_tokens in enumerate((5, 2, 1, 1, 1, 1, 1))]
    run = step_until_done(scheduler, ScriptedModelRunner(scheduler.block_manager, vocab_size=20),
                          arrivals={0: requests}, max_steps=200, advance_s=1.0)
    assert len(run.outputs) == len(requests)
    assert scheduler.stats().counters.num_swap_outs > 0  # the starvation limit did swap the long one out
    assert_no_leaks(scheduler)


@pytest.mark.parametrize(("ordering", "first"), [("shortest", "short"), ("longest", "long"), ("fcfs", "long")])
def test_ordering_inside_a_level_follows_the_predicted_length(ordering: str, first: str) -> None:
    scheduler = make_scheduler(num_gpu_blocks=200, max_num_seqs=1, eos_token_id=EOS, aging_interval_s=100.0,
                               length=LengthConfig(min_samples=4, ordering=ordering, budget_kv=False))
    assert scheduler.length_predictor is not None
    warm_history(scheduler.length_predictor)
    backlog = [templated(f"r{i}", "long" if i % 2 == 0 else "short", i) for i in range(6)]  # r0 is long
    run = run_backlog(scheduler, backlog)
    order = sorted(run.admitted_step, key=run.admitted_step.__getitem__)
    kinds = ["long" if int(rid[1:]) % 2 == 0 else "short" for rid in order]
    assert kinds[0] == first
    if ordering != "fcfs":
        assert kinds[:3] == [first] * 3
    assert_no_leaks(scheduler)


def test_shortest_first_runs_a_few_rows_of_an_unknown_template_first_to_learn_it() -> None:
    """Predicted from the job's other answers, a template the history does not know would queue behind every
    known one, and would never be learnt while short work is waiting. Its first min_samples rows run first; once
    they finished it is ordered by its own lengths (10 tokens: between the short and the long template)."""
    scheduler = make_scheduler(num_gpu_blocks=200, max_num_seqs=1, eos_token_id=EOS, aging_interval_s=100.0,
                               length=LengthConfig(min_samples=4, ordering="shortest", budget_kv=False))
    assert scheduler.length_predictor is not None
    warm_history(scheduler.length_predictor)
    known = [templated(f"{kind}{i}", kind, i) for i in range(3) for kind in ("long", "short")]
    unknown = [make_request(f"new{i}", prompt_token_ids=[33] * 16 + [i + 1] * 6, max_tokens=64) for i in range(6)]
    lengths = {**lengths_of(known), **{r.request_id: 10 for r in unknown}}
    runner = EosAtLength(scheduler.block_manager, lengths)
    run = step_until_done(scheduler, runner, arrivals={0: known + unknown})
    order = [rid.rstrip("0123456789") for rid in sorted(run.admitted_step, key=run.admitted_step.__getitem__)]
    assert order == ["new"] * 4 + ["short"] * 3 + ["new"] * 2 + ["long"] * 3
    assert_no_leaks(scheduler)


def test_auto_orders_one_job_longest_first_and_mixed_work_shortest_first() -> None:
    def first_kind(groups: list[str | None]) -> str:
        scheduler = make_scheduler(num_gpu_blocks=200, max_num_seqs=1, eos_token_id=EOS, aging_interval_s=100.0,
                                   length=LengthConfig(min_samples=4, ordering="auto", budget_kv=False))
        assert scheduler.length_predictor is not None
        warm_history(scheduler.length_predictor)
        backlog = [templated(f"r{i}", "long" if i % 2 else "short", i) for i in range(4)]  # r0 is short
        for request, group in zip(backlog, groups, strict=True):
            request.length_state.group = group
        run = run_backlog(scheduler, backlog)
        first = min(run.admitted_step, key=run.admitted_step.__getitem__)
        return "long" if int(first[1:]) % 2 else "short"

    assert first_kind(["job"] * 4) == "long"
    assert first_kind(["job", "job", None, "other"]) == "short"


def test_aging_bound_holds_with_shortest_first_under_a_stream_of_short_requests() -> None:
    """A long request waits while short ones keep arriving (each would go first by predicted length):
    aging admits it within (gap + 1) * aging_interval_s plus the time for room to appear."""
    aging_interval_s, t_long = 4.0, 1.0
    clock = ManualClock()
    scheduler = make_scheduler(num_gpu_blocks=400, max_num_seqs=1, eos_token_id=EOS, clock=clock,
                               aging_interval_s=aging_interval_s, min_resident_steps=1,
                               length=LengthConfig(min_samples=4, ordering="shortest", budget_kv=False))
    assert scheduler.length_predictor is not None
    warm_history(scheduler.length_predictor)
    arrivals: dict[int, list[Request]] = {step: [templated(f"s{step}", "short", step, arrival_time_s=float(step))]
                                          for step in range(0, 90, 2)}  # one every 2 s; each runs 3 steps
    long = templated("long", "long", 999, arrival_time_s=t_long)
    arrivals[1] = [long]
    runner = EosAtLength(scheduler.block_manager, lengths_of([long, *[r for rs in arrivals.values() for r in rs]]))
    run = step_until_done(scheduler, runner, arrivals=arrivals, advance_s=1.0)
    room_s = SHORT + 1  # the running short request's remaining steps free the only seat
    assert run.admitted_time_s["long"] <= t_long + aging_interval_s + room_s
    admitted_before = [rid for rid, step in run.admitted_step.items() if step < run.admitted_step["long"]]
    assert len(admitted_before) >= 2  # shortest-first did put short arrivals ahead of it meanwhile
    assert_no_leaks(scheduler)


def test_ordering_by_length_without_aging_is_refused() -> None:
    with pytest.raises(pydantic.ValidationError, match="needs aging"):
        EngineConfig.model_validate({"scheduler": {"aging_interval_s": 0}, "length": {"ordering": "shortest"}})
    EngineConfig.model_validate({"scheduler": {"aging_interval_s": 0}, "length": {"ordering": "fcfs"}})


def test_stats_report_the_predicted_backlog_per_group() -> None:
    scheduler = make_scheduler(num_gpu_blocks=400, max_num_seqs=2, eos_token_id=EOS,
                               length=LengthConfig(min_samples=4, budget_kv=False))
    assert scheduler.length_predictor is not None
    warm_history(scheduler.length_predictor)
    for i in range(4):
        request = templated(f"b{i}", "long", i)
        request.length_state.group = "job"
        scheduler.add_request(request)
    stats = scheduler.stats().length
    assert stats.group_backlog["job"].num_requests == 4
    assert stats.backlog_tokens == pytest.approx(4 * LONG)
    assert stats.group_backlog["job"].mean_length == (SHORT + LONG) / 2  # no history of the job yet: everyone's
    assert make_scheduler().stats().length.backlog_tokens == 0.0  # no predictor: nothing predicted


def test_long_requests_are_paced_and_short_ones_run_meanwhile() -> None:
    """FCFS on a pool the long requests fill: the second long request waits for its pacing interval (started
    together, long requests would also end together, in waves) and the third for room; the short ones behind
    them are predicted to be done before then, so they run meanwhile and the pool stays used. Nothing is
    preempted."""
    scheduler = make_scheduler(num_gpu_blocks=30, num_cpu_blocks=60, block_size=4, max_num_seqs=8, eos_token_id=EOS,
                               length=LengthConfig(min_samples=4, budget_kv=True))
    assert scheduler.length_predictor is not None
    warm_history(scheduler.length_predictor)
    backlog = [templated(f"long{i}", "long", i) for i in range(3)] + [templated(f"short{i}", "short", i)
                                                                      for i in range(2)]
    run = run_backlog(scheduler, backlog)
    assert run.admitted_step["long0"] == run.admitted_step["short0"] == run.admitted_step["short1"] == 0
    assert 0 < run.admitted_step["long1"] < run.admitted_step["long2"]
    assert scheduler.stats().counters.num_preemptions == 0
    assert_no_leaks(scheduler)


def test_a_backlog_that_never_ran_does_not_change_an_estimate() -> None:
    """Only requests that were scheduled have an age: thousands of a template's rows waiting behind its running ones
    leave the running ones' estimates (and a new row's) as they are, and cost no pass over them."""

    def estimates(num_waiting: int) -> tuple[LengthEstimate, LengthEstimate]:
        predictor = LengthPredictor(LengthConfig(min_samples=4))
        warm_history(predictor)
        for row in range(num_waiting):
            predictor.current(templated(f"waiting-{row}", "long", 1000 + row))
        running = [templated(f"running-{row}", "long", row) for row in range(5)]
        for row, request in enumerate(running):
            predictor.current(request)
            request.first_scheduled_time_s = 1.0
            predictor.started(request)
            request.output_token_ids.extend([1] * (10 + 5 * row))
        return predictor.estimate(running[0]), predictor.estimate(templated("new", "long", 500))

    assert estimates(0) == estimates(2000)


@given(st.lists(st.integers(1, 6), max_size=60), st.integers(1, 8))
def test_a_window_s_sorted_lengths_are_its_lengths_sorted(lengths: list[int], capacity: int) -> None:
    """Repeated lengths (a label, max_tokens reached) leave the sorted order untouched as they replace each other."""
    samples = LengthSamples(capacity)
    for length in lengths:
        samples.add(length)
        assert samples._sorted == sorted(samples._recent) and len(samples) == min(len(samples._recent), capacity)


@given(st.lists(st.integers(0, 40), max_size=60), st.integers(1, 16), st.integers(0, 30))
def test_a_window_s_mean_is_its_estimate_s_without_running_requests(lengths: list[int], capacity: int,
                                                                    num_generated: int) -> None:
    """The stats' group means (the fast path) are what an estimate with no running requests and no cap gives."""
    samples = LengthSamples(capacity)
    for length in lengths:
        samples.add(length)
    estimate = samples.estimate(num_generated, 2**31, min_samples=1, quantile=0.5, source="group")
    mean = samples.mean_longer_than(num_generated)
    assert (mean is None) == (estimate is None)
    assert mean is None or estimate is None or mean == pytest.approx(estimate.mean_total)


_OPERATIONS = st.lists(st.tuples(st.sampled_from(["admit", "start", "finish", "abort", "fork"]),
                                 st.integers(0, 40), st.integers(0, 2)), max_size=80)


@settings(max_examples=60, deadline=None)
@given(_OPERATIONS)
def test_every_key_s_history_holds_exactly_its_live_requests(operations: list[tuple[str, int, int]]) -> None:
    """Admissions, starts, finishes, aborts and forks (a parent forgotten, its samples estimated with its keys) in any
    order, with few keys kept: each live request is counted under each of its keys, in the history the predictor
    holds for it, and nowhere else; a key with neither lengths nor live requests is dropped."""
    predictor = LengthPredictor(LengthConfig(min_samples=2, max_keys=16))
    live: dict[str, Request] = {}
    for number, (operation, row, group) in enumerate(operations):
        request = next(iter(live.values()), None) if live and row % 2 else None
        if operation == "admit" or request is None:
            # NOTE: a row's own tokens from the 9th on: its 16-token prefix is its own key (more than max_keys of them)
            template = TEMPLATE["short" if row % 3 else "long"]
            request = make_request(f"r{number}", prompt_token_ids=template[:8] + [row + 1] * 14, max_tokens=64)
            request.length_state.group = [None, "job-a", "job-b"][group]
            predictor.current(request)
            live[request.request_id] = request
        elif operation == "start":
            request.first_scheduled_time_s = 1.0
            predictor.started(request)
            request.output_token_ids.extend([1] * (row % 5 + 1))
            predictor.current(request)
        elif operation == "finish":
            predictor.observe(live.pop(request.request_id))
        elif operation == "abort":
            predictor.forget(live.pop(request.request_id))
        else:
            predictor.forget(live.pop(request.request_id))
            sample = make_request(f"{request.request_id}-s", prompt_token_ids=request.prompt_token_ids,
                                  max_tokens=request.max_tokens)
            sample.length_state = request.length_state.for_sample()
            predictor.current(sample)
            live[sample.request_id] = sample
        histories = predictor._histories
        for history in histories.values():
            assert history.is_attached
            assert set(history.live) == {r.request_id for r in live.values() if history in r.length_state.keys}
            assert set(history.started) <= set(history.live)
            assert history.live or history.samples is not None
        for request in live.values():
            assert all(histories[history.key] is history for history in request.length_state.keys)
            assert request.length_state.is_tracked
        with_samples = [history for history in histories.values() if history.samples is not None]
        assert set(predictor._with_samples) == set(with_samples) and len(with_samples) <= 16


def test_the_least_recently_observed_keys_are_forgotten_first() -> None:
    """Past max_keys the keys observed longest ago lose their lengths; a job finishing all along keeps its own."""
    predictor = LengthPredictor(LengthConfig(min_samples=2, max_keys=16))
    waiting = make_request("waiting", prompt_token_ids=[7] * 12, max_tokens=64)
    predictor.current(waiting)  # live under its prefix's keys while they are forgotten
    earlier = make_request("earlier", prompt_token_ids=[7] * 12, max_tokens=64)
    earlier.output_token_ids = [1] * 3
    predictor.observe(earlier)
    for row in range(40):
        stranger = make_request(f"s{row}", prompt_token_ids=[row + 50] * 12, max_tokens=64)
        stranger.output_token_ids = [1] * 5
        predictor.observe(stranger)
        done = templated(f"job-{row}", "long", row)
        done.length_state.group, done.output_token_ids = "job-1", [1] * 12
        predictor.observe(done)
    kept = {history.key for history in predictor._histories.values() if history.samples is not None}
    assert len(kept) <= 16
    assert ("job-1", False) in kept and (None, False) in kept  # observed at every finish
    strangers = {row for row in range(40) if (None, False, 8, hash(tuple([row + 50] * 8))) in kept}
    assert strangers == set(range(30, 40))  # the job's 6 keys and the last 10 strangers' prefixes: 16
    row = templated("next", "long", 99)
    row.length_state.group = "job-1"
    assert predictor.estimate(row).median_total == 12
    prefix = next(history for history in waiting.length_state.keys if history.prefix_length == 8)
    assert prefix.samples is None and predictor._histories[prefix.key] is prefix  # its lengths forgotten, not its rows
    waiting.output_token_ids = [1] * 3
    predictor.observe(waiting)
    assert prefix.samples is not None and len(prefix.samples) == 1 and predictor._histories[prefix.key] is prefix


def _plain_length_order(scheduler: Scheduler) -> list[Request]:
    """The waiting and swapped requests sorted by their admission keys made afresh (the rule the kept order follows:
    the scheduler keyed and sorted them every step before it kept them)."""
    predictor = scheduler.length_predictor
    assert predictor is not None
    waiting = [r for r in scheduler._queues.waiting]
    ordering = predictor.config.ordering
    if ordering == "auto":
        groups = {r.length_state.group for r in waiting}
        ordering = "longest" if len(groups) == 1 and None not in groups else "shortest"
    sign = 1.0 if ordering == "shortest" else -1.0

    def key(request: Request) -> object:
        estimate = predictor.current(request)
        order = -math.inf if request.length_state.exploring else sign * estimate.median_remaining(
            request.num_output_tokens)
        return admission_key(request, scheduler.config.aging_interval_s, order)

    return sorted(scheduler._queues.swapped + waiting, key=key)


@pytest.mark.parametrize("ordering", ["shortest", "longest", "auto"])
def test_the_kept_length_order_is_the_order_made_afresh_every_step(ordering: str) -> None:
    """Kept between steps (its keys made anew only when the direction changes or a waiting request's prediction is
    due), the admission order by predicted length is, after every schedule, the one keying and sorting every
    waiting and swapped request gives: a backlog of two templates and three jobs, arrivals, preemptions (a pool
    too small for all that run), the history learning as requests finish."""
    clock = ManualClock()
    scheduler = make_scheduler(num_gpu_blocks=40, num_cpu_blocks=40, max_num_seqs=6, eos_token_id=EOS, clock=clock,
                               aging_interval_s=5.0, preemption_mode="swap",
                               length=LengthConfig(min_samples=3, ordering=ordering, budget_kv=False))
    requests = [templated(f"r{i}", "long" if i % 3 == 0 else "short", i, arrival_time_s=float(i // 10))
                for i in range(90)]
    for i, request in enumerate(requests):
        request.length_state.group = ("job", "other", None)[i % 7 % 3] if ordering != "auto" or i >= 40 else "job"
    arrivals = {step: requests[step * 10:(step + 1) * 10] for step in range(9)}
    runner = EosAtLength(scheduler.block_manager, lengths_of(requests))
    checked = []

    def compare(step: int, output: SchedulerOutput) -> None:
        kept = list(scheduler._queues.in_admission_order())
        assert kept == _plain_length_order(scheduler), f"step {step}"
        checked.append(len(kept))

    run = step_until_done(scheduler, runner, arrivals=arrivals, advance_s=1.0, on_step=compare)
    assert len(run.outputs) == 90 and max(checked) >= 20
    assert_no_leaks(scheduler)
