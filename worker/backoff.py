"""Exponential backoff with jitter for the worker's retry loops. Standard library only."""

from __future__ import annotations

import random
import threading


class Backoff:
    """Waits that double after each failure (with jitter) and reset after a success.

    Args:
        first_s: the first wait.
        max_s: the longest wait.
    """

    def __init__(self, first_s: float = 0.1, max_s: float = 5.0) -> None:
        self._first_s = first_s
        self._max_s = max_s
        self._num_failures = 0

    def next_s(self) -> float:
        """The next wait: ``first_s * 2**failures`` capped at ``max_s``, times a jitter of 0.5-1."""
        delay_s = min(self._max_s, self._first_s * 2 ** min(self._num_failures, 30))
        self._num_failures += 1
        return float(delay_s * random.uniform(0.5, 1.0))

    def wait(self, interrupt: threading.Event | None = None) -> None:
        """Sleep the next wait, returning early if ``interrupt`` is set meanwhile."""
        (interrupt or threading.Event()).wait(self.next_s())

    def reset(self) -> None:
        self._num_failures = 0
