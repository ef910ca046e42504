"""One pool of fixed-size KV blocks: free blocks, reference counts, and the free blocks that still
hold reusable (cached) KV, evicted least recently used first. Standard library only; never torch.

Every block is in exactly one state::

    free      ref 0, no reusable content          in free_block_ids
    cached    ref 0, content known to the index    in cached_block_ids (LRU order), reusable by a hit
    used      ref >= 1                             owned by ref-count many block tables
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

from tokenmill.engine.errors import InvariantError


class BlockIndex(Protocol):
    """What the pool asks of a content index (the prefix cache)."""

    def is_registered(self, block_id: int) -> bool:
        """Whether the block's content is in the index (a released block then stays cached)."""

    def forget(self, block_id: int) -> None:
        """The block is being reused for other content: drop it from the index."""


class BlockPool:
    """Fixed-size blocks with reference counts.

    Args:
        name: what errors call it (``gpu``, ``cpu``).
        num_blocks: its size.
        index: the content index of its blocks (the prefix cache): a released block it holds stays cached, and a
            cached block taken for other content is forgotten by it. None: a released block is free.

    NOTE: allocation pops from the front and release pushes back to the front, so the most
    recently freed blocks are reused first and the blocks ever touched stay as few as the
    peak demand: on CPU the pools are lazily committed memory, so resident memory follows
    what is used, not what is configured. Cached blocks are taken only when no free block is
    left. The order is deterministic (tests rely on it).
    """

    def __init__(self, name: str, num_blocks: int, index: BlockIndex | None = None) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.cached_block_ids: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.ref_counts = [0] * num_blocks
        self.index = index  # the content index of its blocks (a prefix cache); None: freed blocks are just free

    @property
    def num_free_blocks(self) -> int:
        """Blocks a ``take`` can have: free ones and evictable cached ones."""
        return len(self.free_block_ids) + len(self.cached_block_ids)

    def take(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks (ref count 1 each): free ones first, then the least recently
        used cached ones (forgotten by the index); None if too few are left."""
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        for _ in range(num_blocks):
            if self.free_block_ids:
                block_ids.append(self.free_block_ids.popleft())
            else:
                block_id, _ = self.cached_block_ids.popitem(last=False)
                if self.index is not None:
                    self.index.forget(block_id)
                block_ids.append(block_id)
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """One more reference to each block (a prefix hit, or a parallel sample's copy of a table);
        cached blocks become used again."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                if block_id not in self.cached_block_ids:
                    raise InvariantError(f"{self.name} block {block_id} shared while free")
                del self.cached_block_ids[block_id]
            self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; at zero a block is cached (content in the index) or free."""
        for block_id in reversed(block_ids):  # reversed: a re-take gets them back in table order
            if self.ref_counts[block_id] <= 0:
                raise InvariantError(f"{self.name} block {block_id} released with ref count 0")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.index is not None and self.index.is_registered(block_id):
                    self.cached_block_ids[block_id] = None  # most recently used last
                else:
                    self.free_block_ids.appendleft(block_id)

    def check(self, tables: dict[str, list[int]]) -> None:
        """Raise InvariantError unless states, ref counts and ``tables`` agree."""
        free, cached = set(self.free_block_ids), set(self.cached_block_ids)
        if len(free) != len(self.free_block_ids) or free & cached:
            raise InvariantError(f"{self.name}: a block is free twice, or free and cached")
        owners = [0] * self.num_blocks
        for request_id, block_ids in tables.items():
            if len(set(block_ids)) != len(block_ids):
                raise InvariantError(f"{self.name}: request {request_id} holds a block twice")
            for block_id in block_ids:
                owners[block_id] += 1
        for block_id, (ref_count, num_owners) in enumerate(zip(self.ref_counts, owners)):
            if ref_count != num_owners:
                raise InvariantError(f"{self.name} block {block_id}: ref count {ref_count} but {num_owners} owners")
            if (block_id in free or block_id in cached) == (ref_count > 0):
                raise InvariantError(f"{self.name} block {block_id}: free={block_id in free}, "
                                     f"cached={block_id in cached}, ref={ref_count}")
            if block_id in cached and (self.index is None or not self.index.is_registered(block_id)):
                raise InvariantError(f"{self.name} block {block_id} is cached but not in the index")
        num_used = sum(1 for ref_count in self.ref_counts if ref_count > 0)
        if num_used + len(free) + len(cached) != self.num_blocks:
            raise InvariantError(f"{self.name}: {num_used} used + {len(free)} free + {len(cached)} cached "
                                 f"!= {self.num_blocks}")
