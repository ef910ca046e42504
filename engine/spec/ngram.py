"""Prompt lookup: the longest recent suffix of a request's tokens (prompt + output) that occurred
before in them, and what followed it there. Copy-heavy work -- rewriting, reformatting, extraction,
code edits -- repeats spans of its prompt, which this drafts for free.

Each request keeps an index of its n-grams (n-gram -> where its latest earlier occurrence ends),
grown by the tokens added since the last lookup, so a lookup costs O(new tokens x n range), not a
scan of the whole context. A step's lookup runs on every decoding request of the batch, so its cost per
request was most of the speculator's share of the engine's host time: the speculator runs the C++ form of
:class:`LazyNgramIndex` (csrc/ngram_index.cpp, :func:`native_index`: the whole batch in one call), and
:class:`LazyNgramIndex` where it cannot be built or ``[engine.speculative] ngram_index = "python"``.
:class:`NgramIndex` is the plain form of the same rule, kept as the specification
(tests/unit/test_spec_fast_paths.py holds the three to the same drafts). Standard library only.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Protocol

from tokenmill.engine.kernels.python_module import PythonModule

_NATIVE_INDEX = PythonModule("tokenmill_ngram_index", Path(__file__).resolve().parent / "csrc" / "ngram_index.cpp",
                             what="the C++ n-gram index", fallback="the Python index drafts the same tokens, slower")


def native_index() -> ModuleType | None:
    """The C++ n-gram index (csrc/ngram_index.cpp), built on first use: its ``NgramIndex(min_n, max_n)`` is
    :class:`LazyNgramIndex` (the same ``propose``), and ``propose_batch(wanted, indexes, min_n)`` proposes for a
    batch, ``wanted`` holding a :class:`~tokenmill.engine.spec.speculator.Proposer`'s ``(request, tokens,
    num_tokens)`` triples and ``indexes`` each request's index, returning ``{request_id: draft}``. None where it
    cannot be built (logged once)."""
    return _NATIVE_INDEX.load()


class NgramLookup(Protocol):
    """One request's n-gram index as the speculator keeps it: :class:`LazyNgramIndex` or the C++ one."""

    def propose(self, prompt: list[int], output: list[int], num_tokens: int, min_n: int | None = None) -> list[int]:
        ...


class NgramIndex:
    """One request's n-grams, for :meth:`propose`: the plain form (every n-gram of every n indexed as its
    tokens come), the specification :class:`LazyNgramIndex` is tested against.

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


# Token ids packed into an n-gram's key, this many bits each: a key is ``t1 << (BITS * (n - 1)) | ... | tn``, an int
# made by shifting the next token in (no tuple built per gram). Ids are below 2 ** 32 (a vocabulary's size).
BITS = 32

# A request that can hold at most this many tokens (prompt and max_tokens) has its lookups search its tokens' bytes
# instead of an index (``scan_tokens``). Measured (2-core EPYC): a search costs C time, 0.2 us at 50-250 tokens, and
# keeping the bytes 0.35 us a step, where an index costs ~130 ns of Python per token for each n a lookup tries, the
# prompt's included: a short request (a worker's classification or extraction: a prompt of tens of tokens, a few
# steps) spent 15-30 us indexing a prompt it reads a handful of times. A longer one keeps the index: its steps cost
# 0.3 us less, and its cost stays flat in its length.
SCAN_TOKENS = 512


@functools.cache
def _masks(max_n: int) -> tuple[int, ...]:
    """Per n up to ``max_n``: the mask of an n-gram's packed key (shared: every request's index made them anew)."""
    return tuple((1 << (BITS * n)) - 1 for n in range(max_n + 1))


class LazyNgramIndex:
    """One request's n-grams, for :meth:`propose`: what :class:`NgramIndex` proposes, at a fraction of its
    host time.

    Three things make it cheap. It indexes an n only when a lookup tries that n: a lookup tries the longest
    suffix first and stops there if it occurred before, so where the request copies (the case drafts pay for)
    only ``max_n``-grams are ever indexed, one per token, not one per token and n; where nothing repeats, the
    shortest next, and so the two lengths only (and a request of at most ``scan_tokens`` tokens indexes nothing:
    its lookups search its tokens' bytes, ``bytearray.rfind``, in C). Its keys are ints
    (``BITS`` per token) rolled forward one token at a time: each n keeps the key of the last gram it indexed,
    and the next gram's key is that one shifted, the new token or'ed in and the oldest masked off, so a gram
    costs three int operations and a dict store, whether a call brings one token or a whole prompt. And it
    works on its own copy of the tokens, taken from the request's prompt and output lists by a slice each (a
    list's slice costs C only, where a view of the two costs a Python call per slice). The rule is the plain
    one's, since a lookup of an n sees every n-gram that ends before the request's last token (the index of
    an n catches up to there first), the latest occurrence winning (each run is stored in order).

    Args:
        min_n: shortest n-gram matched (a lookup may ask for longer ones only); at least 1.
        max_n: longest suffix matched (tried first: a longer match predicts better).
        scan_tokens: while the request holds at most this many tokens its lookups search them instead of an
            index (past it the index catches up at once); 0: indexed from the start.
    """

    __slots__ = ("_bytes", "_ends", "_keys", "_masks", "_missed", "_num_indexed", "_tokens", "max_n", "min_n",
                 "scan_tokens")

    def __init__(self, min_n: int, max_n: int, scan_tokens: int = 0) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.scan_tokens = scan_tokens
        self._tokens: list[int] = []  # the request's tokens, copied as they come (slicing a list costs C only)
        # the same tokens as 4-byte ids, for the searches of a short request; None once it outgrew scan_tokens
        self._bytes: bytearray | None = bytearray() if scan_tokens > 0 else None
        # per n: packed n-gram -> end (exclusive) of its latest occurrence; made when a lookup first tries that n
        self._ends: list[dict[int, int] | None] = [None] * (max_n + 1)
        # per n: the n-grams ending before this are in _ends (0: none yet), and the key of the last one (of the
        # n - 1 tokens before the first gram, until the first is stored)
        self._num_indexed = [0] * (max_n + 1)
        self._keys = [0] * (max_n + 1)
        self._masks = _masks(max_n)
        # (tokens, n): the suffixes of n or more tokens of the request's first `tokens` tokens never occurred
        # before. A lookup is a function of the tokens alone, so a later tier's lookup at the same length (with
        # a shorter min_n) starts below n, not over again.
        self._missed = (0, max_n + 1)

    def propose(self, prompt: list[int], output: list[int], num_tokens: int, min_n: int | None = None) -> list[int]:
        """What :meth:`NgramIndex.propose` proposes for ``prompt + output`` and the same arguments: up to
        ``num_tokens`` tokens that followed the latest earlier occurrence of the longest suffix of the
        request's tokens (between ``min_n``, default the index's, and ``max_n`` long) that occurred before;
        [] if none.

        ``prompt`` and ``output`` are the request's own lists: the prompt stays, the output only grows.
        """
        tokens = self._tokens
        num_copied, num_prompt = len(tokens), len(prompt)
        if num_copied < num_prompt:
            tokens += prompt[num_copied:]
            num_copied = num_prompt
        if num_copied - num_prompt < len(output):
            tokens += output[num_copied - num_prompt:]
        if num_tokens <= 0 or not tokens:
            return []
        end = len(tokens)
        longest = self.max_n if self.max_n < end else end
        shortest = self.min_n if min_n is None or min_n < self.min_n else min_n
        if self._missed[0] == end and self._missed[1] <= longest:
            longest = self._missed[1] - 1
        if longest < shortest:
            return []
        latest = self._latest
        if self._bytes is not None:
            if end <= self.scan_tokens:
                self._bytes += array("I", tokens[len(self._bytes) >> 2:])
                latest = self._searched
            else:
                self._bytes = None
        # NOTE: whether a suffix occurred before falls with its length (a longer one's occurrence holds the shorter
        # one's), so the longest that did is found by bisection: the longest first (a copy: one lookup), then the
        # shortest (none occurred: two), then between. A lookup indexes its n first, so fewer lengths tried is
        # fewer lengths indexed, which is most of a new request's cost.
        found = latest(longest, end)
        if found is None:
            if longest == shortest or (found := latest(shortest, end)) is None:
                self._missed = (end, shortest)
                return []
            low, high = shortest, longest  # the suffix of `low` tokens occurred before, of `high` did not
            while high - low > 1:
                middle = (low + high) // 2
                found_middle = latest(middle, end)
                if found_middle is None:
                    high = middle
                else:
                    low, found = middle, found_middle
        return self._tokens[found:found + num_tokens]

    def _latest(self, n: int, end: int) -> int | None:
        """Where the latest earlier occurrence of the last ``n`` tokens (of the first ``end``) ends; None if they
        did not occur before. Indexes the n-grams ending before ``end`` first."""
        tokens, ends, mask = self._tokens, self._ends[n], self._masks[n]
        if ends is None:
            ends = self._ends[n] = {}
        key, start = self._keys[n], self._num_indexed[n]
        if start == 0:  # NOTE: the first use of this n: the n - 1 tokens before its first gram
            start = n - 1
            for token in tokens[:start]:
                key = (key << BITS) | token
        if start < end - 1:  # the grams ending at start + 1 .. end - 1 (not the suffix: it ends at end)
            stop = start
            for token in tokens[start:end - 1]:
                key = ((key << BITS) | token) & mask
                stop += 1
                ends[key] = stop
            start = stop
        self._keys[n], self._num_indexed[n] = key, start
        return ends.get(((key << BITS) | tokens[end - 1]) & mask)

    def _searched(self, n: int, end: int) -> int | None:
        """:meth:`_latest` by searching the tokens' bytes (the first ``end`` tokens are in ``_bytes``): the
        rightmost match that starts on a token's first byte and ends before ``end``."""
        data = self._bytes
        assert data is not None
        needle = data[4 * (end - n):4 * end]
        limit = 4 * (end - 1)
        while (start := data.rfind(needle, 0, limit)) >= 0:
            if start & 3 == 0:
                return (start >> 2) + n
            limit = start + 4 * n - 1  # NOTE: a match across token boundaries: the next one starts before it
        return None
