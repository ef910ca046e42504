"""Pure ordering rules of the scheduler: effective priority (aging), urgency keys, victim choice.

Standard library only; every function takes the current clock time as an argument.

Aging and its bound (why a low-priority request cannot starve)
--------------------------------------------------------------
With I = aging_interval_s > 0, aging ticks at the clock times that are multiples of I, for
every request at once, and::

    effective_priority = priority - (floor(now_s / I) - floor(waiting_since_s / I))

so each full interval waited gains at least one level (the partial first interval may gain
one more). ``waiting_since_s`` is set on arrival and reset only when the starvation limit
demotes the request; the request keeps aging while it runs, so an admitted request keeps
the credit that got it admitted.

NOTE: ticking on a shared grid, rather than ``floor((now_s - waiting_since_s) / I)``, makes the
difference between two requests' effective priorities a constant: the order of requests
never flips back and forth as time passes, so priority and memory preemption cannot
ping-pong between two requests.

Bound. Waiting requests are ordered by ``(effective priority, swapped first, length order, arrival,
seq_no)``, where the length order is 0 (fcfs) or the predicted remaining length (shortest / longest
first, engine/core/length_predictor.py). Take a request L (priority p_L, arrived t_L) and any H with
priority p_H = p_L - g (g >= 0, the priority gap) arriving at ``t_H >= t_L + (g + 1) * I``. Then
``floor(t_H / I) >= floor(t_L / I) + g + 1``, so at every time ``eff_H - eff_L >= 1``: H is strictly less
urgent than L, whatever their predicted lengths (with fcfs, ties go to the earlier arrival, so ``g * I``
suffices). Hence every request arriving from
``t_L + (g + 1) * I`` on is ordered behind L and is never strictly more urgent (it cannot priority-preempt
L). L is admitted as soon as the finitely many requests ahead of it at that time are placed and room
appears (blocks, a sequence slot, token budget, the predicted-KV budget): a wait of at most ``(g + 1) * I``
plus the time for room to appear for those requests and L.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tokenmill.engine.core.request import Request, RequestStatus

UrgencyKey = tuple[int, float, int]
AdmissionKey = tuple[int, int, float, float, int]


def effective_priority(request: Request, now_s: float, aging_interval_s: float) -> int:
    """The request's priority improved by one level per aging tick since it started waiting.

    Args:
        request: any unfinished request.
        now_s: current clock time, seconds.
        aging_interval_s: seconds per level; 0 turns aging off.

    Returns:
        An int; lower is more urgent.
    """
    if aging_interval_s <= 0.0:
        return request.priority
    num_levels = math.floor(now_s / aging_interval_s) - math.floor(request.waiting_since_s / aging_interval_s)
    return request.priority - max(0, num_levels)


def urgency_key(request: Request, now_s: float, aging_interval_s: float) -> UrgencyKey:
    """Total order over requests, most urgent first: (effective priority, arrival, seq_no)."""
    return (effective_priority(request, now_s, aging_interval_s), request.arrival_time_s, request.seq_no)


def running_order_key(request: Request, aging_interval_s: float) -> UrgencyKey:
    """:func:`urgency_key`'s order without a clock, for requests whose aging started at or before any time asked
    about (running ones: the clock only moves forward): their effective priority is ``priority +
    floor(waiting_since_s / I) - floor(now_s / I)``, the last term the same for all (as in :func:`admission_key`).
    A running request's key stays while it runs, so the queues keep the running requests in this order."""
    level = request.priority
    if aging_interval_s > 0.0:
        level += math.floor(request.waiting_since_s / aging_interval_s)
    return (level, request.arrival_time_s, request.seq_no)


def most_lenient_running_priority(least_urgent_key: UrgencyKey, now_s: float, aging_interval_s: float) -> int:
    """An upper bound on the effective priority (:func:`effective_priority`) of every running request whose
    :func:`running_order_key` is current, from the greatest of those keys: exact for requests whose aging started by
    ``now_s`` (``priority + floor(waiting_since_s / I) - floor(now_s / I)``), above it for the others (their aging
    has not begun: their effective priority is their priority)."""
    level = least_urgent_key[0]
    return level - math.floor(now_s / aging_interval_s) if aging_interval_s > 0.0 else level


def admission_key(request: Request, aging_interval_s: float, length_order: float = 0.0) -> AdmissionKey:
    """Order of swapped and waiting requests for (re)admission: by effective priority, then a swapped
    request before a new (or recompute-preempted) one, then ``length_order`` (the predicted remaining
    length, negated for longest first; 0 for fcfs; -inf for a row of a template being explored), then arrival
    and seq_no.

    NOTE: effective priority is ``priority + floor(waiting_since_s / I) - floor(now_s / I)``, and the last
    term is the same for every request (the shared grid above), so the order needs no clock: the key is
    computed once per request, not re-aged per request each step (a sort over thousands of waiting
    requests in offline ``generate`` spent most of a step there).
    """
    level = request.priority
    if aging_interval_s > 0.0:
        level += math.floor(request.waiting_since_s / aging_interval_s)
    return (level, int(request.status is not RequestStatus.SWAPPED), length_order, request.arrival_time_s,
            request.seq_no)


def choose_victim(requests: Iterable[Request], now_s: float, aging_interval_s: float) -> Request | None:
    """The preferred preemption victim: demoted requests first, then the least urgent.

    Among equals the later arrival (then the higher seq_no) is chosen, so the choice is unique.
    Returns None when ``requests`` is empty.
    """
    return max(
        requests,
        key=lambda r: (r.is_demoted, urgency_key(r, now_s, aging_interval_s)),
        default=None,
    )


def is_decode(request: Request) -> bool:
    """Whether the request's next step computes just its newest sampled token."""
    # NOTE: the lists' lengths read directly (not the request's num_* properties): asked twice per request per step
    output = request.output_token_ids
    return bool(output) and len(request.prompt_token_ids) + len(output) - request.num_computed_tokens == 1


def room_victims(
    running: Iterable[Request], request: Request, now_s: float, aging_interval_s: float, *,
    enable_priority_preemption: bool,
) -> list[Request]:
    """Running requests that may yield their room to the waiting/swapped ``request``.

    Eligible: demoted requests (long-output limit), and, when priority preemption is on,
    requests strictly less urgent by effective priority. Preferred victim first. The caller
    removes requests protected by hysteresis beforehand.
    """
    priority = effective_priority(request, now_s, aging_interval_s)
    eligible = [
        r for r in running
        if r.is_demoted
        or (enable_priority_preemption and effective_priority(r, now_s, aging_interval_s) > priority)
    ]
    return sorted(eligible, key=lambda r: (r.is_demoted, urgency_key(r, now_s, aging_interval_s)), reverse=True)
