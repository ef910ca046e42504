"""Finished requests' output lengths under one history key, and the length estimate they give.

Standard library only. Lengths are heavy-tailed (most answers are short, a few run to ``max_tokens``), so an
estimate is a distribution, not a point: its median orders work, its mean and variance size the KV budget.
Every estimate is conditional on what the request already generated: a request that outlived most of its
history is predicted from the longer ones only, so it is re-estimated upward, never cut short.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LengthEstimate:
    """A request's predicted output length, in output tokens, given ``num_generated`` already generated.

    Attributes:
        num_generated: output tokens the request had when this was estimated.
        median_total: predicted median of its final output length (ordering).
        mean_total: predicted mean of its final output length (backlogs, ETAs).
        high_total: predicted quantile at the length config's ``confidence`` (the KV budget).
        num_samples: finished lengths the estimate came from (0: no history; see ``source``).
        source: which history predicted it: ``group+prefix``, ``prefix``, ``group``, ``all``, or ``prior``
            (no history: the whole ``max_tokens``) or ``outlived`` (older than its history: as long again).
        std_total: the predicted distribution's standard deviation (the KV budget sums the set's variances);
            None: not known (``outlived``), the budget then takes the tail past the mean for it.
    """

    num_generated: int
    median_total: float
    mean_total: float
    high_total: float
    num_samples: int
    source: str
    std_total: float | None = None

    def mean_remaining(self, num_generated: int) -> float:
        """Tokens still to come for a request that has ``num_generated`` now (at least one while it runs)."""
        return max(1.0, self.mean_total - num_generated)

    def median_remaining(self, num_generated: int) -> float:
        return max(1.0, self.median_total - num_generated)

    def high_remaining(self, num_generated: int) -> float:
        return max(1.0, self.high_total - num_generated)

    @classmethod
    def prior(cls, max_tokens: int) -> LengthEstimate:
        """No history at all: plan for the whole ``max_tokens`` (what a reservation would)."""
        return cls(0, float(max_tokens), float(max_tokens), float(max_tokens), 0, "prior", 0.0)

    @classmethod
    def outlived(cls, num_generated: int, max_tokens: int) -> LengthEstimate:
        """Older than every history that could predict it: expect as many tokens again as it has (the
        heavy-tail rule: what lived long is likely to live about as long again), and budget for ``max_tokens``."""
        total = float(num_generated + max(1, min(num_generated, max_tokens - num_generated)))
        return cls(num_generated, total, total, float(max_tokens), 0, "outlived")


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
        recent = self._recent
        if len(recent) == recent.maxlen:
            oldest = recent[0]
            recent.append(length)  # NOTE: the oldest leaves the deque
            if oldest != length:  # NOTE: a repeated length (max_tokens reached, a label) leaves the order as it is
                del self._sorted[bisect.bisect_left(self._sorted, oldest)]
                bisect.insort(self._sorted, length)
            return
        recent.append(length)
        bisect.insort(self._sorted, length)

    def mean_longer_than(self, num_generated: int) -> float | None:
        """The mean of the lengths longer than ``num_generated`` (None: none): :meth:`estimate`'s ``mean_total`` with
        no running requests and no cap (the empirical distribution), in C, for the stats' group means, asked after
        every finish (an estimate walks every distinct length in Python)."""
        tail = self._sorted[bisect.bisect_right(self._sorted, num_generated):]
        return sum(tail) / len(tail) if tail else None

    def estimate(self, num_generated: int, max_tokens: int, *, min_samples: int, quantile: float, source: str,
                 live_ages: list[int] | None = None) -> LengthEstimate | None:
        """The distribution of final lengths longer than ``num_generated``, capped at ``max_tokens``; None when
        fewer than ``min_samples`` of them finished.

        ``live_ages``: output tokens of the key's requests still generating. They are right-censored lengths
        (each will be longer than its age), counted with the Kaplan-Meier estimator: without them the first
        lengths to finish are the short ones, and a young history would predict every request short. The
        probability left past the last finished length is put at ``max_tokens`` (it may run to the cap).

        NOTE: censored lengths refine an estimate but do not make one. Counted towards ``min_samples`` (as they
        were), 3 short answers and 2 young requests answered for a whole cold job: ops/bench/length.py admitted 9
        essays 4 s in, all predicted to end by 112 tokens, and they held the pool for 100 s.
        """
        first = bisect.bisect_right(self._sorted, num_generated)
        if len(self._sorted) - first < max(1, min_samples):
            return None
        tail = self._sorted[first:]
        censored = sorted(age for age in live_ages or () if age > num_generated)
        lengths: list[float] = []
        masses: list[float] = []
        survival = 1.0
        num_at_risk = len(tail) + len(censored)
        index = censored_index = 0
        while index < len(tail):
            length = tail[index]
            while censored_index < len(censored) and censored[censored_index] < length:
                num_at_risk -= 1  # NOTE: known longer than its age only: out of the risk set past it
                censored_index += 1
            num_ended = 1
            while index + num_ended < len(tail) and tail[index + num_ended] == length:
                num_ended += 1
            mass = survival * num_ended / num_at_risk
            lengths.append(float(min(length, max_tokens)))
            masses.append(mass)
            survival -= mass
            num_at_risk -= num_ended
            index += num_ended
        if survival > 1e-9:
            lengths.append(float(max_tokens))
            masses.append(survival)
        mean = sum(length * mass for length, mass in zip(lengths, masses))
        variance = sum(mass * (length - mean) ** 2 for length, mass in zip(lengths, masses))
        median, high = _quantile(lengths, masses, 0.5), _quantile(lengths, masses, quantile)
        return LengthEstimate(num_generated, median, mean, high, len(tail), source, math.sqrt(variance))


def _quantile(lengths: list[float], masses: list[float], quantile: float) -> float:
    """The smallest length whose cumulative probability reaches ``quantile`` (``lengths`` ascending)."""
    cumulative = 0.0
    for length, mass in zip(lengths, masses):
        cumulative += mass
        if cumulative >= quantile - 1e-9:
            return length
    return lengths[-1]


class KeyHistory:
    """What the predictor knows under one history key: its finished lengths, and its live requests (their ages are
    censored lengths). A request holds its keys' histories (``LengthState.keys``), made once, so its admission,
    start, finish and every estimate touch them directly: no key tuple is built or hashed again.

    Attributes:
        key: the history key (engine/core/length_predictor.py ``history_keys``).
        source: the name of its kind (an estimate's ``source``).
        prefix_length: the prompt-prefix length it names; 0 for a group's or everyone's key.
        samples: its finished lengths; None before the first finish (or once the predictor forgot them).
        live: its unfinished requests, by id.
        started: ... of them, those scheduled at least once (only they have an age).
        is_attached: in the predictor's index (False once dropped: a request holding it looks its key up again).
        memo, memo_observed: answers for requests that generated nothing yet, by ``(known past, max_tokens)``, made
            while the predictor's ``num_observed`` was ``memo_observed`` (any finish makes them stale).
        num_started, started_observed: the requests that finished here or generated a token, counted when
            ``num_observed`` was ``started_observed``.
    """

    __slots__ = ("is_attached", "key", "live", "memo", "memo_observed", "num_started", "prefix_length", "samples",
                 "source", "started", "started_observed")

    def __init__(self, key: Hashable, source: str, prefix_length: int) -> None:
        self.key = key
        self.source = source
        self.prefix_length = prefix_length
        self.samples: LengthSamples | None = None
        self.live: dict[str, Any] = {}
        self.started: dict[str, Any] = {}
        self.is_attached = True
        self.memo: dict[tuple[int, int], tuple[LengthEstimate | None, int]] = {}
        self.memo_observed = -1
        self.num_started = 0
        self.started_observed = -1
