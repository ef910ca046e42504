"""ops/bench/throughput.py's deadline (``--run-deadline-s``): static batches stop before one that would end past it
(the first always runs), and a partial run's useful tokens are those it made, each request's up to its ask."""

from __future__ import annotations

import argparse

from ops.bench.throughput import _finish, speedup_targets, time_boxed_batches
from ops.bench.workload import WorkItem


def items(count: int, max_tokens: int = 10) -> list[WorkItem]:
    return [WorkItem(i, "", [1, 2, 3], max_tokens) for i in range(count)]


class Clock:
    """Each batch takes ``batch_s`` of this clock."""

    def __init__(self, batch_s: float) -> None:
        self.now, self.batch_s = 0.0, batch_s

    def __call__(self) -> float:
        return self.now


def test_static_batches_stop_before_one_that_would_end_past_the_deadline() -> None:
    clock = Clock(10.0)

    def generate(batch: list[WorkItem]) -> list[int]:
        clock.now += clock.batch_s
        return [item.max_tokens for item in batch]

    batches = [items(2), items(2), items(2), items(2)]
    produced, finished, elapsed = time_boxed_batches(batches, generate, deadline=25.0, clock=clock)
    assert finished == [True] * 4 + [False] * 4 and produced == [10] * 4 + [0] * 4 and elapsed == 20.0
    clock.now = 0.0
    produced, finished, elapsed = time_boxed_batches(batches, generate, deadline=1.0, clock=clock)
    assert finished == [True] * 2 + [False] * 6 and elapsed == 10.0  # the first batch always runs
    clock.now = 0.0
    assert all(time_boxed_batches(batches, generate, deadline=None, clock=clock)[1])


def test_a_partial_run_counts_what_it_made() -> None:
    work = items(4)
    whole = _finish({}, work, [10, 10, 10, 10], 2.0)
    assert (whole["useful_tokens"], whole["partial"], whole["exact_lengths"]) == (40, False, True)
    partial = _finish({}, work, [10, 7, 12, -1], 2.0, [True, False, False, False])
    assert partial["useful_tokens"] == 10 + 7 + 10 + 0 and partial["tokens_per_s"] == 13.5
    assert (partial["partial"], partial["finished_requests"], partial["exact_lengths"]) == (True, 1, True)
    results = {"tokenmill": {**whole, "tokens_per_s": 60.0}, "hf_static16": {**partial, "tokens_per_s": 10.0}}
    targets = speedup_targets(results, argparse.Namespace(device="cuda"))
    assert targets["hf_static16"]["speedup"] == 6.0 and targets["hf_static16"]["partial"] == ["hf_static16"]
    assert "hf_cb" not in targets  # not measured
