"""Injectable time sources for the scheduler: the engine's monotonic clock, and a clock moved by hand for
simulated time (ops/bench/length_replay.py replays a job through the scheduler alone; the tests step it).
Standard library only."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Anything with ``now() -> float`` seconds; the scheduler never reads time otherwise."""

    def now(self) -> float: ...


class MonotonicClock:
    """Production clock: ``time.monotonic()``."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to (simulated time)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def now(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (must be >= 0)."""
        if seconds < 0:
            raise ValueError("a clock never goes backwards")
        self._now_s += seconds
