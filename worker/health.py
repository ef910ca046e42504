"""Whether the worker reaches Redis: the one place that decides when failing Redis calls make the
worker unhealthy (an ERROR line, the ``tokenmill_redis_healthy`` gauge) and when it gives up (the
failing thread raises :class:`RedisGaveUp`, so the worker exits non-zero for its supervisor to
restart, rather than retry forever). Standard library only; thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("tokenmill.worker")

UNHEALTHY_AFTER = 5  # failures in a row (with backoff, a few seconds) that make a thread unhealthy


class RedisGaveUp(Exception):
    """Redis failed every call of a thread for ``redis_give_up_s``: the worker stops with a failure."""


@dataclass
class _Streak:
    first_s: float  # monotonic time of the first failure in a row
    count: int = 0


class RedisHealth:
    """Failure streaks of the threads that talk to Redis (reader, writer).

    Args:
        give_up_s: a thread whose calls all failed for this long gives up.
    """

    def __init__(self, give_up_s: float) -> None:
        self._give_up_s = give_up_s
        self._streaks: dict[str, _Streak] = {}
        self._lock = threading.Lock()

    @property
    def is_healthy(self) -> bool:
        """No thread has failed :data:`UNHEALTHY_AFTER` times in a row."""
        with self._lock:
            return all(streak.count < UNHEALTHY_AFTER for streak in self._streaks.values())

    def failed(self, thread: str, error: Exception) -> None:
        """One more failed call of ``thread``.

        Raises:
            RedisGaveUp: its calls have all failed for ``give_up_s``.
        """
        now_s = time.monotonic()
        with self._lock:
            streak = self._streaks.setdefault(thread, _Streak(now_s))
            streak.count += 1
            count, failing_s = streak.count, now_s - streak.first_s
        fields = {"thread_name": thread, "failures": count, "failing_s": round(failing_s, 1), "error": str(error)}
        if failing_s >= self._give_up_s:
            log.error("redis failed for too long; giving up", extra={"event": "redis_gave_up", **fields})
            raise RedisGaveUp(f"{thread}: every Redis call failed for {failing_s:.1f} s ({count} in a row): {error}")
        if count == UNHEALTHY_AFTER:
            log.error("redis unavailable; the worker is unhealthy", extra={"event": "redis_unhealthy", **fields})

    def succeeded(self, thread: str) -> None:
        """A call of ``thread`` succeeded: its streak ends."""
        with self._lock:
            streak = self._streaks.pop(thread, None)
        if streak is not None and streak.count >= UNHEALTHY_AFTER:
            log.warning("redis reachable again", extra={"event": "redis_recovered", "thread_name": thread})
