"""ops/bench/worker_opcodes.py's arithmetic: counts per result by thread, periodic work kept apart."""

from __future__ import annotations

from ops.bench.worker_opcodes import _thread_group, summarize


def test_counts_are_per_result_by_thread_and_periodic_work_stays_out_of_the_functions() -> None:
    rows = [["MainThread", "per_result", "engine/a.py:f", 300],
            ["MainThread", "periodic", "engine/engine.py:stats", 50],
            ["tm-reader", "per_result", "worker/r.py:g", 100],
            ["MainThread", "per_result", "engine/b.py:h", 100]]
    summary = summarize(rows, num_results=100, speculation="off")
    assert summary["threads"] == {"MainThread": {"per_result": 4.0, "periodic": 0.5},
                                  "tm-reader": {"per_result": 1.0, "periodic": 0.0}}
    assert summary["per_result"] == 5.0
    assert summary["functions"] == [["MainThread", "engine/a.py:f", 3.0], ["tm-reader", "worker/r.py:g", 1.0],
                                    ["MainThread", "engine/b.py:h", 1.0]]


def test_a_pool_thread_counts_under_its_pool() -> None:
    assert [_thread_group(name) for name in ("tm-prepare_0", "tm-prepare_12", "MainThread", "tm-reader")] == [
        "tm-prepare", "tm-prepare", "MainThread", "tm-reader"]
