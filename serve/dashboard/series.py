"""The dashboard's rates over the last hour, from the per-minute hashes in Redis (protocol/rates.py): results and
tokens per second as the workers counted them, requests in per second from the lanes' ``entries-added`` samples.

Reads are a fixed number of commands (one HGETALL per minute of the window, pipelined): they never depend on how
deep the queue is or how many workers there are. Pure functions over the replies, plus the commands to queue.

Imports producer; never torch, the engine or the worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenmill.protocol.keys import Keys
from tokenmill.protocol.rates import ADDED, BUCKET_S, OUT, RATE_TTL_S, TOKENS, field, minute_of

WINDOW_MINUTES = 60  # the hour the charts show (plus the minute under way)


def window(now_s: float) -> list[int]:
    """The minutes of the window, oldest first, the current (partial) one last."""
    current = minute_of(now_s)
    return list(range(current - WINDOW_MINUTES, current + 1))


def queue_bucket_reads(pipe: Any, keys: Keys, minutes: Sequence[int], *, of_workers: bool = False) -> None:
    """Queue one HGETALL per minute (the queue's counters, or the workers' with ``of_workers``)."""
    for minute in minutes:
        pipe.hgetall(keys.worker_rates(minute) if of_workers else keys.rates(minute))


def queue_added_samples(pipe: Any, keys: Keys, now_s: float, added: Mapping[str, int]) -> None:
    """Queue this minute's ``entries-added`` sample of each lane (HSETNX: the first one of the minute stays, so any
    number of dashboard replicas write one value), and the hash's TTL."""
    if not added:
        return
    key = keys.rates(minute_of(now_s))
    stamp = int(now_s * 1000)
    for stream, count in added.items():
        pipe.hsetnx(key, field(ADDED, stream), f"{stamp}:{count}")
    pipe.expire(key, RATE_TTL_S)


class Buckets:
    """The window's per-minute counters, decoded.

    Args:
        minutes: the window (:func:`window`).
        replies: the HGETALL replies, one per minute (an error reply counts as an empty minute).
        now_s: the Redis server's time (the current minute is divided by its elapsed seconds).
        live_added: each lane's ``entries-added`` read just now (``{stream: (server ms, count)}``): the last sample.
    """

    def __init__(self, minutes: Sequence[int], replies: Sequence[Any], now_s: float,
                 live_added: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.minutes, self.now_s = list(minutes), now_s
        self._counts: list[dict[tuple[str, str], int]] = []
        self._samples: dict[str, list[tuple[int, int]]] = {}
        for reply in replies:
            counts: dict[tuple[str, str], int] = {}
            if isinstance(reply, Mapping):
                for raw_field, raw_value in reply.items():
                    kind, _, name = _text(raw_field).partition("|")
                    if kind == ADDED:
                        sample = _sample(_text(raw_value))
                        if sample is not None:
                            self._samples.setdefault(name, []).append(sample)
                    elif kind in (OUT, TOKENS):
                        counts[(kind, name)] = _int(raw_value)
            self._counts.append(counts)
        for stream, sample in (live_added or {}).items():
            self._samples.setdefault(stream, []).append(sample)

    def _seconds(self, position: int) -> float:
        """Seconds of minute ``position`` that have passed (60 but for the current one)."""
        start_s = self.minutes[position] * BUCKET_S
        return max(1.0, min(float(BUCKET_S), self.now_s - start_s))

    def rate(self, kind: str, names: Iterable[str] | None = None) -> list[float]:
        """Per second, per minute: results (``OUT``) or tokens (``TOKENS``) of ``names`` (lane streams or worker
        names; None: all)."""
        wanted = None if names is None else set(names)
        return [sum(n for (k, name), n in counts.items() if k == kind and (wanted is None or name in wanted))
                / self._seconds(position) for position, counts in enumerate(self._counts)]

    def latest(self, values: Sequence[float | None]) -> float | None:
        """The rate "now" of a series of this window: over the last full minute and the current one's part."""
        pairs = [(value, self._seconds(position)) for position, value in enumerate(values)][-2:]
        known = [(value, seconds) for value, seconds in pairs if value is not None]
        if not known:
            return None
        return sum(value * seconds for value, seconds in known) / sum(seconds for _, seconds in known)

    def charted(self, values: Sequence[float | None]) -> list[float | None]:
        """``values`` as a chart shows them: the minute under way only once it is 20 s old (before, its few
        seconds read as a sudden drop)."""
        return list(values) if self._seconds(len(values) - 1) >= 20 else list(values[:-1])

    def in_rate(self, streams: Iterable[str] | None = None) -> list[float | None]:
        """Requests added per second, per minute, to ``streams`` (None: all sampled): each pair of samples spreads its
        difference evenly over the time between them; None for a minute no pair covers."""
        wanted = None if streams is None else set(streams)
        totals: list[float | None] = [None] * len(self.minutes)
        for stream, samples in self._samples.items():
            if wanted is not None and stream not in wanted:
                continue
            for position, value in enumerate(spread(sorted(set(samples)), self.minutes)):
                if value is not None:
                    totals[position] = (totals[position] or 0.0) + value
        return totals


def spread(samples: Sequence[tuple[int, int]], minutes: Sequence[int]) -> list[float | None]:
    """Per-second rates per minute from a counter's ``(ms, count)`` samples (sorted): each interval's rate applies to
    the part of each minute it covers; a minute's rate is the time-weighted mean over its covered part."""
    weighted = [0.0] * len(minutes)
    covered = [0.0] * len(minutes)
    first_minute = minutes[0] if minutes else 0
    for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
        if t1 <= t0:
            continue
        rate = max(0, c1 - c0) / ((t1 - t0) / 1000)
        start_s, end_s = t0 / 1000, t1 / 1000
        for position in range(max(0, int(start_s // BUCKET_S) - first_minute),
                              min(len(minutes), int(end_s // BUCKET_S) - first_minute + 1)):
            lo = max(start_s, minutes[position] * BUCKET_S)
            hi = min(end_s, (minutes[position] + 1) * BUCKET_S)
            if hi > lo:
                weighted[position] += rate * (hi - lo)
                covered[position] += hi - lo
    return [w / c if c > 0 else None for w, c in zip(weighted, covered)]




def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _sample(value: str) -> tuple[int, int] | None:
    stamp, _, count = value.partition(":")
    try:
        return int(stamp), int(count)
    except ValueError:  # anyone may write to Redis: a garbled sample is skipped
        return None
