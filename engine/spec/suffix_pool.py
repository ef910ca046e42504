"""A pool of continuations seen in earlier outputs of one engine, shared by every request it serves:
rows of one bulk job or queue that fill the same template (JSON keys, boilerplate, a fixed answer
format) draft from each other. Suffix-decoding style, bounded in memory. Standard library only.

Each finished request's output (led in by the prompt's last ``max_n`` tokens) is remembered; for every
position of it, the n-grams ending there (``min_n``..``max_n`` tokens) map to the tokens that followed them. A
lookup tries the request's longest suffix first. The newest continuation of an n-gram wins. Memory is bounded by
``capacity`` n-grams shared evenly by the lengths: each length's table forgets its oldest n-grams past its share,
and the pool remembers only the latest outputs that give the longest length its share, n-grams counted with
repeats (an older one's would be forgotten by any table that took it, unless the later ones repeat n-grams: then
it is forgotten a little early, the price of the bound on memory).

Each length has its own table, filled lazily: a finished output is only logged, and a lookup of an n first
brings that n's table up to date with the outputs logged since it last looked. A lookup stops at the longest
suffix found, so where requests copy what earlier ones produced (the case the pool pays for) the tables of the
shorter lengths are rarely read and rarely filled: a finished request costs a log entry, not an n-gram per
position and length (it was ~80 dictionary updates for a 16-token answer, 10% of a worker's engine thread on
short requests). Of identical outputs a table catching up takes the latest only (:func:`_latest_of_each`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence


class _Output:
    """One logged output: its tokens (the prompt's lead-in first) and the continuation after each position."""

    __slots__ = ("first", "following", "key", "num_grams", "tokens")

    def __init__(self, tokens: list[int], first: int, max_n: int) -> None:
        self.tokens = tokens
        self.first = first  # the position of its first output token
        self.key = (first, *tokens)  # equal for outputs that write the same n-grams and continuations
        self.following: list[tuple[int, ...]] | None = None  # made when the first table takes it
        # the n-grams it gives the longest length's table (the fewest of any length's), at least one
        self.num_grams = max(1, len(tokens) - max(first, max_n))


class SuffixPool:
    """Continuations of earlier outputs, keyed by the n-gram before them.

    Args:
        min_n: shortest n-gram matched.
        max_n: longest n-gram matched (tried first).
        continuation_len: tokens kept after each n-gram (the most a lookup can draft).
        capacity: n-grams kept, shared evenly by the lengths (each at least one); 0 keeps none.
    """

    def __init__(self, min_n: int, max_n: int, continuation_len: int, capacity: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.continuation_len = continuation_len
        self.capacity = capacity
        self._capacity_per_n = max(1, capacity // (max_n - min_n + 1)) if capacity else 0
        # per n: n-gram -> what followed it; a plain dict's insertion order is the age (oldest first): an n-gram seen
        # again is popped and stored anew, at the end. None until a lookup first tries n.
        self._tables: list[dict[tuple[int, ...], tuple[int, ...]] | None] = [None] * (max_n + 1)
        # the latest finished outputs, oldest first, numbered from _log_start: as many as the longest length's table
        # could hold n-grams of, repeats counted (an output gives each shorter length at least as many), so a table,
        # however late it looks, finds what it would still hold unless later outputs repeated n-grams (module doc)
        self._log: deque[_Output] = deque()
        self._log_start = 0
        self._log_grams = 0  # the longest length's n-grams in the log
        self._taken = [0] * (max_n + 1)  # per n: the log's outputs numbered below this are in its table

    def __len__(self) -> int:
        """The n-grams remembered (every length's table brought up to date)."""
        return sum(len(self._table(n)) for n in range(self.min_n, self.max_n + 1))

    def add(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """Remember an output (the prompt's last ``max_n`` tokens lead in): logged, each table takes it when a
        lookup next reads that table."""
        if self.capacity == 0 or not output_token_ids:
            return
        lead = prompt_token_ids[-self.max_n:]
        output = _Output(lead + output_token_ids, len(lead), self.max_n)
        self._log.append(output)
        self._log_grams += output.num_grams
        while self._log_grams - self._log[0].num_grams >= self._capacity_per_n:
            self._log_grams -= self._log.popleft().num_grams
            self._log_start += 1

    def propose(self, token_ids: Sequence[int], num_tokens: int, min_n: int | None = None) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the longest suffix of ``token_ids`` in an earlier
        output; [] if no suffix of at least ``min_n`` tokens (default: the pool's) was seen."""
        if num_tokens <= 0 or self.capacity == 0:
            return []
        tail = token_ids[-self.max_n:]  # NOTE: one slice: ``token_ids`` may be a view, slow to index
        num_logged = self._log_start + len(self._log)
        for n in range(min(self.max_n, len(tail)), max(self.min_n, min_n or 0) - 1, -1):
            table = self._tables[n]
            if table is None or self._taken[n] != num_logged:
                table = self._table(n)
            continuation = table.get(tuple(tail[len(tail) - n:]))
            if continuation:
                return list(continuation[:num_tokens])
        return []

    def _table(self, n: int) -> dict[tuple[int, ...], tuple[int, ...]]:
        """The table of n-grams, with every logged output in it."""
        table = self._tables[n]
        if table is None:
            table = self._tables[n] = {}
        num_logged = self._log_start + len(self._log)
        taken = max(self._taken[n], self._log_start)
        if taken == num_logged:
            return table
        pop = table.pop
        for output in _latest_of_each(list(itertools.islice(self._log, taken - self._log_start, None))):
            tokens, first = output.tokens, output.first
            following = output.following
            if following is None:
                following = output.following = [tuple(tokens[stop:stop + self.continuation_len])
                                                for stop in range(first, len(tokens))]
            start = max(first, n)  # NOTE: the first n-gram ending in the output with n tokens before it
            # the n-grams ending at start .. len(tokens) - 1, made by zip from n shifted slices (in C), in order
            grams = zip(*[tokens[start - n + i:len(tokens) - n + i] for i in range(n)])
            for gram, continuation in zip(grams, following[start - first:]):
                pop(gram, None)
                table[gram] = continuation
        self._taken[n] = num_logged
        if len(table) > self._capacity_per_n:
            for gram in list(itertools.islice(table, len(table) - self._capacity_per_n)):
                del table[gram]
        return table


def _latest_of_each(outputs: list[_Output]) -> list[_Output]:
    """The outputs no identical one follows, in order: what a table that takes them all ends up holding.

    An output identical to a later one (the same lead-in and tokens) writes n-grams the later one writes again,
    with the same continuations, and the later writes decide each n-gram's place in the table's age order: taking
    only the later one leaves the table the same, evictions included (they come after the whole catch-up). Rows of
    one job often give the same answer (a label, a fixed field), so a table catching up on a step's finished
    requests often takes one of them, not each."""
    if len(outputs) < 2:
        return outputs
    seen: set[tuple[int, ...]] = set()
    latest = []
    for output in reversed(outputs):
        if output.key not in seen:
            seen.add(output.key)
            latest.append(output)
    latest.reverse()
    return latest
