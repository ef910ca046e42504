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
stops drafting, and probes with a short draft now and then.

The goodput is the step's expected tokens over its wall time, ``t(T) + h``: ``h`` is the engine's host
time per step outside the forward (``StepCost.host_s``, measured between steps), which a step saved by
accepted drafts saves too. Over the forward alone, a device that costs next to nothing beside the host
(the echo model's, whose forward grows with its tokens and has no fixed part) makes every draft look too
dear. And proposing costs host time: the proposers run per request, in Python (or run a draft model),
and a step with drafts waits for them. The speculator measures their seconds per request proposed for
(``p``, ``StepCost.proposal_s``), and a request's first draft token is charged them on top of ``b``:
``a > (b + p) * goodput``, so a draft that costs more host time than it saves is not chosen. That
matters where a request's share of a step is short next to its proposing -- a fast device, a slow
proposer -- and not where a step takes milliseconds. Until a step's host time is measured, proposing
is taken as free. A request whose first draft token ``b`` alone rules out is not proposed for at all
(:meth:`StepCost.draft_threshold`): a compute-bound batch drafts nothing, and spends nothing on it.

A step runs one of two ways, each with its own line: a static shape (on CUDA a replayed graph, for decode
steps and for verification steps of up to ``MAX_VERIFY_TOKENS`` tokens) or the flattened batch (eager). Draft
tokens are priced on the line of the way drafted steps run; where that differs from the plain steps' way,
a step drafts only if its tokens per second with the drafts, on the drafted line, beat those without, on the
plain line (:func:`drafting_pays`). Standard library only.
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# Acceptance is an exponentially decayed count over a request's recent drafts, starting from a
# prior of one accepted and one rejected token (a = 0.5) so a new request drafts moderately.
ACCEPTANCE_DECAY = 0.8
PROBE_EVERY_STEPS = 8  # a request under the floor drafts a probe this often
PROBE_TOKENS = 2


@dataclass(slots=True)
class Acceptance:
    """A request's recent draft acceptance: each draft token accepted with probability ``rate`` once
    the tokens before it were (the count of accepted tokens over accepted plus rejections)."""

    accepted: float = 1.0
    rejected: float = 1.0
    # the speculator's step count (its draft calls) when this request's latest draft came back, or when this was made:
    # a stamp, not a count per request, so no step has to touch every request's acceptances
    drafted_at_step: int = 0
    # accepted / (accepted + rejected), kept as they change: read for every decoding request every step
    rate: float = field(init=False)

    def __post_init__(self) -> None:
        self.rate = self.accepted / (self.accepted + self.rejected)

    def observe(self, num_drafted: int, num_accepted: int, step: int) -> None:
        self.accepted = accepted = self.accepted * ACCEPTANCE_DECAY + num_accepted
        self.rejected = rejected = self.rejected * ACCEPTANCE_DECAY + (1.0 if num_accepted < num_drafted else 0.0)
        self.rate = accepted / (accepted + rejected)
        self.drafted_at_step = step


class CostLine:
    """``t(T) = fixed_s + per_token_s * T``: a least-squares fit over one path's recent steps (exponentially
    decayed), ``T`` the step's tokens. Until the steps seen vary enough in size to fit a slope, a token is taken
    as free (``per_token_s = 0``)."""

    DECAY = 0.99
    __slots__ = ("_n", "_t", "_x", "_xx", "_xt", "fixed_s", "per_token_s")

    def __init__(self) -> None:
        self._n = self._t = self._x = self._xx = self._xt = 0.0
        self.fixed_s = 0.0
        self.per_token_s = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
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


class StepCost:
    """The engine's decode steps' cost, a :class:`CostLine` per path (the engine leaves steps with prefill
    chunks out): on CUDA a step that fits a captured shape replays a graph and one that does not runs eagerly,
    at another fixed cost and slope, and one line over both would misprice either. ``fixed_s`` and
    ``per_token_s`` are the line of the path the latest step with drafts took (what a draft token is charged
    at; the latest plain step's path until one ran); :func:`drafting_pays` weighs a step that would leave its
    plain path for it. Until the steps seen vary enough in size to fit a slope, drafting is taken as free
    (``per_token_s = 0``); the drafts it then runs vary the steps' sizes, and the slope follows.

    And the host side of a step, each the median of recent steps': ``proposal_s``, the proposers' seconds
    per request they were asked to draft for (0 until ``MIN_PROPOSALS`` steps proposed), and ``host_s``,
    the engine's seconds per step outside the forward (0 until measured). Medians, since the outliers are
    one-off: the step that first indexes a batch of new prompts, a pause between two steps; either would
    stand for many steps in a mean."""

    HOST_STEPS = 15  # recent steps the host medians are taken over
    MIN_PROPOSALS = 3  # proposing steps measured before proposal_s counts

    def __init__(self) -> None:
        self.lines: dict[str, CostLine] = {}  # by the way steps ran (engine.core.step_io.ModelOutput.path)
        self.plain_path: str | None = None  # the latest step without drafts ran this way
        self.drafted_path: str | None = None  # the latest step with drafts
        self.fixed_s = 0.0
        self.per_token_s = 0.0
        self._proposals: deque[float] = deque(maxlen=self.HOST_STEPS)
        self.proposal_s = 0.0
        self._host: deque[float] = deque(maxlen=self.HOST_STEPS)
        self.host_s = 0.0

    def observe(self, num_tokens: int, seconds: float, path: str, drafted: bool) -> None:
        """One decode step: its tokens, its forward's seconds, the way it ran and whether it carried drafts."""
        if num_tokens <= 0 or seconds <= 0.0:
            return
        line = self.lines.get(path)
        if line is None:
            line = self.lines[path] = CostLine()
        line.observe(num_tokens, seconds)
        if drafted:
            self.drafted_path = path
        else:
            self.plain_path = path
        charged = self.lines[self.drafted_path or path]
        self.fixed_s, self.per_token_s = charged.fixed_s, charged.per_token_s

    @property
    def switches_path(self) -> bool:
        """Whether steps with drafts run another way than steps without (both measured)."""
        return self.drafted_path is not None and self.plain_path is not None and self.drafted_path != self.plain_path

    def plain_seconds(self, num_tokens: int) -> float:
        """What a step of ``num_tokens`` tokens without drafts costs, on its own path's line."""
        line = self.lines.get(self.plain_path) if self.plain_path is not None else None
        return line.seconds(num_tokens) if line is not None else self.seconds(num_tokens)

    def observe_proposals(self, num_requests: int, seconds: float) -> None:
        """One step's proposing: ``seconds`` of host time for drafts for ``num_requests`` requests."""
        if num_requests <= 0 or seconds < 0.0:
            return
        self._proposals.append(seconds / num_requests)
        if len(self._proposals) >= self.MIN_PROPOSALS:
            self.proposal_s = _median(self._proposals)

    def observe_host(self, seconds: float) -> None:
        """One step's host time outside its forward (its wall time less the forward's)."""
        self._host.append(max(0.0, seconds))
        self.host_s = _median(self._host)

    def seconds(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens

    def draft_threshold(self, num_scheduled_tokens: int, num_decodes: int) -> float:
        """The acceptance rate a request's drafts must beat for :func:`choose_draft_lengths` to take their
        first token at ``b`` alone, in a step of ``num_scheduled_tokens`` tokens and ``num_decodes`` decodes
        (0: any).

        The rule compares a token's gain with the step's goodput, which only grows as it takes tokens: a
        request at or under this rate would never be chosen, and the speculator does not ask its proposers
        for it. (Not ``b + p``: the proposing's cost is measured only where requests are proposed for, and
        a stop it caused would keep it at what it was then.)
        """
        seconds = self.seconds(num_scheduled_tokens) + self.host_s
        if self.per_token_s <= 0.0 or seconds <= 0.0:
            return 0.0
        return self.per_token_s * num_decodes / seconds


def _median(values: deque[float]) -> float:
    return sorted(values)[len(values) // 2]


def choose_draft_lengths(request_ids: Iterable[str], lengths: list[int], rates: list[float], num_tokens_left: int,
                         num_scheduled_tokens: int, num_decodes: int, cost: StepCost) -> dict[str, int] | None:
    """Draft tokens per request by the goodput rule (module docstring), a request's first token also
    paying for its proposing: what :func:`greedy_draft_lengths` chooses, where every proposed token pays (a
    weight-bound step, the common case while drafting is cheap) found without going token by token.

    Args:
        request_ids: the requests with a proposed draft.
        lengths: each one's proposed draft tokens (at least 1), in the same order.
        rates: each one's acceptance rate, in the same order.
        num_tokens_left: the step's token budget left for drafts.
        num_scheduled_tokens: tokens the step runs already.
        num_decodes: requests decoding in the step (each yields one token without drafts).
        cost: the step cost model.

    Returns:
        None where every proposed token runs (the drafts as proposed: no lengths to make, the common case); else
        how many of its proposed tokens each request runs (requests with none are left out).
    """
    if every_token_pays(lengths, rates, num_tokens_left, num_scheduled_tokens, num_decodes, cost):
        return None
    return greedy_draft_lengths(list(zip(request_ids, lengths, rates)), num_tokens_left, num_scheduled_tokens,
                                num_decodes, cost)


def drafting_pays(lengths: dict[str, int], rates: dict[str, float], num_scheduled_tokens: int, num_decodes: int,
                  cost: StepCost) -> bool:
    """Whether a step with these drafts yields more tokens per second than the same step without any, each on its
    own path's cost line: the goodput rule prices draft tokens on one line, but where drafted steps run another
    way than plain ones (on CUDA: a verification too large for a captured shape leaves the graphs for the eager
    forward), the first draft also moves the whole step onto the dearer line, which only this comparison sees.

    Args:
        lengths: draft tokens per request (what :func:`choose_draft_lengths` chose).
        rates: acceptance rate per request.
        num_scheduled_tokens: tokens the step runs without drafts.
        num_decodes: requests decoding in the step.
        cost: the step cost model.
    """
    if not lengths or not cost.switches_path or num_decodes <= 0:
        return True
    expected = float(num_decodes)
    for request_id, length in lengths.items():
        expected += expected_tokens(rates[request_id], length)
    with_drafts_s = cost.seconds(num_scheduled_tokens + sum(lengths.values())) + cost.host_s
    without_s = cost.plain_seconds(num_scheduled_tokens) + cost.host_s
    return expected * without_s > num_decodes * with_drafts_s


def expected_tokens(rate: float, length: int) -> float:
    """The draft tokens a draft of ``length`` is expected to keep at acceptance ``rate``: rate + rate ** 2 + ... +
    rate ** length (each kept once the ones before it were)."""
    return (rate - rate ** (length + 1)) / (1.0 - rate) if rate < 1.0 else float(length)


def every_token_pays(lengths: list[int], rates: list[float], num_tokens_left: int, num_scheduled_tokens: int,
                     num_decodes: int, cost: StepCost) -> bool:
    """Whether the budget holds every proposed token and the greedy rule would take each (False: not shown here,
    the greedy rule decides): :func:`choose_draft_lengths`'s shortcut.

    The greedy rule takes a token while its gain beats ``b`` (a first token: ``b + p``) times the goodput so far,
    and each token it takes raises the goodput; after the last it is the goodput with every token in. So if the
    least gain of all (each request's last token; a first token's: its rate) beats that final goodput, every test
    on the way passed.

    Args:
        lengths: each request's proposed draft tokens (each at least 1).
        rates: each request's acceptance rate, in the same order.

    NOTE: the sums are taken by builtins over the two lists (this runs every step over every drafting request),
    where the greedy rule pops each token off a heap in Python.
    """
    num_tokens = sum(lengths)
    if not lengths or num_tokens > num_tokens_left:
        return not lengths
    per_token_s, host_s = cost.per_token_s, cost.host_s
    charge_proposal = cost.proposal_s > 0.0 and host_s > 0.0
    seconds = cost.fixed_s + per_token_s * (num_scheduled_tokens + num_tokens) + host_s
    if seconds <= 0.0 or (per_token_s <= 0.0 and not charge_proposal):
        return True  # NOTE: no test applies (drafting taken as free)
    last_gains = list(map(pow, rates, lengths))  # rate ** length: the gain of each request's last token
    if max(rates) < 1.0:
        # rate + rate ** 2 + ... + rate ** length = (rate - rate ** length * rate) / (1 - rate), for every request
        ones = itertools.repeat(1.0)
        expected = sum(map(operator.truediv, map(operator.sub, rates, map(operator.mul, last_gains, rates)),
                           map(operator.sub, ones, rates)), float(num_decodes))
    else:  # NOTE: a rate of exactly 1 (its rejections decayed to nothing), which the division above cannot take
        expected = sum(map(expected_tokens, rates, lengths), float(num_decodes))
    goodput = expected / seconds * (1.0 + 1e-9)  # NOTE: a margin for the greedy rule's own rounding
    if per_token_s > 0.0 and min(last_gains) <= per_token_s * goodput:
        return False
    return not (charge_proposal and min(rates) <= (per_token_s + cost.proposal_s) * goodput)


def greedy_draft_lengths(proposals: list[tuple[str, int, float]], num_tokens_left: int, num_scheduled_tokens: int,
                         num_decodes: int, cost: StepCost) -> dict[str, int]:
    """The goodput rule token by token (the arguments and result of :func:`choose_draft_lengths`): the best
    expected gain next, while it pays and the budget lasts."""
    # Candidates: (-expected tokens, request, position); a request's positions come in order since
    # rate ** i falls with i.
    heap = [(-rate, request_id, 1, rate) for request_id, num_proposed, rate in proposals if num_proposed > 0]
    heapq.heapify(heap)
    heappop, heapreplace = heapq.heappop, heapq.heapreplace
    limit = {request_id: num_proposed for request_id, num_proposed, _ in proposals}
    chosen: dict[str, int] = {}
    fixed_s, per_token_s, host_s = cost.fixed_s, cost.per_token_s, cost.host_s
    charge_proposal = cost.proposal_s > 0.0 and host_s > 0.0  # NOTE: taken as free until a step's host time is known
    first_token_s = per_token_s + cost.proposal_s
    num_tokens, expected = num_scheduled_tokens, float(num_decodes)
    while heap and num_tokens_left > 0:
        negative_gain, request_id, position, rate = heap[0]
        gain = -negative_gain
        seconds = fixed_s + per_token_s * num_tokens + host_s
        if seconds > 0.0:
            if per_token_s > 0.0 and gain <= per_token_s * expected / seconds:
                break  # NOTE: every later candidate gains less
            if position == 1 and charge_proposal and gain <= first_token_s * expected / seconds:
                # NOTE: a first token that does not pay for its proposing: no later first token does (they gain
                # less, and the goodput only grows), but later tokens of requests already drafting still may
                heappop(heap)
                continue
        chosen[request_id] = position
        num_tokens += 1
        num_tokens_left -= 1
        expected += gain
        if position < limit[request_id]:
            heapreplace(heap, (-(gain * rate), request_id, position + 1, rate))
        else:
            heappop(heap)
    return chosen
