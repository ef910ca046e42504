"""Paged KV block accounting: a device pool, a host (swap) pool, per-request block tables.

Owns block ids and reference counts only (no tensors). Standard library only; never torch.
"""

from __future__ import annotations

from tokenmill.engine.errors import InvariantError
from tokenmill.engine.kv.block_pool import BlockIndex, BlockPool

# A block table maps token positions to blocks of ``block_size`` slots:
#
#   position:  0 1 2 3 | 4 5 6 7 | 8 9 . .        (block_size = 4)
#   table:     [  b7   ,   b2    ,   b5   ]       -> position p lives in table[p // 4], slot p % 4
#
# Tables only grow (append_slots) or are released whole (free / swap_out / swap_in). Device
# blocks may be shared by several tables (prefix-cache hits, parallel samples); a shared block
# is never written: copy_on_write gives a table its own copy first.


class BlockManager:
    """Device and host block pools with one block table per request.

    A request owns blocks in at most one pool at a time: device blocks while it is waiting
    to run or running, host blocks while it is swapped out. Running out of blocks is a
    return value (False / None), never an exception; misuse (e.g. allocating twice) raises
    InvariantError because it is a bug in the caller.
    """

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 gpu_index: BlockIndex | None = None) -> None:
        """Create both pools, all blocks free.

        Args:
            num_gpu_blocks: blocks in the device pool (>= 0).
            num_cpu_blocks: blocks in the host (swap) pool (>= 0).
            block_size: tokens per block (>= 1).
            gpu_index: the content index of the device pool's blocks (the prefix cache, of the same
                ``block_size``); None: no prefix caching.

        Raises:
            ValueError: a size is out of range.
        """
        if block_size < 1 or num_gpu_blocks < 0 or num_cpu_blocks < 0:
            raise ValueError("block_size must be >= 1 and pool sizes >= 0")
        self.block_size = block_size
        self.gpu_pool = BlockPool("gpu", num_gpu_blocks, gpu_index)
        self._gpu = self.gpu_pool
        self._cpu = BlockPool("cpu", num_cpu_blocks)
        self._gpu_tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}

    @property
    def num_gpu_blocks(self) -> int:
        return self._gpu.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self._cpu.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        return self._gpu.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self._cpu.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's device block table (a copy; empty if it owns no device blocks)."""
        return list(self._gpu_tables.get(request_id, ()))

    def block_table(self, request_id: str) -> list[int]:
        """The request's device block table itself, not a copy (a step's chunk must not cost the context).

        NOTE: read-only for the caller. A table grows into a new list (:meth:`append_slots`), so a step planned
        earlier and still running on the engine's device thread keeps the list it was given while the next step
        is planned ahead (engine/core/scheduler.py ``schedule_ahead``); in place it changes only while nothing
        runs (a shared block copied, drafts' blocks trimmed); finishing a request drops it whole.
        """
        return self._gpu_tables.get(request_id, [])

    def num_device_blocks(self, request_id: str) -> int:
        """How many device blocks the request's table holds (without copying it)."""
        return len(self._gpu_tables.get(request_id, ()))

    def get_host_block_ids(self, request_id: str) -> list[int]:
        """The request's host block table (a copy; empty if it is not swapped out)."""
        return list(self._cpu_tables.get(request_id, ()))

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        """Device blocks to add so the request's table covers ``num_tokens`` tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(self._gpu_tables.get(request_id, ())))

    def can_allocate(self, num_tokens: int, num_reserved_blocks: int = 0) -> bool:
        """Whether a new table for ``num_tokens`` tokens fits, leaving ``num_reserved_blocks`` free."""
        return self.num_blocks_for(num_tokens) + num_reserved_blocks <= self._gpu.num_free_blocks

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Create the request's device table covering ``num_tokens`` tokens.

        Returns:
            The new table, or None (nothing allocated) if too few device blocks are free.

        Raises:
            InvariantError: the request already owns blocks.
        """
        if request_id in self._gpu_tables or request_id in self._cpu_tables:
            raise InvariantError(f"request {request_id} already owns blocks")
        return self.append_slots(request_id, num_tokens)

    def share(self, request_id: str, block_ids: list[int]) -> None:
        """Start the request's device table with blocks other tables (or the prefix cache) hold.

        Raises:
            InvariantError: the request already owns blocks.
        """
        if request_id in self._gpu_tables or request_id in self._cpu_tables:
            raise InvariantError(f"request {request_id} already owns blocks")
        self._gpu.share(block_ids)
        self._gpu_tables[request_id] = list(block_ids)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` a table sharing every device block of ``parent_id``'s."""
        self.share(child_id, self._gpu_tables.get(parent_id, []))

    def num_exclusive_blocks(self, request_id: str) -> int:
        """Device blocks only this request holds: what preempting it frees."""
        return sum(1 for b in self._gpu_tables.get(request_id, []) if self._gpu.ref_counts[b] == 1)

    def num_unused(self, block_ids: list[int]) -> int:
        """How many of these blocks no table holds (cached ones: sharing them uses up free room)."""
        return sum(1 for b in block_ids if self._gpu.ref_counts[b] == 0)

    def num_copies_on_write(self, request_id: str, position: int) -> int:
        """Device blocks a write at ``position`` needs first (1 if that block is shared, else 0)."""
        table = self._gpu_tables.get(request_id, [])
        index = position // self.block_size
        return int(index < len(table) and self._gpu.ref_counts[table[index]] > 1)

    def copy_on_write(self, request_id: str, position: int) -> list[tuple[int, int]] | None:
        """Give the request its own copy of the shared block holding ``position``.

        Returns:
            ``[(source, destination)]`` device-block copies for the runner (empty when the block is
            not shared), or None (nothing changed) when no block is free.
        """
        if not self.num_copies_on_write(request_id, position):
            return []
        new = self._gpu.take(1)
        if new is None:
            return None
        table = self._gpu_tables[request_id]
        index = position // self.block_size
        source = table[index]
        table[index] = new[0]
        self._gpu.release([source])
        return [(source, new[0])]

    def blocks_for_decodes(self, slots: list[tuple[str, int]]) -> tuple[int, list[tuple[str, int]]]:
        """Device blocks that writing one token at each ``(request id, position)`` needs: a new block where the
        table ends before the position, a copy where the block holding it is shared. What :meth:`num_new_blocks`
        and :meth:`num_copies_on_write` sum to, in one pass over a decoding batch.

        Returns:
            The number of blocks, and the slots that need any, in order (a decoding batch's steady state: one in
            ``block_size`` steps each): :meth:`grow_for_decodes` of them alone does what it would of all.
        """
        tables, ref_counts, block_size = self._gpu_tables, self._gpu.ref_counts, self.block_size
        num_blocks = 0
        needing: list[tuple[str, int]] = []
        for slot in slots:
            table = tables.get(slot[0], ())
            index = slot[1] // block_size
            if index >= len(table):
                num_blocks += index + 1 - len(table)
                needing.append(slot)
            elif ref_counts[table[index]] > 1:
                num_blocks += 1
                needing.append(slot)
        return num_blocks, needing

    def grow_for_decodes(self, slots: list[tuple[str, int]]) -> list[tuple[str, int, int, int]]:
        """Make each table of ``slots`` ready for a token written at its position: :meth:`copy_on_write`, then
        :meth:`append_slots` to ``position + 1`` tokens, for each in order. The caller checked the room first
        (:meth:`blocks_for_decodes`, whose needing slots are all this needs).

        Returns:
            ``(request id, position, source, destination)`` for each shared block copied.

        Raises:
            InvariantError: the blocks ran out (the room was not checked).
        """
        tables, ref_counts, block_size = self._gpu_tables, self._gpu.ref_counts, self.block_size
        copies: list[tuple[str, int, int, int]] = []
        for request_id, position in slots:
            table = tables.get(request_id, ())
            index = position // block_size
            if index < len(table):
                if ref_counts[table[index]] <= 1:
                    continue  # NOTE: the steady state: its own block has the slot
                pairs = self.copy_on_write(request_id, position)
                if pairs is None:
                    raise InvariantError(f"no block to copy for {request_id} after room was checked")
                copies.extend((request_id, position, source, destination) for source, destination in pairs)
                continue
            if self.append_slots(request_id, position + 1) is None:
                raise InvariantError(f"no blocks for {request_id} after room was checked")
        return copies

    def can_append_slots(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's device table can grow to cover ``num_tokens`` tokens."""
        return self.num_new_blocks(request_id, num_tokens) <= self._gpu.num_free_blocks

    def append_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's device table (creating it if absent) to cover ``num_tokens`` tokens.

        Returns:
            The newly added block ids (possibly empty), or None (nothing allocated) if too few
            device blocks are free.

        Raises:
            InvariantError: the request is swapped out (its KV sits in the host pool).
        """
        if request_id in self._cpu_tables:
            raise InvariantError(f"request {request_id} is swapped out; swap it in first")
        new_block_ids = self._gpu.take(self.num_new_blocks(request_id, num_tokens))
        if new_block_ids is None:
            return None
        table = self._gpu_tables.get(request_id)
        if table is None or new_block_ids:
            # NOTE: a new list, not extend(): see block_table (one copy of the table per block_size tokens)
            self._gpu_tables[request_id] = (table or []) + new_block_ids
        return new_block_ids

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the device blocks past those ``num_tokens`` tokens need: the slots a draft took
        whose tokens the model rejected (none of them was indexed by the prefix cache)."""
        table = self._gpu_tables.get(request_id)
        keep = self.num_blocks_for(num_tokens)
        if table is not None and len(table) > keep:
            self._gpu.release(table[keep:])
            del table[keep:]

    def can_swap_out(self, request_id: str) -> bool:
        """Whether the request's device blocks can all be copied into free host blocks."""
        table = self._gpu_tables.get(request_id)
        return table is not None and len(table) <= self._cpu.num_free_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's table to the host pool and free its device blocks.

        Returns:
            ``(device_block_id, host_block_id)`` copies in table order for the runner, or None
            (nothing changed) if the request owns no device table or the host pool is too full.
        """
        if not self.can_swap_out(request_id):
            return None
        return self._move_table(request_id, self._gpu_tables, self._gpu, self._cpu_tables, self._cpu)

    def can_swap_in(self, request_id: str, num_reserved_blocks: int = 0) -> bool:
        """Whether the request's host blocks fit in free device blocks, leaving some reserved."""
        table = self._cpu_tables.get(request_id)
        return table is not None and len(table) + num_reserved_blocks <= self._gpu.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's table back to the device pool and free its host blocks.

        Returns:
            ``(host_block_id, device_block_id)`` copies in table order for the runner, or None
            (nothing changed) if the request is not swapped out or the device pool is too full.
        """
        if not self.can_swap_in(request_id):
            return None
        return self._move_table(request_id, self._cpu_tables, self._cpu, self._gpu_tables, self._gpu)

    @staticmethod
    def _move_table(request_id: str, source_tables: dict[str, list[int]], source_pool: BlockPool,
                    destination_tables: dict[str, list[int]], destination_pool: BlockPool) -> list[tuple[int, int]]:
        """Move the request's table from one pool to the other: ``(source, destination)`` block pairs.

        The caller has checked (``can_swap_out`` / ``can_swap_in``) that the destination has room.
        """
        source_block_ids = source_tables.pop(request_id)
        destination_block_ids = destination_pool.take(len(source_block_ids))
        assert destination_block_ids is not None  # the caller checked the room
        source_pool.release(source_block_ids)
        destination_tables[request_id] = destination_block_ids
        return list(zip(source_block_ids, destination_block_ids))

    def free(self, request_id: str) -> None:
        """Release whatever the request owns in either pool (a no-op if it owns nothing)."""
        self._gpu.release(self._gpu_tables.pop(request_id, []))
        self._cpu.release(self._cpu_tables.pop(request_id, []))

    def check_invariants(self) -> None:
        """Raise InvariantError unless both pools balance and every block has one clear owner.

        Checks per pool: ref counts >= 0 and equal to the number of tables holding the block,
        free + used == total, no block both free and owned, no duplicate on the free list;
        and no request owns tables in both pools.
        """
        self._gpu.check(self._gpu_tables)
        self._cpu.check(self._cpu_tables)
        both = self._gpu_tables.keys() & self._cpu_tables.keys()
        if both:
            raise InvariantError(f"requests own blocks in both pools: {sorted(both)}")
