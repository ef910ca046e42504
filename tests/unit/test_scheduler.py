"""Scheduler basics: chunking, ordering, budgets, memory preemption (recompute and swap),
finishing, errors and stats. Every scenario ends with a leak check."""

from __future__ import annotations

import pytest

from tests.unit.scheduler_helpers import (
    KVMismatch,
    ScriptedModelRunner,
    assert_no_leaks,
    make_request,
    make_scheduler,
    reference_outputs,
    step_until_done,
)
from tokenmill.engine.core.request import PreemptionCause, RequestStatus
from tokenmill.engine.core.step_io import ModelOutput, SchedulerOutput


def _chunks(output: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.start_position, c.num_tokens) for c in output.chunks]


def test_chunked_prefill_splits_the_prompt_by_max_prefill_chunk() -> None:
    scheduler = make_scheduler(max_prefill_chunk=4, max_num_batched_tokens=16)
    request = make_request("a", num_prompt_tokens=10, max_tokens=2)
    run = step_until_done(scheduler, arrivals={0: [request]})
    assert [_chunks(step) for step in run.steps] == [
        [("a", 0, 4)], [("a", 4, 4)], [("a", 8, 2)], [("a", 10, 1)],
    ]
    assert [c.needs_sample for step in run.steps for c in step.chunks] == [False, False, True, True]
    assert run.outputs == reference_outputs([request])
    assert_no_leaks(scheduler)


def test_decodes_come_first_then_unfinished_prefills_then_new_requests() -> None:
    scheduler = make_scheduler(max_prefill_chunk=4, max_num_batched_tokens=9)
    arrivals = {0: [make_request("a", 4, max_tokens=5)], 1: [make_request("b", 10)], 2: [make_request("c", 6)]}
    run = step_until_done(scheduler, arrivals=arrivals)
    assert _chunks(run.steps[1]) == [("a", 4, 1), ("b", 0, 4)]
    # step 2: a decodes, b continues its prefill, c gets what is left of the 9-token budget
    assert _chunks(run.steps[2]) == [("a", 5, 1), ("b", 4, 4), ("c", 0, 4)]
    assert_no_leaks(scheduler)


def test_prefill_sub_budget_and_total_budget_hold_every_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6, max_prefill_tokens=3, max_prefill_chunk=2, max_num_seqs=5)
    requests = [make_request(f"r{i}", 7, max_tokens=4) for i in range(5)]
    seen: list[tuple[int, int]] = []

    def check(step: int, output: SchedulerOutput) -> None:
        num_prefill = sum(c.num_tokens for c in output.chunks if c.start_position < 7)
        assert num_prefill <= 3 and output.num_batched_tokens <= 6 and len(output.chunks) <= 5
        assert all(c.num_tokens <= 2 for c in output.chunks)
        seen.append((output.num_batched_tokens, num_prefill))

    run = step_until_done(scheduler, arrivals={0: requests}, on_step=check)
    # the prefill sub-budget is used up while decodes run alongside: used, not just respected
    assert any(num_total > num_prefill == 3 for num_total, num_prefill in seen)
    assert run.outputs == reference_outputs(requests)
    assert_no_leaks(scheduler)


def test_max_num_seqs_limits_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [make_request(f"r{i}", 3, max_tokens=3) for i in range(4)]
    run = step_until_done(scheduler, arrivals={0: requests})
    assert all(len(step.chunks) <= 2 for step in run.steps)
    assert run.admitted_step == {"r0": 0, "r1": 0, "r2": 3, "r3": 3}
    assert_no_leaks(scheduler)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_memory_preemption_keeps_outputs_identical(preemption_mode: str) -> None:
    requests = [make_request(f"r{i}", 6, max_tokens=10) for i in range(4)]
    expected = reference_outputs(requests)
    scheduler = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16, block_size=4, min_resident_steps=0,
                               preemption_mode=preemption_mode)
    run = step_until_done(scheduler, arrivals={0: requests})
    stats = scheduler.stats()
    assert stats.counters.cause_to_num_preemptions[PreemptionCause.MEMORY] > 0
    if preemption_mode == "swap":
        assert stats.counters.num_swap_outs > 0 and stats.counters.num_recompute_preemptions == 0
        assert stats.counters.num_swap_ins == stats.counters.num_swap_outs
        assert stats.counters.num_swapped_in_blocks == stats.counters.num_swapped_out_blocks
    else:
        assert stats.counters.num_swap_outs == 0 and stats.counters.num_recomputed_tokens > 0
    assert run.outputs == expected
    assert all(set(step.preempted_request_ids) <= {"r0", "r1", "r2", "r3"} for step in run.steps)
    assert_no_leaks(scheduler)


def test_memory_victim_is_the_least_urgent_latest_arrival_and_swap_pairs_are_exact() -> None:
    scheduler = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=4, block_size=2, min_resident_steps=0)
    arrivals = {0: [make_request("a", 2, max_tokens=4), make_request("b", 2, max_tokens=4, arrival_time_s=1.0)]}
    run = step_until_done(scheduler, arrivals=arrivals)
    # a and b each hold blocks [0] / [1]; at step 1 both need a 2nd block (2 free): fine;
    # at step 3 both need a 3rd block, none free: b (later arrival) is swapped out.
    preempting = [(i, s) for i, s in enumerate(run.steps) if s.preempted_request_ids]
    step, output = preempting[0]
    assert output.preempted_request_ids == ["b"]
    assert output.swap_out == [(1, 0), (3, 1)]
    assert _chunks(output) == [("a", 4, 1)]
    resumed = next(s for s in run.steps if s.swap_in)
    assert resumed.swap_in[0][0] == 0 and len(resumed.swap_in) == 2
    assert run.outputs == reference_outputs(list(arrivals[0]))
    assert_no_leaks(scheduler)


def test_host_pool_full_falls_back_to_recompute() -> None:
    requests = [make_request(f"r{i}", 6, max_tokens=10) for i in range(3)]
    scheduler = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=1, block_size=4, min_resident_steps=0)
    run = step_until_done(scheduler, arrivals={0: requests})
    stats = scheduler.stats()
    assert stats.counters.num_preemptions > 0 and stats.counters.num_swap_outs == 0
    assert stats.counters.num_recompute_preemptions == stats.counters.num_preemptions
    assert stats.counters.num_recomputed_tokens > 0
    assert run.outputs == reference_outputs(requests)
    assert_no_leaks(scheduler)


def test_wrong_swap_mapping_is_caught_by_the_kv_tracking_runner() -> None:
    scheduler = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=4, block_size=2, min_resident_steps=0)
    runner = ScriptedModelRunner(scheduler.block_manager)
    for request in (make_request("a", 2, max_tokens=4), make_request("b", 2, max_tokens=4, arrival_time_s=1.0)):
        scheduler.add_request(request)
    with pytest.raises(KVMismatch):
        for _ in range(20):
            output = scheduler.schedule()
            if output.swap_in:
                output.swap_in = [(host, device) for (host, _), (_, device)
                                  in zip(output.swap_in, reversed(output.swap_in))]
            for request in scheduler.update(output, runner.execute(output)):
                if request.num_output_tokens >= request.sampling_params.max_tokens:
                    scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)


def test_finish_request_frees_blocks_and_reports_the_id_once() -> None:
    scheduler = make_scheduler(num_gpu_blocks=8)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5))
    scheduler.schedule()
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)  # idempotent
    assert scheduler.get_request("a") is None and scheduler.num_running == 1
    assert scheduler.block_manager.num_free_gpu_blocks == 6
    assert [r.request_id for r in scheduler.take_finished()] == ["a"]
    assert scheduler.take_finished() == []
    scheduler.finish_request("b", RequestStatus.FINISHED_STOPPED)
    with pytest.raises(ValueError):
        scheduler.finish_request("b", RequestStatus.RUNNING)
    assert_no_leaks(scheduler)


def test_aborting_a_swapped_request_frees_its_host_blocks() -> None:
    scheduler = make_scheduler(num_gpu_blocks=3, num_cpu_blocks=4, block_size=2, min_resident_steps=0)
    runner = ScriptedModelRunner(scheduler.block_manager)
    scheduler.add_request(make_request("a", 2, max_tokens=4))
    scheduler.add_request(make_request("b", 2, max_tokens=4, arrival_time_s=1.0))
    while scheduler.num_swapped == 0:
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    assert scheduler.get_request("b").status is RequestStatus.SWAPPED  # type: ignore[union-attr]
    scheduler.finish_request("b", RequestStatus.FINISHED_ABORTED)
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(scheduler)


def test_request_that_can_never_fit_is_finished_with_an_error_not_a_hang() -> None:
    scheduler = make_scheduler(num_gpu_blocks=2, block_size=4)
    too_big = make_request("big", 6, max_tokens=8)
    run = step_until_done(scheduler, arrivals={0: [too_big, make_request("ok", 3, max_tokens=2)]})
    assert too_big.status is RequestStatus.FINISHED_ERROR
    assert run.statuses == {"big": RequestStatus.FINISHED_ERROR, "ok": RequestStatus.FINISHED_LENGTH}
    assert scheduler.stats().counters.num_finished_errors == 1
    assert_no_leaks(scheduler)


def test_update_advances_tokens_and_sets_first_token_time() -> None:
    scheduler = make_scheduler(max_prefill_chunk=4)
    request = make_request("a", 6, max_tokens=3)
    scheduler.add_request(request)
    scheduler.clock.advance(2.0)  # type: ignore[attr-defined]
    output = scheduler.schedule()
    assert scheduler.update(output, ModelOutput()) == []
    assert request.num_computed_tokens == 4 and request.first_token_time_s is None
    assert request.first_scheduled_time_s == 2.0
    output = scheduler.schedule()
    scheduler.clock.advance(1.0)  # type: ignore[attr-defined]
    assert scheduler.update(output, ModelOutput(sampled_token_ids={"a": [7]})) == [request]
    assert request.output_token_ids == [7] and request.num_computed_tokens == 6
    assert request.first_token_time_s == 3.0
    with pytest.raises(Exception, match="needs_sample"):
        scheduler.update(scheduler.schedule(), ModelOutput())
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(scheduler)


def test_add_request_assigns_seq_numbers_and_rejects_duplicates() -> None:
    scheduler = make_scheduler()
    first, second = make_request("a"), make_request("b")
    scheduler.add_request(first)
    scheduler.add_request(second)
    assert (first.seq_no, second.seq_no) == (0, 1)
    with pytest.raises(ValueError):
        scheduler.add_request(make_request("a"))
    assert scheduler.has_unfinished() and scheduler.num_waiting == 2
    step_until_done(scheduler)
    assert_no_leaks(scheduler)


def test_stats_report_queues_blocks_and_counters() -> None:
    scheduler = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=2)
    scheduler.add_request(make_request("a", 5))
    scheduler.add_request(make_request("b", 5))
    scheduler.schedule()
    stats = scheduler.stats()
    assert stats.num_running == 2 and stats.num_waiting == 0 and stats.num_swapped == 0
    assert stats.num_used_gpu_blocks == 4 and stats.gpu_usage == 0.5
    assert stats.num_used_cpu_blocks == 0 and stats.counters.num_steps == 1
    counters = stats.counters
    assert counters.num_preemptions == 0 and counters.num_recomputed_tokens == 0
    assert counters.num_swap_outs == counters.num_swapped_out_blocks == 0
    assert counters.num_swap_ins == counters.num_swapped_in_blocks == 0
    for request_id in ("a", "b"):
        scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
    assert_no_leaks(scheduler)


def test_a_request_that_fills_the_whole_pool_stops_at_max_tokens() -> None:
    """The scheduler decides stopping itself: a request sized to the pool ends at max_tokens and
    never grows past it (which would leave it no block to grow into)."""
    scheduler = make_scheduler(num_gpu_blocks=2, block_size=3)
    runner = ScriptedModelRunner(scheduler.block_manager)
    request = make_request("a", 4, max_tokens=2)  # 6 tokens: exactly the pool
    scheduler.add_request(request)
    for _ in range(5):
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_output_tokens == 2
    assert scheduler.take_finished() == [request]
    assert_no_leaks(scheduler)


def test_stop_tokens_end_a_request_once_min_tokens_are_out() -> None:
    scheduler = make_scheduler(eos_token_id=7)
    request = make_request("a", 3, max_tokens=10)
    request.sampling_params = request.sampling_params.model_copy(update={"min_tokens": 2, "stop_token_ids": [9]})
    scheduler.add_request(request)
    for token_id, expected in ((7, None), (9, None), (5, None), (7, RequestStatus.FINISHED_STOPPED)):
        output = scheduler.schedule()
        scheduler.update(output, ModelOutput(sampled_token_ids={"a": [token_id]}))
        assert (request.status if request.is_finished else None) is expected
    assert request.stop_token_id == 7 and request.output_token_ids == [7, 9, 5, 7]
    assert_no_leaks(scheduler)


def test_scheduler_modules_do_not_import_torch() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, tokenmill.engine.core.scheduler, tokenmill.engine.kv.block_manager; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
