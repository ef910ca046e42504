"""A pool of continuations seen in earlier outputs of one engine, shared by every request it serves:
rows of one bulk job or queue that fill the same template (JSON keys, boilerplate, a fixed answer
format) draft from each other. Suffix-decoding style, bounded in memory. Standard library only.

Each finished request adds, for every position of its output, the n-grams ending there (``min_n``..
``max_n`` tokens, reaching back into the prompt's tail) mapped to the tokens that followed them. A
lookup tries the request's longest suffix first. The newest continuation of an n-gram wins, and the
pool forgets its oldest n-grams once it holds ``capacity`` of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class SuffixPool:
    """Continuations of earlier outputs, keyed by the n-gram before them.

    Args:
        min_n: shortest n-gram matched.
        max_n: longest n-gram matched (tried first).
        continuation_len: tokens kept after each n-gram (the most a lookup can draft).
        capacity: n-grams kept; 0 keeps none.
    """

    def __init__(self, min_n: int, max_n: int, continuation_len: int, capacity: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.continuation_len = continuation_len
        self.capacity = capacity
        # n-gram -> what followed it; a plain dict's insertion order is the age (oldest first): an n-gram seen again
        # is popped and stored anew, at the end
        self._continuations: dict[tuple[int, ...], tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._continuations)

    def add(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """Remember what followed each n-gram of an output (the prompt's last ``max_n`` tokens lead in)."""
        if self.capacity == 0 or not output_token_ids:
            return
        continuations = self._continuations
        pop = continuations.pop
        lead = prompt_token_ids[-self.max_n:]
        tokens = lead + output_token_ids
        first = len(lead)  # the first position of the output
        following = [tuple(tokens[stop:stop + self.continuation_len]) for stop in range(first, len(tokens))]
        for n in range(self.min_n, self.max_n + 1):
            start = max(first, n)  # NOTE: the first n-gram ending in the output with n tokens before it
            # the n-grams ending at start .. len(tokens) - 1, made by zip from n shifted slices (in C), in order
            grams = zip(*[tokens[start - n + i:len(tokens) - n + i] for i in range(n)])
            for gram, continuation in zip(grams, following[start - first:]):
                pop(gram, None)
                continuations[gram] = continuation
        if len(continuations) > self.capacity:
            for gram in list(itertools.islice(continuations, len(continuations) - self.capacity)):
                del continuations[gram]

    def propose(self, token_ids: Sequence[int], num_tokens: int, min_n: int | None = None) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the longest suffix of ``token_ids`` in an earlier
        output; [] if no suffix of at least ``min_n`` tokens (default: the pool's) was seen."""
        if num_tokens <= 0:
            return []
        tail = token_ids[-self.max_n:]  # NOTE: one slice: ``token_ids`` may be a view, slow to index
        continuations = self._continuations
        for n in range(min(self.max_n, len(tail)), max(self.min_n, min_n or 0) - 1, -1):
            continuation = continuations.get(tuple(tail[len(tail) - n:]))
            if continuation:
                return list(continuation[:num_tokens])
        return []
