"""Admission by predicted KV: admit a request only while the peak KV the committed requests are predicted to
reach still fits the device pool. Standard library only.

Without prediction the scheduler admits whenever the next chunk fits, and a running set that grows past the
pool preempts (swap or recompute). With it, each committed request (running, or swapped and due back) is
expected to grow by its predicted remaining length; the sum of those growths is treated as normal (a sum of
many independent lengths), so the budget is its quantile at ``confidence``: ``sum of means + z * sqrt(sum of
variances)``. Summing per-request quantiles instead would plan for every request being long at once and
admit far too little. Every request is counted at its final size at the same time, which its KV never
exceeds, so the bound errs on the side of fewer preemptions.

Only requests at least as urgent as the candidate are counted: less urgent ones would yield their room to it
(priority preemption), so a bulk lane full of long work never holds back an urgent request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from statistics import NormalDist

from tokenmill.engine.core.length_history import LengthEstimate
from tokenmill.engine.core.request import Request


class PredictedKvBudget:
    """Whether admitting one more request keeps the committed requests' predicted peak KV within the pool.

    Args:
        num_pool_blocks: device blocks in the pool.
        block_size: tokens per block.
        confidence: probability the peak must fit with.
        estimate_of: the current length estimate of a request (the predictor's, refreshed when stale).
    """

    def __init__(self, num_pool_blocks: int, block_size: int, confidence: float,
                 estimate_of: Callable[[Request], LengthEstimate]) -> None:
        self.num_pool_blocks = num_pool_blocks
        self.block_size = block_size
        self.z = NormalDist().inv_cdf(confidence)
        self.estimate_of = estimate_of

    def admits(self, candidate: Request, committed: Iterable[Request]) -> bool:
        """Whether ``candidate`` fits next to ``committed`` at the predicted peak (always when nothing is
        committed: the first request is never held back)."""
        requests = [r for r in committed if r is not candidate]
        if not requests:
            return True
        return self.predicted_peak_blocks([*requests, candidate]) <= self.num_pool_blocks

    def predicted_peak_blocks(self, requests: list[Request]) -> int:
        """Device blocks ``requests`` are predicted to hold at once, at most, at the budget's confidence."""
        num_tokens = 0.0
        variance = 0.0
        for request in requests:
            estimate = self.estimate_of(request)
            # NOTE: its own tokens (the whole prompt, also the part not prefilled yet) and its mean growth; the
            # spread of the growth goes into the shared sum.
            num_tokens += request.num_seats * (request.num_tokens + estimate.mean_remaining(request.num_output_tokens))
            variance += request.num_seats * estimate.std_total ** 2
        num_tokens += self.z * math.sqrt(variance)
        # NOTE: each request's last block is half empty on average.
        num_rounding_blocks = sum(r.num_seats for r in requests) / 2
        return math.ceil(num_tokens / self.block_size + num_rounding_blocks)
