"""Prompt lookup: the longest recent suffix of a request's tokens (prompt + output) that occurred
before in them, and what followed it there. Copy-heavy work -- rewriting, reformatting, extraction,
code edits -- repeats spans of its prompt, which this drafts for free.

Each request keeps an index of its n-grams (n-gram -> where its latest earlier occurrence ends),
grown by the tokens added since the last lookup, so a lookup costs O(new tokens x n range), not a
scan of the whole context. Standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One request's n-grams, for :meth:`propose`.

    Args:
        min_n: shortest n-gram indexed (a lookup may ask for longer ones only).
        max_n: longest suffix matched (tried first: a longer match predicts better).
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest indexed occurrence
        self._num_indexed = 0  # grams ending before this position are indexed

    def propose(self, token_ids: Sequence[int], num_tokens: int, min_n: int | None = None) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``token_ids`` (between ``min_n``, default the index's, and ``max_n`` long) that
        occurred before; [] if none.

        ``token_ids`` must extend the list of the previous call (a request's tokens only grow).
        """
        end = len(token_ids)
        # NOTE: grams ending at `end` (the suffix itself) are indexed on the next call, so the
        # lookup below finds only occurrences strictly before the suffix. One slice each for the new tokens
        # and for the suffix: ``token_ids`` may be a view (engine/core/request.py TokenView), slow to index.
        start = max(self._num_indexed, 1)
        if start < end:
            base = max(0, start - self.max_n)
            window = list(token_ids[base:end])
            for stop in range(start, end):
                for n in range(self.min_n, min(self.max_n, stop) + 1):
                    self._ends[tuple(window[stop - n - base:stop - base])] = stop
        self._num_indexed = max(self._num_indexed, end)
        if num_tokens <= 0:
            return []
        tail = list(token_ids[max(0, end - self.max_n):end])
        for n in range(min(self.max_n, end), max(self.min_n, min_n or 0) - 1, -1):
            found = self._ends.get(tuple(tail[len(tail) - n:]))
            if found is not None:
                return list(token_ids[found:found + num_tokens])
        return []
