"""Priority order, priority preemption, aging bound (ManualClock), starvation limit, hysteresis."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.unit.scheduler_helpers import (
    assert_no_leaks,
    make_request,
    make_scheduler,
    reference_outputs,
    step_until_done,
)
from tokenmill.engine.config import SchedulerConfig
from tokenmill.engine.core.preemption import PreemptionPolicy
from tokenmill.engine.core.request import PreemptionCause, Request, RequestStatus
from tokenmill.engine.core.request_queue import RequestQueues
from tokenmill.engine.core.scheduler_policy import (
    admission_key,
    choose_victim,
    effective_priority,
    room_victims,
    running_order_key,
    urgency_key,
)


def test_admission_follows_priority_then_arrival_then_seq_no() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    requests = [
        make_request("c", 2, max_tokens=1, priority=2),
        make_request("d", 2, max_tokens=1, priority=0, arrival_time_s=1.0),
        make_request("a", 2, max_tokens=1, priority=0),
        make_request("b", 2, max_tokens=1, priority=1),
        make_request("a2", 2, max_tokens=1, priority=0),  # same priority and arrival as a: seq_no decides
    ]
    run = step_until_done(scheduler, arrivals={0: requests})
    assert sorted(run.admitted_step, key=run.admitted_step.__getitem__) == ["a", "a2", "d", "b", "c"]
    assert_no_leaks(scheduler)


def test_policy_keys_are_a_total_order_and_swapped_resume_before_equal_new_admissions() -> None:
    waiting = make_request("w", priority=1)
    swapped = make_request("s", priority=1, arrival_time_s=5.0)
    swapped.status = RequestStatus.SWAPPED
    urgent = make_request("u", priority=0, arrival_time_s=9.0)
    for seq_no, request in enumerate((waiting, swapped, urgent)):
        request.seq_no = seq_no
    ordered = sorted([waiting, swapped, urgent], key=lambda r: admission_key(r, 0.0))
    assert [r.request_id for r in ordered] == ["u", "s", "w"]
    assert len({urgency_key(r, 0.0, 0.0) for r in ordered}) == 3


def test_memory_victim_choice_prefers_demoted_then_least_urgent_latest_arrival() -> None:
    early, late, urgent = (make_request("early", priority=3), make_request("late", priority=3, arrival_time_s=2.0),
                           make_request("urgent", priority=0, arrival_time_s=5.0))
    assert choose_victim([early, late, urgent], 0.0, 0.0) is late
    urgent.is_demoted = True
    assert choose_victim([early, late, urgent], 0.0, 0.0) is urgent
    assert choose_victim([], 0.0, 0.0) is None


def test_effective_priority_improves_one_level_per_aging_interval() -> None:
    request = make_request("a", priority=4)
    assert [effective_priority(request, now_s, 10.0) for now_s in (0.0, 9.9, 10.0, 25.0, 80.0)] == [4, 4, 3, 2, -4]
    assert effective_priority(request, 1e6, 0.0) == 4  # aging off


def _high_priority_stream(num_steps: int, period: int) -> dict[int, list[Request]]:
    return {step: [make_request(f"h{step}", 4, max_tokens=3, priority=0, arrival_time_s=float(step))]
            for step in range(0, num_steps, period)}


def test_aging_bound_admits_a_low_priority_request_under_a_high_priority_stream() -> None:
    """Bound: admitted by t_L + gap * aging_interval_s + the time for room to appear."""
    aging_interval_s, gap, t_low = 2.0, 5, 1.0
    arrivals = _high_priority_stream(num_steps=60, period=3)  # each takes 3 steps: the slot never idles
    low = make_request("low", 4, max_tokens=3, priority=gap, arrival_time_s=t_low)
    arrivals[1] = [low]
    scheduler = make_scheduler(max_num_seqs=1, aging_interval_s=aging_interval_s, min_resident_steps=1)
    run = step_until_done(scheduler, arrivals=arrivals, advance_s=1.0)
    room_s = 3.0  # one high-priority request's run (3 steps of 1 s) frees the only slot
    assert run.admitted_time_s["low"] <= t_low + gap * aging_interval_s + room_s
    assert run.admitted_time_s["low"] > t_low + (gap - 1) * aging_interval_s  # and not before aging got it there
    assert scheduler.stats().counters.num_preemptions == 0  # later arrivals never outrank it once admitted
    assert_no_leaks(scheduler)


def test_without_aging_the_low_priority_request_waits_for_the_stream_to_end() -> None:
    arrivals = _high_priority_stream(num_steps=60, period=3)
    arrivals[1] = [make_request("low", 4, max_tokens=3, priority=5, arrival_time_s=1.0)]
    scheduler = make_scheduler(max_num_seqs=1, aging_interval_s=0.0)
    run = step_until_done(scheduler, arrivals=arrivals, advance_s=1.0)
    assert run.admitted_step["low"] >= 60
    assert_no_leaks(scheduler)


def test_urgent_arrival_preempts_the_least_urgent_running_request() -> None:
    low = make_request("low", 4, max_tokens=8, priority=5)
    mid = make_request("mid", 4, max_tokens=8, priority=3)
    high = make_request("high", 4, max_tokens=2, priority=0, arrival_time_s=2.0)
    # at step 2, low and mid hold 2 blocks each: the pool of 4 is full
    scheduler = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, block_size=4, min_resident_steps=1)
    run = step_until_done(scheduler, arrivals={0: [low, mid], 2: [high]})
    assert run.steps[2].preempted_request_ids == ["low"]
    assert run.steps[2].chunks[-1].request_id == "high"  # admitted in the same step
    counters = scheduler.stats().counters
    assert counters.cause_to_num_preemptions[PreemptionCause.PRIORITY] == 1 and counters.num_swap_outs >= 1
    assert low.waiting_since_s == 0.0  # a PRIORITY victim keeps its aging credit
    assert run.outputs == reference_outputs([low, mid, high])
    assert_no_leaks(scheduler)


def test_no_priority_preemption_when_disabled_or_not_strictly_more_urgent() -> None:
    for enable, priority in ((False, 0), (True, 5)):
        low = make_request("low", 4, max_tokens=8, priority=5)
        other = make_request("other", 4, max_tokens=2, priority=priority, arrival_time_s=2.0)
        scheduler = make_scheduler(max_num_seqs=1, enable_priority_preemption=enable, min_resident_steps=0)
        run = step_until_done(scheduler, arrivals={0: [low], 2: [other]})
        assert scheduler.stats().counters.num_preemptions == 0
        assert run.admitted_step["other"] == 8  # only after low finished
        assert_no_leaks(scheduler)


def test_hysteresis_protects_a_just_admitted_request_for_min_resident_steps() -> None:
    low = make_request("low", 4, max_tokens=12, priority=5)
    high = make_request("high", 4, max_tokens=2, priority=0, arrival_time_s=1.0)
    high2 = make_request("high2", 4, max_tokens=2, priority=0, arrival_time_s=6.0)
    scheduler = make_scheduler(max_num_seqs=1, min_resident_steps=3, num_cpu_blocks=16)
    run = step_until_done(scheduler, arrivals={0: [low], 1: [high], 6: [high2]})
    preempted_at = [i for i, step in enumerate(run.steps) if step.preempted_request_ids]
    resumed_at = [i for i, step in enumerate(run.steps) if step.swap_in]
    # admitted at step 0: protected in steps 0, 1, 2; high waits from step 1 and wins at step 3
    assert preempted_at[0] == 3 and run.admitted_step["high"] == 3
    # high runs steps 3-4; low is resumed at step 5 and protected in steps 5-7, so high2
    # (waiting from step 6) gets in at step 8
    assert resumed_at[0] == 5
    assert preempted_at[1] == 8 and run.admitted_step["high2"] == 8
    assert run.outputs == reference_outputs([low, high, high2])
    assert_no_leaks(scheduler)


def test_starvation_limit_demotes_a_long_output_request_which_resumes_later() -> None:
    long = make_request("long", 4, max_tokens=20)
    short = make_request("short", 4, max_tokens=2, arrival_time_s=1.0)
    scheduler = make_scheduler(max_num_seqs=1, num_cpu_blocks=16, demote_after_decode_steps=3,
                               min_resident_steps=1)
    demoted_seen: list[int] = []

    def watch(step: int, output: object) -> None:
        if long.is_demoted:
            demoted_seen.append(step)

    run = step_until_done(scheduler, arrivals={0: [long], 1: [short]}, on_step=watch, advance_s=1.0)
    # long: prefill at step 0, decodes at steps 1-4 (4 > 3), so step 5 demotes and swaps it out
    assert run.steps[5].preempted_request_ids == ["long"] and run.steps[5].swap_out
    assert run.admitted_step["short"] == 5
    assert scheduler.stats().counters.cause_to_num_preemptions[PreemptionCause.STARVATION] == 1
    resumed = next(i for i, step in enumerate(run.steps) if step.swap_in)
    assert resumed == 7 and long.num_preemptions == 1 and not demoted_seen
    assert long.waiting_since_s == 5.0  # demoted: it ages again from the step it yielded
    assert run.outputs == reference_outputs([long, short])
    assert_no_leaks(scheduler)


def test_starvation_limit_is_off_at_zero() -> None:
    long = make_request("long", 4, max_tokens=20)
    short = make_request("short", 4, max_tokens=2, arrival_time_s=1.0)
    scheduler = make_scheduler(max_num_seqs=1, num_cpu_blocks=16, demote_after_decode_steps=0)
    run = step_until_done(scheduler, arrivals={0: [long], 1: [short]})
    assert scheduler.stats().counters.num_preemptions == 0 and run.admitted_step["short"] == 20
    assert_no_leaks(scheduler)


def test_memory_preemption_still_progresses_when_everyone_is_protected() -> None:
    requests = [make_request(f"r{i}", 4, max_tokens=12, priority=i) for i in range(3)]
    scheduler = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=0, block_size=4, min_resident_steps=100)
    run = step_until_done(scheduler, arrivals={0: requests})
    assert scheduler.stats().counters.cause_to_num_preemptions[PreemptionCause.MEMORY] > 0
    assert run.outputs == reference_outputs(requests)
    assert_no_leaks(scheduler)


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 500), st.floats(0, 500), st.booleans()), min_size=2,
                max_size=30),
       st.floats(0, 1000), st.sampled_from([0.0, 7.0, 30.0]))
def test_the_admission_order_is_effective_priority_order_at_any_clock_time(
        specs: list[tuple[int, float, float, bool]], later_s: float, aging_interval_s: float) -> None:
    requests = []
    for seq_no, (priority, arrival_s, waited_s, is_swapped) in enumerate(specs):
        request = make_request(f"r{seq_no}", priority=priority, arrival_time_s=arrival_s)
        request.seq_no, request.waiting_since_s = seq_no, arrival_s + waited_s
        request.status = RequestStatus.SWAPPED if is_swapped else RequestStatus.WAITING
        requests.append(request)
    now_s = max(r.waiting_since_s for r in requests) + later_s

    def aged(r: Request) -> tuple[int, int, float, int]:
        return (effective_priority(r, now_s, aging_interval_s), int(r.status is not RequestStatus.SWAPPED),
                r.arrival_time_s, r.seq_no)

    assert sorted(requests, key=lambda r: admission_key(r, aging_interval_s)) == sorted(requests, key=aged)


@settings(max_examples=400)
@example(running=[(1, 0.0, False), (2, 0.0, False)], priority=1, waiting_since_s=0.0, now_s=0.0, aging_interval_s=0.0,
         is_priority_preemption_on=True)  # NOTE: one level less urgent: a victim
@example(running=[(3, 50.0, False)], priority=3, waiting_since_s=0.0, now_s=60.0, aging_interval_s=7.5,
         is_priority_preemption_on=True)  # NOTE: aged less than the waiting request: a victim
@given(running=st.lists(st.tuples(st.integers(0, 4), st.floats(0.0, 100.0), st.integers(0, 3).map(lambda x: x == 0)),
                        max_size=8),
       priority=st.integers(0, 4), waiting_since_s=st.floats(0.0, 100.0), now_s=st.floats(0.0, 200.0),
       aging_interval_s=st.sampled_from([0.0, 1.0, 7.5, 30.0]), is_priority_preemption_on=st.booleans())
def test_the_quick_no_candidate_answer_never_hides_a_victim(
        running: list[tuple[int, float, bool]], priority: int, waiting_since_s: float, now_s: float,
        aging_interval_s: float, is_priority_preemption_on: bool) -> None:
    """``victims_for_room`` skips its scan when no running request is demoted and the least urgent one's running key
    says none is less urgent than the request: whenever the scan (``room_victims``) would find a candidate, the
    quick test says there may be one (aging started before or after now, demoted with its key from before)."""
    config = SchedulerConfig(aging_interval_s=aging_interval_s, enable_priority_preemption=is_priority_preemption_on)
    queues = RequestQueues(lambda r: admission_key(r, aging_interval_s),
                           running_key=lambda r: running_order_key(r, aging_interval_s))
    for index, (running_priority, running_since_s, is_demoted) in enumerate(running):
        request = make_request(f"r{index}", priority=running_priority)
        request.waiting_since_s, request.seq_no = running_since_s, index
        queues.add_running(request, 0)
        request.is_demoted = is_demoted  # NOTE: as the scheduler demotes: its running key stays
    waiting = make_request("w", priority=priority)
    waiting.waiting_since_s = waiting_since_s
    policy = PreemptionPolicy(config, block_manager=None, queues=queues)  # type: ignore[arg-type]  # NOTE: unread
    candidates = room_victims(queues.running, waiting, now_s, aging_interval_s,
                              enable_priority_preemption=is_priority_preemption_on)
    if candidates:
        assert policy._may_yield_to(waiting, now_s)
