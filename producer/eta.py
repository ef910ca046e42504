"""Predicted remaining work of a job or a queue, in completion tokens, and its ETA: the one rule behind
``tokenmill status``, the bulk progress bar and the Batches API's batch object.

Workers predict their requests' output lengths (engine/core/length_predictor.py) and beat (protocol/heartbeat.py)
the completion tokens their engine is predicted to still generate, in all and per job (a reply stream: each bulk job
and batch has its own), and the mean length a new request is predicted to have. Work no engine holds yet (rows not
sent, entries waiting in Redis, requests of a worker that predicts nothing) counts at that mean length. The ETA
divides by the job's own recent token rate when known (its share of a fleet that may serve other work too), else by
the fleet's.

Standard library and protocol only; never imports torch, the engine or the worker.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tokenmill.protocol.heartbeat import Heartbeat, decode_heartbeat

RATE_WINDOW_S = 60.0  # a job's token rate is measured over the results of this last stretch
MIN_RATE_SPAN_S = 5.0  # ... once it has run this long (before, the fleet's rate stands in)


@dataclass(frozen=True)
class Eta:
    """Predicted remaining completion tokens and when they are done; None where it cannot be predicted (yet)."""

    backlog_tokens: float | None  # None: no worker predicts lengths, or no mean length is known for work not started
    tokens_per_s: float  # the rate the ETA assumes (0.0: nothing generates)
    eta_s: float | None  # seconds until done; None: no backlog known, or no rate

    def as_dict(self) -> dict[str, float | None]:
        """``backlog_tokens`` and ``eta_s``, rounded (what JSON shows)."""
        return {"backlog_tokens": None if self.backlog_tokens is None else round(self.backlog_tokens),
                "eta_s": None if self.eta_s is None else round(self.eta_s, 1)}

    def describe(self) -> str:
        """``12,345 tok left, ETA 0:02:05`` (``-`` for what is unknown)."""
        tokens = "-" if self.backlog_tokens is None else f"{self.backlog_tokens:,.0f}"
        return f"{tokens} tok left, ETA {format_duration(self.eta_s)}"


def job_eta(beats: Iterable[Heartbeat], job: str, num_unanswered: int, *, finished_mean_length: float | None,
            job_tokens_per_s: float | None) -> Eta:
    """The remaining work of one job.

    Args:
        beats: the live workers' heartbeats.
        job: the job's reply stream (the name its requests are predicted and reported under).
        num_unanswered: the job's rows without a final result (sent or not).
        finished_mean_length: mean completion tokens of the job's results so far; None before any.
        job_tokens_per_s: the job's own recent completion-token rate; None: not measured (yet).

    Tokens: what the workers' engines still generate for the job, plus its rows no engine holds (unanswered minus
    those in engines) at the workers' predicted mean length for the job (weighted by their requests of it), else at
    ``finished_mean_length``. The rate: ``job_tokens_per_s``, else the fleet's.
    """
    beats = list(beats)
    in_engines = [beat.jobs[job] for beat in beats if job in beat.jobs]
    num_outside = max(0, num_unanswered - sum(backlog.num_requests for backlog in in_engines))
    predicted = [(backlog.mean_length, backlog.num_requests) for backlog in in_engines
                 if backlog.mean_length is not None and backlog.num_requests > 0]
    mean_length = _weighted_mean(predicted) if predicted else finished_mean_length
    tokens = _plus_unstarted(sum(backlog.backlog_tokens for backlog in in_engines), num_outside, mean_length)
    rate = job_tokens_per_s if job_tokens_per_s else _fleet_rate(beats)
    return Eta(tokens, rate, _seconds(tokens, rate))


def queue_eta(beats: Iterable[Heartbeat], num_undelivered: int | None) -> Eta:
    """The remaining work of a whole queue.

    Args:
        beats: the live workers' heartbeats.
        num_undelivered: entries of its lanes not yet delivered to a worker; None: unknown (Redis < 7).

    Tokens: the workers' predicted engine backlogs, plus the undelivered entries and the requests of workers that
    predict nothing (an older release, prediction off) at the fleet's mean predicted length (the workers' plain
    mean). The rate: the fleet's.
    """
    beats = list(beats)
    if num_undelivered is None:
        return Eta(None, _fleet_rate(beats), None)
    lengths = [beat.mean_length for beat in beats if beat.mean_length is not None]
    mean_length = sum(lengths) / len(lengths) if lengths else None
    in_engines = sum(beat.backlog_tokens for beat in beats if beat.backlog_tokens is not None)
    unpredicted = sum(beat.running + beat.waiting for beat in beats if beat.backlog_tokens is None)
    tokens = _plus_unstarted(in_engines, num_undelivered + unpredicted, mean_length)
    rate = _fleet_rate(beats)
    return Eta(tokens, rate, _seconds(tokens, rate))


def live_beats(workers: Mapping[Any, Any], now_s: float, stale_after_s: float) -> list[Heartbeat]:
    """The live workers' heartbeats among the workers hash's values by name (values that are no heartbeat
    skipped), judged at ``now_s``: the Redis server's time read with them (``protocol.heartbeat.READ_WORKERS_LUA``)."""
    beats = []
    for raw_name, raw in workers.items():
        name = raw_name.decode(errors="backslashreplace") if isinstance(raw_name, bytes) else str(raw_name)
        beat = decode_heartbeat(name, raw)
        if beat is not None and not beat.is_stale(now_s, stale_after_s):
            beats.append(beat)
    return beats


def format_duration(seconds: float | None) -> str:
    """``0:02:05``; ``-`` for None."""
    return "-" if seconds is None else str(timedelta(seconds=round(seconds)))


class JobMeter:
    """A job's results as they land: the mean completion length, and the completion tokens per second over the last
    ``window_s`` (since the meter started while it is younger).

    Args:
        window_s: the stretch the rate is measured over.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, window_s: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s, self._clock = window_s, clock
        self._start_s = clock()
        self._recent: deque[tuple[float, int]] = deque()  # (landed at, completion tokens) within the window
        self._num_results = self._num_tokens = 0

    def add(self, num_tokens: int) -> None:
        """One result landed with ``num_tokens`` completion tokens."""
        now_s = self._clock()
        self._recent.append((now_s, num_tokens))
        self._num_results += 1
        self._num_tokens += num_tokens
        self._forget(now_s)

    @property
    def mean_length(self) -> float | None:
        """Mean completion tokens of the results so far; None before any."""
        return self._num_tokens / self._num_results if self._num_results else None

    def tokens_per_s(self) -> float | None:
        """The recent rate; None before :data:`MIN_RATE_SPAN_S` or while no result landed within the window."""
        now_s = self._clock()
        self._forget(now_s)
        span_s = min(self._window_s, now_s - self._start_s)
        if span_s < MIN_RATE_SPAN_S or not self._recent:
            return None
        return sum(tokens for _, tokens in self._recent) / span_s

    def _forget(self, now_s: float) -> None:
        while self._recent and self._recent[0][0] <= now_s - self._window_s:
            self._recent.popleft()


def _plus_unstarted(in_engines: float, num_unstarted: int, mean_length: float | None) -> float | None:
    """Tokens in engines plus ``num_unstarted`` requests at ``mean_length``; None when some are not started and
    no mean is known."""
    if not num_unstarted:
        return in_engines
    return None if mean_length is None else in_engines + num_unstarted * mean_length


def _weighted_mean(values: list[tuple[float, int]]) -> float:
    return sum(value * weight for value, weight in values) / sum(weight for _, weight in values)


def _fleet_rate(beats: list[Heartbeat]) -> float:
    return sum(beat.tokens_per_s for beat in beats)


def _seconds(tokens: float | None, tokens_per_s: float) -> float | None:
    if tokens is None:
        return None
    if tokens <= 0:
        return 0.0
    return tokens / tokens_per_s if tokens_per_s > 0 else None
