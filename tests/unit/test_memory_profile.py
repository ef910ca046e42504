"""The sizing arithmetic of the KV pool on CUDA (engine/model/memory_profile.py): the largest step the
scheduler can make, and the pool left of ``gpu_memory_utilization`` of the device's total memory once the memory in
use and the profiled steps' memory are set aside."""

from __future__ import annotations

import pytest

from tokenmill.engine.config import SchedulerConfig
from tokenmill.engine.model.memory_profile import StepProfile, kv_pool_bytes, largest_step

GIB = 1 << 30


@pytest.mark.parametrize(("budgets", "expected_sum", "expected_seqs"), [
    (dict(max_num_batched_tokens=2048, max_num_seqs=64, max_prefill_chunk=512), 2048, 64),
    (dict(max_num_batched_tokens=4096, max_num_seqs=256, max_prefill_chunk=4096), 4096, 256),
    (dict(max_num_batched_tokens=64, max_num_seqs=256, max_prefill_chunk=64), 64, 64),  # one token each
    (dict(max_num_batched_tokens=2048, max_num_seqs=2, max_prefill_chunk=512), 1024, 2),  # chunks cap the step
    (dict(max_num_batched_tokens=8, max_num_seqs=1, max_prefill_chunk=8), 8, 1),
])
def test_largest_step_fills_every_budget(budgets: dict[str, int], expected_sum: int, expected_seqs: int) -> None:
    config = SchedulerConfig(**budgets)
    lengths = largest_step(config)
    assert sum(lengths) == expected_sum and len(lengths) == expected_seqs
    assert all(1 <= n <= config.max_prefill_chunk for n in lengths)
    assert lengths[0] == min(config.max_prefill_chunk, expected_sum - (expected_seqs - 1))  # the longest chunk


def test_pool_is_the_share_of_total_memory_left_by_what_is_in_use_and_the_steps() -> None:
    """As vLLM reads ``gpu_memory_utilization``: a fraction of the device's total memory, of which the memory in
    use already (weights, context, other processes) and the steps' peaks are taken first."""
    eager = [StepProfile("largest step", [2048], 3 * GIB, captured=False)]
    assert kv_pool_bytes(100 * GIB, 100 * GIB, 0.9, eager) == 87 * GIB
    assert kv_pool_bytes(84 * GIB, 100 * GIB, 0.9, eager) == 71 * GIB  # 16 GiB of weights in use
    assert kv_pool_bytes(84 * GIB, 100 * GIB, 0.9, eager) != int(84 * GIB * 0.9) - 3 * GIB  # not a share of free
    graphs = StepProfile("largest decode bucket", [1] * 64, 1 * GIB, captured=True)
    assert kv_pool_bytes(100 * GIB, 100 * GIB, 0.9, [*eager, graphs]) == 86 * GIB  # a graph's memory is its own
    smaller = StepProfile("another eager step", [512], 2 * GIB, captured=False)
    assert kv_pool_bytes(100 * GIB, 100 * GIB, 0.9, [*eager, smaller]) == 87 * GIB  # eager steps reuse memory
    assert kv_pool_bytes(100 * GIB, 100 * GIB, 0.9, []) == 90 * GIB
    assert kv_pool_bytes(40 * GIB, 100 * GIB, 0.5, eager) < 0  # what is in use takes the share: no pool
