"""Automatic prefix caching: an index of full device blocks by their content, so a request whose
prompt starts like an earlier one takes those blocks instead of computing them again.

Standard library only; never torch. A block is identified by a chain: the entry of the block
before it and its own token ids. Keys compare the tokens themselves (a dict of tuples), so a hit
can never return KV computed for other tokens; entry ids are never reused, so a chain broken by
an eviction never matches again::

    prompt:   [ t0 .. t15 | t16 .. t31 | t32 .. t40 ]          (block_size 16)
    keys:     (ROOT, t0..t15) -> e1   (e1, t16..t31) -> e2       (partial blocks are never cached)

Freed blocks whose content is indexed stay cached in their pool (least recently used first,
see engine/kv/block_pool.py) until the pool needs them. The index lives with one engine: the
model, dtype and block size never change under it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.engine.errors import InvariantError

ROOT = 0  # the parent entry id of a sequence's first block
_Key = tuple[int, tuple[int, ...]]


@dataclass
class PrefixStats:
    """Counters since the engine started."""

    num_query_tokens: int = 0  # prompt tokens looked up at admission
    num_hit_tokens: int = 0  # of those, found in the cache (not computed again)

    @property
    def hit_ratio(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class PrefixCache:
    """The index of cached full blocks of one device pool: the pool's ``index`` (handed to
    ``BlockManager(..., gpu_index=)``), which keeps freed indexed blocks cached and tells this index
    when it reuses one.

    Args:
        block_size: tokens per block, the pool's.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.stats = PrefixStats()
        self._key_to_entry: dict[_Key, tuple[int, int]] = {}  # key -> (entry id, block id)
        self._block_to_key: dict[int, _Key] = {}
        self._entry_ids = itertools.count(ROOT + 1)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is indexed (in use or evictable)."""
        return len(self._block_to_key)

    def is_registered(self, block_id: int) -> bool:
        return block_id in self._block_to_key

    def forget(self, block_id: int) -> None:
        key = self._block_to_key.pop(block_id)
        del self._key_to_entry[key]

    def match(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """The longest indexed run of full blocks ``token_ids`` starts with.

        At least one token is always left out, so the step that computes the rest produces the
        logits to sample from.

        Returns:
            ``(block ids, entry ids)`` of the hit, in order (both empty on a miss).
        """
        block_ids: list[int] = []
        entry_ids: list[int] = []
        parent = ROOT
        for start in range(0, len(token_ids) - 1 - self.block_size + 1, self.block_size):
            hit = self._key_to_entry.get((parent, tuple(token_ids[start:start + self.block_size])))
            if hit is None:
                break
            parent, block_id = hit
            entry_ids.append(parent)
            block_ids.append(block_id)
        return block_ids, entry_ids

    def next_key(self, token_ids: list[int], entry_ids: list[int], num_tokens: int) -> _Key | None:
        """The key of the block after the ``entry_ids`` chain, if it lies within ``num_tokens`` tokens.

        For a request computing its prefill (``num_tokens``: its prompt) this is the block it
        registers next; for a waiting one (``num_tokens``: what :meth:`match` may hit) the block
        it would take from the cache once someone registers it.
        """
        start = len(entry_ids) * self.block_size
        if start + self.block_size > num_tokens:
            return None
        return (entry_ids[-1] if entry_ids else ROOT, tuple(token_ids[start:start + self.block_size]))

    def count_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.num_query_tokens += num_query_tokens
        self.stats.num_hit_tokens += num_hit_tokens

    def register(self, token_ids: Sequence[int], block_ids: list[int], entry_ids: list[int],
                 num_computed_tokens: int, first_token: int = 0) -> list[int]:
        """Index the request's full blocks computed since the last call; extends ``entry_ids``.

        Args:
            token_ids: the request's tokens (prompt and output) from position ``first_token`` on.
            block_ids: its device block table.
            entry_ids: the entry ids of its leading blocks found or registered so far (updated).
            num_computed_tokens: tokens whose KV is in those blocks.
            first_token: the position of ``token_ids[0]``, at most the first block not in ``entry_ids``: a decoding
                request passes the tokens of its newly filled block only, not its whole context.

        Returns:
            The table indexes of the blocks it indexed (not those whose content was indexed already).

        NOTE: a block whose content another block already holds is not indexed (the two stay
        separate copies); the chain goes on through the existing entry.
        """
        num_full = min(num_computed_tokens // self.block_size, len(block_ids))
        indexed = []
        for index in range(len(entry_ids), num_full):
            start = index * self.block_size - first_token
            parent = entry_ids[-1] if entry_ids else ROOT
            key = (parent, tuple(token_ids[start:start + self.block_size]))
            existing = self._key_to_entry.get(key)
            if existing is not None:
                entry_ids.append(existing[0])
                continue
            block_id = block_ids[index]
            if block_id in self._block_to_key:  # NOTE: cannot happen: full blocks are written once
                raise InvariantError(f"block {block_id} indexed twice")
            entry_id = next(self._entry_ids)
            self._key_to_entry[key] = (entry_id, block_id)
            self._block_to_key[block_id] = key
            entry_ids.append(entry_id)
            indexed.append(index)
        return indexed

    def check_invariants(self) -> None:
        """Raise InvariantError unless the two maps mirror each other."""
        if len(self._key_to_entry) != len(self._block_to_key):
            raise InvariantError("prefix index maps differ in size")
        for key, (_, block_id) in self._key_to_entry.items():
            if self._block_to_key.get(block_id) != key:
                raise InvariantError(f"prefix index: block {block_id} and its key disagree")
