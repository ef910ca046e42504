"""The sizing arithmetic of the KV pool on CUDA (engine/model/memory_profile.py): the largest step the
scheduler can make, and the pool left once the profiled steps' memory is set aside."""

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


def test_pool_is_the_share_of_free_memory_left_by_the_steps() -> None:
    eager = [StepProfile("largest step", [2048], 3 * GIB, captured=False)]
    assert kv_pool_bytes(100 * GIB, 0.9, eager) == 87 * GIB
    graphs = StepProfile("largest decode bucket", [1] * 64, 1 * GIB, captured=True)
    assert kv_pool_bytes(100 * GIB, 0.9, [*eager, graphs]) == 86 * GIB  # a graph's memory is its own
    smaller = StepProfile("another eager step", [512], 2 * GIB, captured=False)
    assert kv_pool_bytes(100 * GIB, 0.9, [*eager, smaller]) == 87 * GIB  # eager steps reuse one another's
    assert kv_pool_bytes(100 * GIB, 0.9, []) == 90 * GIB
    assert kv_pool_bytes(GIB, 0.5, eager) < 0  # the steps alone take the share: no pool
