"""Finished requests' output lengths under one history key, and the length estimate they give.

Standard library only. Lengths are heavy-tailed (most answers are short, a few run to ``max_tokens``), so an
estimate is a distribution, not a point: its median orders work, its mean and variance size the KV budget.
Every estimate is conditional on what the request already generated: a request that outlived most of its
history is predicted from the longer ones only, so it is re-estimated upward, never cut short.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthEstimate:
    """A request's predicted output length, in output tokens, given ``num_generated`` already generated.

    Attributes:
        num_generated: output tokens the request had when this was estimated.
        median_total: predicted median of its final output length (ordering).
        mean_total: predicted mean of its final output length (the KV budget).
        std_total: standard deviation of that prediction (the KV budget's margin).
        num_samples: finished lengths the estimate came from (0: no history; see ``source``).
        source: which history predicted it: ``group+prefix``, ``prefix``, ``group``, ``all``, or ``prior``
            (no history: the whole ``max_tokens``) or ``outlived`` (older than its history: as long again).
    """

    num_generated: int
    median_total: float
    mean_total: float
    std_total: float
    num_samples: int
    source: str

    def mean_remaining(self, num_generated: int) -> float:
        """Tokens still to come for a request that has ``num_generated`` now (at least one while it runs)."""
        return max(1.0, self.mean_total - num_generated)

    def median_remaining(self, num_generated: int) -> float:
        return max(1.0, self.median_total - num_generated)

    @classmethod
    def prior(cls, max_tokens: int) -> LengthEstimate:
        """No history at all: plan for the whole ``max_tokens`` (what a reservation would)."""
        return cls(0, float(max_tokens), float(max_tokens), 0.0, 0, "prior")

    @classmethod
    def outlived(cls, num_generated: int, max_tokens: int) -> LengthEstimate:
        """Older than every history that could predict it: expect as many tokens again as it has (the
        heavy-tail rule: what lived long is likely to live about as long again), within ``max_tokens``."""
        remaining = max(1, min(num_generated, max_tokens - num_generated))
        total = float(num_generated + remaining)
        return cls(num_generated, total, total, float(remaining), 0, "outlived")


class LengthSamples:
    """The most recent finished lengths under one key (a bounded window), kept sorted for quantiles."""

    __slots__ = ("_recent", "_sorted")

    def __init__(self, capacity: int) -> None:
        self._recent: deque[int] = deque(maxlen=capacity)
        self._sorted: list[int] = []

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, length: int) -> None:
        """Remember one finished length (the oldest one leaves once the window is full)."""
        if len(self._recent) == self._recent.maxlen:
            oldest = self._recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._recent.append(length)
        bisect.insort(self._sorted, length)

    def estimate(self, num_generated: int, max_tokens: int, min_samples: int, source: str) -> LengthEstimate | None:
        """The distribution of final lengths among samples longer than ``num_generated``, capped at
        ``max_tokens``; None when fewer than ``min_samples`` are that long."""
        tail = self._sorted[bisect.bisect_right(self._sorted, num_generated):]
        if len(tail) < min_samples:
            return None
        capped = [min(length, max_tokens) for length in tail]  # still sorted
        mean = sum(capped) / len(capped)
        variance = sum((length - mean) ** 2 for length in capped) / len(capped)
        return LengthEstimate(num_generated, float(capped[len(capped) // 2]), mean, variance ** 0.5,
                              len(capped), source)
