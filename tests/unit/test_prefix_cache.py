"""Prefix caching and parallel sampling in the scheduler, with the scripted runner: hits skip
computed blocks and never return other tokens' KV, cached blocks are evicted least recently used
first, recompute hits its own blocks, and n > 1 samples share the prompt's blocks (copy-on-write
of the partial last one) while drawing what separate requests with seeds seed + i draw."""

from __future__ import annotations

from tests.unit.scheduler_helpers import (
    ScriptedModelRunner,
    assert_no_leaks,
    make_request,
    make_scheduler,
    reference_outputs,
    step_until_done,
)
from tokenmill.engine.core.request import ParallelGroup, Request, RequestStatus
from tokenmill.engine.core.scheduler import Scheduler

PREFIX = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 2 full blocks of 4 and a partial one


def run_one(scheduler: Scheduler, runner: ScriptedModelRunner, request: Request) -> dict[str, list[int]]:
    return step_until_done(scheduler, runner, arrivals={0: [request]}).outputs


def test_a_second_request_starts_after_the_shared_full_blocks() -> None:
    scheduler = make_scheduler(num_gpu_blocks=16, block_size=4, prefix_caching=True)
    runner = ScriptedModelRunner(scheduler.block_manager)
    first = make_request("a", prompt_token_ids=PREFIX + [1, 2], max_tokens=3)
    second = make_request("b", prompt_token_ids=PREFIX + [3], max_tokens=3)
    outputs = {**run_one(scheduler, runner, first), **run_one(scheduler, runner, second)}
    assert outputs == reference_outputs([first, second])
    stats = scheduler.stats()
    assert stats.prefix.num_query_tokens == len(first.all_token_ids) - 3 + len(second.prompt_token_ids)
    assert stats.prefix.num_hit_tokens == 8  # two full blocks; the partial third is never cached
    assert stats.num_cached_blocks >= 2
    assert_no_leaks(scheduler)


def test_a_hit_stops_at_the_first_block_with_other_tokens() -> None:
    scheduler = make_scheduler(num_gpu_blocks=16, block_size=4, prefix_caching=True)
    runner = ScriptedModelRunner(scheduler.block_manager)
    run_one(scheduler, runner, make_request("a", prompt_token_ids=PREFIX, max_tokens=1))
    other = make_request("b", prompt_token_ids=PREFIX[:4] + [99] + PREFIX[5:], max_tokens=2)
    outputs = run_one(scheduler, runner, other)
    assert scheduler.stats().prefix.num_hit_tokens == 4
    assert outputs == reference_outputs([other])


def test_cached_blocks_are_reused_least_recently_used_first() -> None:
    scheduler = make_scheduler(num_gpu_blocks=6, block_size=4, prefix_caching=True)
    runner = ScriptedModelRunner(scheduler.block_manager)
    old = [21, 22, 23, 24, 25]
    new = [31, 32, 33, 34, 35]
    run_one(scheduler, runner, make_request("old", prompt_token_ids=old, max_tokens=1))
    run_one(scheduler, runner, make_request("new", prompt_token_ids=new, max_tokens=1))
    # 17 tokens need 5 blocks: the 4 free ones and the least recently used cached one ("old").
    run_one(scheduler, runner, make_request("filler", prompt_token_ids=list(range(40, 57)), max_tokens=1))
    hits_before = scheduler.stats().prefix.num_hit_tokens
    run_one(scheduler, runner, make_request("new-again", prompt_token_ids=new, max_tokens=1))
    assert scheduler.stats().prefix.num_hit_tokens == hits_before + 4  # "new" survived, "old" was evicted
    run_one(scheduler, runner, make_request("old-again", prompt_token_ids=old, max_tokens=1))
    assert scheduler.stats().prefix.num_hit_tokens == hits_before + 4
    assert_no_leaks(scheduler)


def test_a_recomputed_request_hits_its_own_blocks() -> None:
    scheduler = make_scheduler(num_gpu_blocks=7, block_size=4, prefix_caching=True, preemption_mode="recompute",
                               min_resident_steps=0)
    requests = [make_request(f"r{i}", 9, max_tokens=10) for i in range(3)]
    run = step_until_done(scheduler, arrivals={0: requests})
    assert run.outputs == reference_outputs(requests)
    stats = scheduler.stats()
    assert stats.counters.num_recompute_preemptions > 0 and stats.prefix.num_hit_tokens > 0
    assert_no_leaks(scheduler)


def test_samples_share_the_prompt_and_draw_what_separate_seeded_requests_draw() -> None:
    scheduler = make_scheduler(num_gpu_blocks=16, block_size=4, prefix_caching=True, max_num_seqs=4)
    request = make_request("p", prompt_token_ids=PREFIX, max_tokens=5, n=4, seed=7)
    peak = [0]

    def watch(step: int, output: object) -> None:
        peak[0] = max(peak[0], scheduler.stats().num_used_gpu_blocks)

    run = step_until_done(scheduler, arrivals={0: [request]}, on_step=watch)
    assert run.outputs == reference_outputs([request])
    assert set(run.outputs) == {ParallelGroup.sample_id("p", i) for i in range(4)}
    assert len({tuple(tokens) for tokens in run.outputs.values()}) > 1  # different seeds, different samples
    assert any(step.copy_blocks for step in run.steps)  # the partial prompt block was copied on write
    # Separately, 4 requests of 10 + 5 tokens would hold 4 x 4 blocks; the samples share 2.
    assert peak[0] <= 2 + 4 * 2
    assert_no_leaks(scheduler)


def test_aborting_an_n_request_aborts_every_sample() -> None:
    scheduler = make_scheduler(num_gpu_blocks=16, block_size=4, max_num_seqs=4)
    runner = ScriptedModelRunner(scheduler.block_manager)
    scheduler.add_request(make_request("p", prompt_token_ids=PREFIX, max_tokens=20, n=3, seed=1))
    for _ in range(4):
        output = scheduler.schedule()
        scheduler.update(output, runner.execute(output))
    assert scheduler.is_live("p") and scheduler.get_request("p") is None  # forked
    scheduler.finish_request("p", RequestStatus.FINISHED_ABORTED)
    finished = scheduler.take_finished()
    assert sorted(r.request_id for r in finished) == [ParallelGroup.sample_id("p", i) for i in range(3)]
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in finished)
    assert not scheduler.is_live("p")
    assert_no_leaks(scheduler)


def test_an_n_request_with_a_one_token_prompt_forks_at_once() -> None:
    scheduler = make_scheduler(num_gpu_blocks=8, block_size=4, max_num_seqs=2)
    request = make_request("one", prompt_token_ids=[5], max_tokens=3, n=2, seed=3)
    run = step_until_done(scheduler, arrivals={0: [request]})
    assert run.outputs == reference_outputs([request])
    assert_no_leaks(scheduler)


def test_requests_arriving_together_compute_a_shared_prefix_once() -> None:
    """The first request admitted computes the shared blocks; the others wait one step (while
    that prefill is scheduled) and then take them from the cache instead of computing them too."""
    scheduler = make_scheduler(num_gpu_blocks=32, block_size=4, prefix_caching=True)
    runner = ScriptedModelRunner(scheduler.block_manager)
    requests = [make_request(f"r{i}", prompt_token_ids=PREFIX + [i, i + 1], max_tokens=2) for i in range(3)]
    unrelated = make_request("other", prompt_token_ids=[41, 42, 43, 44, 45], max_tokens=2)
    run = step_until_done(scheduler, runner, arrivals={0: [*requests, unrelated]})
    assert run.outputs == reference_outputs([*requests, unrelated])
    first_step = {chunk.request_id for chunk in run.steps[0].chunks}
    assert first_step == {"r0", "other"}  # a request that shares nothing is not held back
    assert scheduler.stats().prefix.num_hit_tokens == 2 * 8  # r1 and r2 hit both full blocks
    assert_no_leaks(scheduler)


def test_a_request_waits_for_a_shared_prefill_only_while_it_is_scheduled() -> None:
    """A prefill longer than the step budget keeps its followers waiting chunk by chunk; each
    later admission starts after the blocks registered so far."""
    scheduler = make_scheduler(num_gpu_blocks=32, block_size=4, prefix_caching=True, max_num_batched_tokens=4,
                               max_prefill_chunk=4)
    runner = ScriptedModelRunner(scheduler.block_manager)
    first = make_request("a", prompt_token_ids=PREFIX + [1], max_tokens=2)
    second = make_request("b", prompt_token_ids=PREFIX + [2], max_tokens=2)
    run = step_until_done(scheduler, runner, arrivals={0: [first, second]})
    assert run.outputs == reference_outputs([first, second])
    assert scheduler.stats().prefix.num_hit_tokens == 8
