"""Admission by predicted KV: admit a request only while the KV the committed requests and it are predicted to
hold at once, at its highest over the time they run, fits the device pool. Standard library only.

Without prediction the scheduler admits whenever the next chunk fits, and a running set that grows past the
pool preempts (swap or recompute). With it, each committed request (a running one:
``Scheduler._committed_before`` says why not a swapped one) and the candidate are taken to run for their
predicted mean remaining length, growing one token per step and freeing their blocks when done. Their KV at
step t is ``sum over those still running at t of (tokens now + t)``; its maximum is reached just before one of
them finishes, so it is evaluated there (sorted by remaining length, with suffix sums: O(n log n)). Summing
every request's final size instead would plan for all of them ending at once and hold back the staggered work
a pool normally carries (a request near its end frees its blocks soon).

The tail is planned for the set, not for each request. Lengths are heavy-tailed and independent across
requests, so a few of many requests run long, not all of them: on top of the expected peak comes a margin of
``z`` standard deviations of the set's total remaining length (``z`` the normal quantile of the length
config's ``confidence``; the variances of independent lengths add), and never less than the largest single
request's tail past its mean (its ``confidence`` quantile minus its mean: one request running long is the
likeliest excess, and one request alone is planned at about its quantile). A request whose length is certain
(one that always runs to ``max_tokens``) adds no margin. Independence holds between the rows of a template the
history knows (a list answer loops or not on its own), not between rows of a template it does not know yet,
predicted from the job's other answers: those are all essays or none, so their deviations add before squaring
(``LengthState.correlation``, set by the predictor). Without that, a cold job admitted a wave of essays
predicted from its first short answers. Two cruder rules were measured in ops/bench/length.py,
where 1 list answer in 10 loops to ``max_tokens``: every request at its own 0.9 quantile (every list answer
planned at ``max_tokens``: the pool a third used), then the root sum of squares of the tails past the mean
(each counted as if it ran long: the cover for 20 such answers was 6 of them looping, where 4 or more happen
13% of the time).

Only requests at least as urgent as the candidate are counted: less urgent ones would yield their room to it
(priority preemption), so a bulk lane full of long work never holds back an urgent request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
from statistics import NormalDist
from typing import NamedTuple

from tokenmill.engine.core.length_history import LengthEstimate
from tokenmill.engine.core.request import Request


class _Run(NamedTuple):
    """One sequence's planned run: mean steps left, tokens now, tail excess past the mean, standard deviation, and
    the template its length varies with (None: independent of every other)."""

    steps_left: float
    num_tokens: float
    excess: float
    std: float
    template: Hashable | None


class PredictedKvBudget:
    """Whether admitting one more request keeps the predicted peak KV within the pool.

    Args:
        num_pool_blocks: device blocks in the pool.
        block_size: tokens per block.
        estimate_of: the current length estimate of a request (the predictor's, refreshed when stale).
        confidence: the probability the set's tail margin covers (the length config's ``confidence``).
    """

    def __init__(self, num_pool_blocks: int, block_size: int,
                 estimate_of: Callable[[Request], LengthEstimate], confidence: float = 0.9) -> None:
        self.num_pool_blocks = num_pool_blocks
        self.block_size = block_size
        self.estimate_of = estimate_of
        self._z = NormalDist().inv_cdf(confidence)

    def admits(self, candidate: Request, committed: Iterable[Request]) -> bool:
        """Whether ``candidate`` fits next to ``committed`` at the predicted peak, or is done before it matters
        (always when nothing is committed: the first request is never held back).

        Done before it matters: run to its ``confidence`` quantile, with every committed request growing a token
        a step and none finishing, all of them still fit the pool at its end. A short request then costs the
        committed ones nothing, even where their own predicted peak passes the pool (one of them outlived its
        estimate, or they were admitted before the history knew them): that excess is theirs, and holding the
        short one back would not lower it."""
        requests = [r for r in committed if r is not candidate]
        if not requests:
            return True
        if self.predicted_peak_blocks([*requests, candidate]) <= self.num_pool_blocks:
            return True
        steps = self.estimate_of(candidate).high_remaining(candidate.num_output_tokens)
        num_seqs = sum(r.num_seats for r in requests) + candidate.num_seats
        num_tokens = sum(r.num_tokens * r.num_seats for r in requests) + candidate.num_tokens * candidate.num_seats
        return (num_tokens + num_seqs * steps) / self.block_size + num_seqs / 2 <= self.num_pool_blocks

    def steps_until_admitted(self, candidate: Request, committed: Iterable[Request]) -> float:
        """Steps until the committed requests, finishing as predicted, leave room for ``candidate`` (its
        reservation when it is held back: a request behind it that is predicted to finish sooner may run in the
        meantime without delaying it, as in EASY backfilling). The first committed finish time from which it
        fits, found by bisection (the room only grows as requests finish, up to their growth in between)."""
        runs = self._runs([r for r in committed if r is not candidate])
        own = self._runs([candidate])
        starts = sorted({0.0, *(run.steps_left for run in runs)})
        low, high = 0, len(starts) - 1  # NOTE: once every committed request finished it fits alone
        while low < high:
            middle = (low + high) // 2
            start = starts[middle]
            later = [run._replace(steps_left=run.steps_left - start, num_tokens=run.num_tokens + start)
                     for run in runs if run.steps_left > start]
            if self._peak_blocks(_by_steps_left(later + own)) <= self.num_pool_blocks:
                high = middle
            else:
                low = middle + 1
        return starts[low]

    def pacing_tokens(self, request: Request) -> float:
        """Output tokens a request like this one should have generated before the next long one is admitted so
        that, once the pool is the limit, their phases stay spread out: its predicted run times its mean KV over
        the run, over the pool. (In tokens, not steps: with speculative decoding a step may add several.)

        Why: requests admitted together also end together, so a pool filled with long requests started at once
        is full only at their end and half empty on average (they grow from their prompt), and the next ones can
        only start when all of them end: waves. Started one pacing interval apart, as many run at once, at every
        stage of their run, and the pool stays about full.
        """
        steps_left = self.estimate_of(request).mean_remaining(request.num_output_tokens)
        return steps_left * (request.num_tokens + steps_left / 2) / (self.num_pool_blocks * self.block_size)

    def predicted_peak_blocks(self, requests: list[Request]) -> int:
        """Device blocks ``requests`` are predicted to hold at once, at most, over the steps they run."""
        return self._peak_blocks(self._runs(requests))

    def _runs(self, requests: list[Request]) -> list[_Run]:
        """One run per sequence, by steps left; each sample of an unforked request is one. The tail excess: its
        ``confidence`` quantile of remaining length minus the mean; the deviation, where the estimate has none,
        the excess over ``z``."""
        runs = []
        for request in requests:
            estimate = self.estimate_of(request)
            mean_left = estimate.mean_remaining(request.num_output_tokens)
            excess = max(0.0, estimate.high_remaining(request.num_output_tokens) - mean_left)
            std = estimate.std_total if estimate.std_total is not None else excess / self._z
            run = _Run(mean_left, float(request.num_tokens), excess, std, request.length_state.correlation)
            runs += [run] * request.num_seats
        return _by_steps_left(runs)

    def _peak_blocks(self, runs: list[_Run]) -> int:
        """The expected profile's peak plus the set's tail margin (the module's docstring)."""
        peak_blocks = 0.0
        num_tokens_after = 0.0  # tokens now of the sequences from this one on (they all still run)
        for index in range(len(runs) - 1, -1, -1):
            num_tokens_after += runs[index].num_tokens
            num_running = len(runs) - index
            # NOTE: just before this sequence's last token every later one has grown as much; each
            # sequence's last block is half empty on average.
            tokens = num_tokens_after + num_running * (runs[index].steps_left - 1)
            peak_blocks = max(peak_blocks, tokens / self.block_size + num_running / 2)
        margin_tokens = max((run.excess for run in runs), default=0.0)
        margin_tokens = max(margin_tokens, self._z * math.sqrt(_total_variance(runs)))
        return math.ceil(peak_blocks + margin_tokens / self.block_size)


def _by_steps_left(runs: list[_Run]) -> list[_Run]:
    return sorted(runs, key=lambda run: (run.steps_left, run.num_tokens))


def _total_variance(runs: list[_Run]) -> float:
    """The variance of the runs' summed length: independent lengths add their variances; the lengths of one
    template not yet known to the history vary together (all its rows are essays, or none), so their deviations
    add before squaring."""
    variance = 0.0
    template_to_std: dict[Hashable, float] = {}
    for run in runs:
        if run.template is None:
            variance += run.std * run.std
        else:
            template_to_std[run.template] = template_to_std.get(run.template, 0.0) + run.std
    return variance + sum(std * std for std in template_to_std.values())
