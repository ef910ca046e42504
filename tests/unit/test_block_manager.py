"""BlockManager: exact free-list order, swap mappings, running out as a return value, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.errors import InvariantError
from tokenmill.engine.kv.block_manager import BlockManager


def test_allocate_takes_blocks_in_free_list_order() -> None:
    manager = BlockManager(num_gpu_blocks=8, num_cpu_blocks=4, block_size=4)
    assert manager.allocate("a", 5) == [0, 1]
    assert manager.allocate("b", 4) == [2]
    assert manager.get_block_ids("a") == [0, 1]
    assert manager.num_free_gpu_blocks == 5
    manager.check_invariants()


def test_freed_blocks_are_reused_first_in_table_order() -> None:
    manager = BlockManager(num_gpu_blocks=4, num_cpu_blocks=0, block_size=2)
    manager.allocate("a", 4)  # blocks 0, 1
    manager.allocate("b", 2)  # block 2
    manager.free("a")
    assert manager.allocate("c", 6) == [0, 1, 3]
    manager.check_invariants()


def test_append_slots_grows_only_when_a_block_boundary_is_crossed() -> None:
    manager = BlockManager(num_gpu_blocks=4, num_cpu_blocks=0, block_size=4)
    manager.allocate("a", 3)
    assert manager.append_slots("a", 4) == []
    assert manager.append_slots("a", 5) == [1]
    assert manager.get_block_ids("a") == [0, 1]
    assert manager.num_new_blocks("a", 13) == 2
    assert manager.can_append_slots("a", 16) and not manager.can_append_slots("a", 17)


def test_running_out_is_a_return_value_and_changes_nothing() -> None:
    manager = BlockManager(num_gpu_blocks=2, num_cpu_blocks=1, block_size=4)
    assert not manager.can_allocate(9)
    assert manager.allocate("a", 9) is None
    assert manager.get_block_ids("a") == []
    manager.allocate("a", 8)
    assert manager.append_slots("a", 9) is None
    assert manager.get_block_ids("a") == [0, 1]
    assert not manager.can_swap_out("a")
    assert manager.swap_out("a") is None  # host pool has 1 block, needs 2
    assert manager.get_block_ids("a") == [0, 1]
    manager.check_invariants()


def test_can_allocate_respects_reserved_blocks() -> None:
    manager = BlockManager(num_gpu_blocks=4, num_cpu_blocks=0, block_size=4)
    assert manager.can_allocate(8, num_reserved_blocks=2)
    assert not manager.can_allocate(8, num_reserved_blocks=3)


def test_swap_out_then_in_returns_exact_pairs_and_frees_the_source_pool() -> None:
    manager = BlockManager(num_gpu_blocks=6, num_cpu_blocks=4, block_size=4)
    manager.allocate("x", 4)  # block 0 (keeps ids below from being trivial)
    manager.allocate("a", 12)  # blocks 1, 2, 3
    manager.allocate("y", 1)  # block 4
    assert manager.swap_out("a") == [(1, 0), (2, 1), (3, 2)]
    assert manager.get_block_ids("a") == [] and manager.get_host_block_ids("a") == [0, 1, 2]
    assert manager.num_free_gpu_blocks == 4 and manager.num_free_cpu_blocks == 1
    manager.check_invariants()
    manager.free("x")
    # free list is now [0, 1, 2, 3, 5]: the table comes back on different device blocks
    assert manager.swap_in("a") == [(0, 0), (1, 1), (2, 2)]
    assert manager.get_block_ids("a") == [0, 1, 2] and manager.get_host_block_ids("a") == []
    assert manager.num_free_cpu_blocks == 4
    manager.check_invariants()


def test_swap_in_needs_room_on_the_device() -> None:
    manager = BlockManager(num_gpu_blocks=2, num_cpu_blocks=2, block_size=1)
    manager.allocate("a", 2)
    manager.swap_out("a")
    manager.allocate("b", 1)
    assert not manager.can_swap_in("a")
    assert manager.swap_in("a") is None
    assert manager.get_host_block_ids("a") == [0, 1]
    assert manager.can_swap_in("a", num_reserved_blocks=0) is False
    manager.free("b")
    assert manager.can_swap_in("a") and not manager.can_swap_in("a", num_reserved_blocks=1)


def test_free_releases_both_pools_and_is_idempotent() -> None:
    manager = BlockManager(num_gpu_blocks=4, num_cpu_blocks=4, block_size=2)
    manager.allocate("a", 4)
    manager.swap_out("a")
    manager.free("a")
    manager.free("a")
    manager.free("never-seen")
    assert manager.num_free_gpu_blocks == 4 and manager.num_free_cpu_blocks == 4
    manager.check_invariants()


def test_misuse_raises_invariant_error() -> None:
    manager = BlockManager(num_gpu_blocks=4, num_cpu_blocks=4, block_size=2)
    manager.allocate("a", 2)
    with pytest.raises(InvariantError):
        manager.allocate("a", 2)
    manager.swap_out("a")
    with pytest.raises(InvariantError):
        manager.append_slots("a", 4)
    with pytest.raises(ValueError):
        BlockManager(num_gpu_blocks=1, num_cpu_blocks=0, block_size=0)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda m: m._gpu.ref_counts.__setitem__(3, -1),  # negative ref count
        lambda m: m._gpu.free_block_ids.append(0),  # owned and free
        lambda m: m._gpu.free_block_ids.popleft(),  # leaked: neither free nor owned
        lambda m: m._gpu_tables.__setitem__("b", [0]),  # owned twice, ref count says 1
        lambda m: m._cpu_tables.__setitem__("a", []),  # owns tables in both pools
    ],
)
def test_check_invariants_catches_corruption(corrupt) -> None:  # type: ignore[no-untyped-def]
    manager = BlockManager(num_gpu_blocks=4, num_cpu_blocks=2, block_size=2)
    manager.allocate("a", 3)
    manager.check_invariants()
    corrupt(manager)
    with pytest.raises(InvariantError):
        manager.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_decoding_batch_grows_as_each_request_would_alone(data: st.DataObject) -> None:
    """``blocks_for_decodes`` / ``grow_for_decodes`` of its needing slots (the steady state's one pass) against the
    per-request calls they replace (``num_new_blocks`` + ``num_copies_on_write``, then ``copy_on_write`` +
    ``append_slots``): the same count, the same copies, the same tables and free blocks after, whatever the
    positions, shared blocks (forks) and full blocks; growing every slot does what growing the needing ones does."""
    block_size = data.draw(st.integers(1, 4))
    managers = [BlockManager(256, 0, block_size), BlockManager(256, 0, block_size)]
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=5))
    forks = data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=3))
    slots = []
    for manager in managers:
        for index, num_tokens in enumerate(lengths):
            assert manager.allocate(f"r{index}", num_tokens) is not None
        for number, parent in enumerate(forks):
            manager.fork(f"r{parent}", f"f{number}")
    ids = [f"r{index}" for index in range(len(lengths))] + [f"f{number}" for number in range(len(forks))]
    num_tokens_of = lengths + [lengths[parent] for parent in forks]
    for request_id, num_tokens in zip(ids, num_tokens_of):
        # NOTE: a decode writes at its last computed position or the next one (a table that ends at a block boundary)
        slots.append((request_id, num_tokens - 1 + data.draw(st.integers(0, 1))))
    batch, alone = managers
    expected = sum(alone.num_new_blocks(rid, position + 1) + alone.num_copies_on_write(rid, position)
                   for rid, position in slots)
    num_blocks, needing = batch.blocks_for_decodes(slots)
    assert num_blocks == expected
    assert needing == [(rid, position) for rid, position in slots
                       if alone.num_new_blocks(rid, position + 1) + alone.num_copies_on_write(rid, position)]
    copies = batch.grow_for_decodes(needing if data.draw(st.booleans()) else slots)
    expected_copies = []
    for request_id, position in slots:
        for source, destination in alone.copy_on_write(request_id, position) or []:
            expected_copies.append((request_id, position, source, destination))
        assert alone.append_slots(request_id, position + 1) is not None
    assert copies == expected_copies
    assert [batch.get_block_ids(rid) for rid in ids] == [alone.get_block_ids(rid) for rid in ids]
    assert batch.num_free_gpu_blocks == alone.num_free_gpu_blocks
    batch.check_invariants()


def test_growing_a_batch_past_the_free_blocks_is_a_caller_bug() -> None:
    manager = BlockManager(2, 0, 2)
    manager.allocate("a", 2)
    manager.allocate("b", 2)
    slots = [("a", 2), ("b", 2)]
    assert manager.blocks_for_decodes(slots) == (2, slots) and 2 > manager.num_free_gpu_blocks
    with pytest.raises(InvariantError, match="after room was checked"):
        manager.grow_for_decodes(slots)
