"""How many draft tokens each request runs this step: the goodput rule.

A draft token at position ``i`` of a request whose drafts are accepted at rate ``a`` adds ``a ** i``
expected tokens to the step, and the step grows by one token, which costs ``b`` seconds by the step
cost model ``t(T) = a0 + b * T`` (fitted to the engine's own measured steps). Spending ``b`` seconds
is worth it while the expected tokens it buys beat what the step already produces per second:
``a ** i > b * goodput``. A small batch on a CPU or a GPU is bound by reading the weights (``a0``
dominates, ``b * goodput`` is tiny): it drafts deeply. A large batch is bound by compute (``b * T``
dominates, ``b * goodput`` nears 1): only near-certain drafts pay, so it drafts little or nothing.
Acceptance alone cannot make that call, since the same acceptance is worth it at batch 1 and not at
batch 64. The acceptance floor stays as a last guard: a request whose drafts are rarely accepted
stops drafting, and probes with a short draft now and then. Standard library only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

# Acceptance is an exponentially decayed count over a request's recent drafts, starting from a
# prior of one accepted and one rejected token (a = 0.5) so a new request drafts moderately.
ACCEPTANCE_DECAY = 0.8
PROBE_EVERY_STEPS = 8  # a request under the floor drafts a probe this often
PROBE_TOKENS = 2


@dataclass
class Acceptance:
    """A request's recent draft acceptance: each draft token accepted with probability ``rate`` once
    the tokens before it were (the count of accepted tokens over accepted plus rejections)."""

    accepted: float = 1.0
    rejected: float = 1.0
    steps_since_draft: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = self.accepted * ACCEPTANCE_DECAY + num_accepted
        self.rejected = self.rejected * ACCEPTANCE_DECAY + (1.0 if num_accepted < num_drafted else 0.0)
        self.steps_since_draft = 0


class StepCost:
    """``t(T) = fixed_s + per_token_s * T``: a least-squares fit over the engine's recent decode steps
    (exponentially decayed; the engine leaves steps with prefill chunks out), ``T`` the step's tokens.
    Until the steps seen vary enough in size to fit a slope, drafting is taken as free
    (``per_token_s = 0``); the drafts it then runs vary the steps' sizes, and the slope follows."""

    DECAY = 0.99

    def __init__(self) -> None:
        self._n = self._t = self._x = self._xx = self._xt = 0.0
        self.fixed_s = 0.0
        self.per_token_s = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0.0:
            return
        d = self.DECAY
        self._n = self._n * d + 1.0
        self._t = self._t * d + seconds
        self._x = self._x * d + num_tokens
        self._xx = self._xx * d + num_tokens * num_tokens
        self._xt = self._xt * d + num_tokens * seconds
        mean_x, mean_t = self._x / self._n, self._t / self._n
        variance = self._xx / self._n - mean_x * mean_x
        if variance > 1.0:  # NOTE: step sizes that vary by about a token or more: a slope can be fitted
            slope = (self._xt / self._n - mean_x * mean_t) / variance
            self.per_token_s = max(0.0, slope)
        self.fixed_s = max(mean_t - self.per_token_s * mean_x, 1e-6)

    def seconds(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens


def choose_draft_lengths(proposals: list[tuple[str, int, float]], num_tokens_left: int, num_scheduled_tokens: int,
                         num_decodes: int, cost: StepCost) -> dict[str, int]:
    """Draft tokens per request by the goodput rule (module docstring).

    Args:
        proposals: ``(request id, draft tokens proposed, acceptance rate)`` per request.
        num_tokens_left: the step's token budget left for drafts.
        num_scheduled_tokens: tokens the step runs already.
        num_decodes: requests decoding in the step (each yields one token without drafts).
        cost: the step cost model.

    Returns:
        How many of its proposed tokens each request runs (requests with none are left out).
    """
    # Candidates: (-expected tokens, request, position); a request's positions come in order since
    # rate ** i falls with i.
    heap = [(-rate, request_id, 1, rate) for request_id, num_proposed, rate in proposals if num_proposed > 0]
    heapq.heapify(heap)
    limit = {request_id: num_proposed for request_id, num_proposed, _ in proposals}
    chosen: dict[str, int] = {}
    num_tokens, expected = num_scheduled_tokens, float(num_decodes)
    while heap and num_tokens_left > 0:
        negative_gain, request_id, position, rate = heapq.heappop(heap)
        gain = -negative_gain
        seconds = cost.seconds(num_tokens)
        if cost.per_token_s > 0.0 and seconds > 0.0 and gain <= cost.per_token_s * expected / seconds:
            break  # NOTE: every later candidate gains less
        chosen[request_id] = position
        num_tokens += 1
        num_tokens_left -= 1
        expected += gain
        if position < limit[request_id]:
            heapq.heappush(heap, (-(gain * rate), request_id, position + 1, rate))
    return chosen
