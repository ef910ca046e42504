"""Per-minute counters of a queue in Redis, the time series behind the dashboard's rates (docs/design.md,
"Redis keys": ``rate:{minute}`` and ``wrate:{minute}``).

Why counters in Redis and not in a process: the rates over the last hour then survive a restart of anything,
and every dashboard replica reads the same numbers. Workers' writers add what they answered (:class:`RateCounter`,
at most one round trip a second); dashboards add, once a minute per lane, the lane's ``entries-added`` (a counter
Redis >= 7 keeps per stream), from which requests in per second follow for any stretch, however sparse the samples.
Minutes are the Redis server's (``unix s // 60``): a worker keeps the server's clock from its heartbeats.

Imports protocol.keys only (the caller hands in its Redis client); never redis, torch, the engine or the worker.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tokenmill.protocol.keys import Keys

BUCKET_S = 60  # one hash per minute
RATE_TTL_S = 2 * 3600 + 120  # a minute's hash outlives the hour the dashboard shows
FLUSH_INTERVAL_S = 1.0  # a writer sends its counts at most this often
OUT = "o"  # field ``o|{lane stream}`` / ``o|{worker}``: results written
TOKENS = "t"  # field ``t|{lane stream}`` / ``t|{worker}``: their completion tokens
ADDED = "a"  # field ``a|{lane stream}``: ``{server ms}:{entries-added}``, the first sample of the minute


def field(kind: str, name: str) -> str:
    return f"{kind}|{name}"


def minute_of(unix_s: float) -> int:
    return int(unix_s // BUCKET_S)


class RateCounter:
    """A worker's results and tokens, per lane and its own, summed in memory and added to the minute's hashes with
    one pipelined round trip at most every :data:`FLUSH_INTERVAL_S` (HINCRBY + EXPIRE).

    Args:
        keys: the queue's own keys (the hashes are queue-wide).
        worker: the worker's name.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, keys: Keys, worker: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._keys, self._worker, self._clock = keys, worker, clock
        self._counts: Counter[tuple[int, str, str]] = Counter()  # (minute, kind, stream) -> n
        self._server_offset_s: float | None = None  # server time - monotonic, from the last heartbeat
        self._next_flush_s = 0.0

    def sync_clock(self, server_s: float) -> None:
        """The Redis server's time now (a heartbeat's ``ts``, stamped by the server): minutes follow its clock."""
        if server_s > 0:
            self._server_offset_s = server_s - self._clock()

    def add(self, stream: str, num_tokens: int) -> None:
        """One result answered from lane ``stream`` with ``num_tokens`` completion tokens."""
        now_s = self._clock() + self._server_offset_s if self._server_offset_s is not None else time.time()
        minute = minute_of(now_s)
        self._counts[(minute, OUT, stream)] += 1
        self._counts[(minute, TOKENS, stream)] += num_tokens

    def flush(self, client: Any, *, force: bool = False) -> None:
        """Send the counts (once :data:`FLUSH_INTERVAL_S` passed since the last send, or ``force``).

        Raises:
            redis.RedisError: the round trip failed; the counts are kept for the next one.
        """
        if not self._counts or (not force and self._clock() < self._next_flush_s):
            return
        counts, self._counts = self._counts, Counter()
        pipe = client.pipeline(transaction=False)
        per_worker: Counter[tuple[int, str]] = Counter()
        for (minute, kind, stream), n in counts.items():
            pipe.hincrby(self._keys.rates(minute), field(kind, stream), n)
            per_worker[(minute, kind)] += n
        for (minute, kind), n in per_worker.items():
            pipe.hincrby(self._keys.worker_rates(minute), field(kind, self._worker), n)
        for minute in {minute for minute, _ in per_worker}:
            pipe.expire(self._keys.rates(minute), RATE_TTL_S)
            pipe.expire(self._keys.worker_rates(minute), RATE_TTL_S)
        try:
            pipe.execute()
        except BaseException:
            self._counts.update(counts)
            raise
        self._next_flush_s = self._clock() + FLUSH_INTERVAL_S
