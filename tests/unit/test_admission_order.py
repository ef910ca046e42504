"""The queues keep the waiting and swapped requests in admission order as they come and go
(``RequestQueues.in_admission_order``, first come, first served): the same order as sorting them by
``admission_key`` each step (the plain rule), under arrivals, admissions, preemptions (to waiting or swapped, aging
restarted), finishes, and admissions made while the order is being read."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.scheduler_helpers import make_request
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.request_queue import RequestQueues
from tokenmill.engine.core.scheduler_policy import admission_key
from tokenmill.engine.kv.block_manager import BlockManager

AGING_S = 10.0
OPERATIONS = st.lists(st.tuples(st.sampled_from(["add", "admit", "preempt", "swap", "finish", "read"]),
                                st.integers(0, 1000), st.integers(-2, 2)), max_size=120)


def _key(request: Request) -> object:
    return admission_key(request, AGING_S)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPERATIONS)
def test_the_kept_order_is_the_sorted_order(operations: list[tuple[str, int, int]]) -> None:
    queues = RequestQueues(admission_key=_key)
    blocks = BlockManager(num_gpu_blocks=4, num_cpu_blocks=4, block_size=16)
    next_seq_no, clock = 0, 0.0
    for operation, pick, priority in operations:
        clock += 1.0
        waiting_or_swapped = queues.swapped + queues.waiting
        if operation == "add":
            request = make_request(f"r{next_seq_no}", priority=priority, arrival_time_s=clock)
            queues.add(request)
            request.seq_no, request.waiting_since_s = next_seq_no, clock - pick % 50
            next_seq_no += 1
        elif operation == "admit" and waiting_or_swapped:
            queues.move(waiting_or_swapped[pick % len(waiting_or_swapped)], RequestStatus.RUNNING)
        elif operation in ("preempt", "swap") and queues.running:
            victim = queues.running[pick % len(queues.running)]
            queues.move(victim, RequestStatus.WAITING if operation == "preempt" else RequestStatus.SWAPPED)
            victim.waiting_since_s = clock  # NOTE: as the scheduler restarts a starved victim's aging, after the move
        elif operation == "finish" and queues.requests:
            queues.remove(sorted(queues.requests)[pick % len(queues.requests)])
        elif operation == "read":
            expected = sorted(queues.swapped + queues.waiting, key=_key)
            read = []
            for request in queues.in_admission_order():
                read.append(request)
                if len(read) % 3 == pick % 3:  # NOTE: admitting or finishing the one just read, mid-read
                    if pick % 2:
                        queues.move(request, RequestStatus.RUNNING)
                    else:
                        queues.remove(request.request_id)
            assert read == expected
        queues.check_invariants(blocks, max_num_seqs=10_000)
    assert list(queues.in_admission_order()) == sorted(queues.swapped + queues.waiting, key=_key)


def test_a_request_preempted_while_the_order_is_read_comes_next_time() -> None:
    queues = RequestQueues(admission_key=_key)
    first, second, running = (make_request(f"r{i}", arrival_time_s=float(i)) for i in range(3))
    for seq_no, request in enumerate((first, second, running)):
        queues.add(request)
        request.seq_no = seq_no
    queues.move(running, RequestStatus.RUNNING)
    read = []
    for request in queues.in_admission_order():
        read.append(request)
        if request is first:
            queues.move(running, RequestStatus.WAITING)  # NOTE: as _make_room preempts for the one being placed
    assert read == [first, second]
    assert list(queues.in_admission_order()) == [first, second, running]
