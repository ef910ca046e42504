"""Pure ordering rules of the scheduler: effective priority (aging), urgency keys, victim choice.

Standard library only; every function takes the current clock time as an argument.

Aging bound (why a low-priority request cannot starve)
------------------------------------------------------
Effective priority is ``priority - floor((now_s - waiting_since_s) / aging_interval_s)`` and
it keeps aging while the request runs (``waiting_since_s`` is set on arrival and reset only
when the starvation limit demotes the request). Requests are ordered by
``(effective priority, arrival, seq_no)``.

Take a request L (priority p_L, arrived t_L) and any request H (priority p_H = p_L - g, g >= 0)
that arrives at ``t_H >= t_L + g * I`` (I = aging_interval_s). At every time t, because
``floor(x - g) == floor(x) - g`` for integer g::

    eff_H(t) = p_H - floor((t - t_H) / I) >= p_H - floor((t - t_L) / I - g) = eff_L(t)

so H is at best tied with L, and the tie goes to the earlier arrival, L. Hence from
``t_L + g * I`` on, L is ahead of every later arrival and no later arrival is strictly more
urgent (so none can priority-preempt L either). L is then admitted as soon as the finitely
many requests ahead of it at that moment are admitted and room appears (blocks, a sequence
slot and token budget): the wait is at most ``g * I`` plus the time for room to appear.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from engine.request import Request, RequestStatus

UrgencyKey = tuple[int, float, int]


def effective_priority(request: Request, now_s: float, aging_interval_s: float) -> int:
    """The request's priority improved by one level per ``aging_interval_s`` waited.

    Args:
        request: any unfinished request.
        now_s: current clock time, seconds.
        aging_interval_s: seconds per level; 0 turns aging off.

    Returns:
        An int; lower is more urgent.
    """
    if aging_interval_s <= 0.0:
        return request.priority
    num_levels = math.floor(max(0.0, now_s - request.waiting_since_s) / aging_interval_s)
    return request.priority - num_levels


def urgency_key(request: Request, now_s: float, aging_interval_s: float) -> UrgencyKey:
    """Total order over requests, most urgent first: (effective priority, arrival, seq_no)."""
    return (effective_priority(request, now_s, aging_interval_s), request.arrival_time_s, request.seq_no)


def queue_key(request: Request, now_s: float, aging_interval_s: float) -> tuple[int, int, float, int]:
    """Order of swapped and waiting requests for (re)admission.

    Like :func:`urgency_key`, but at equal effective priority a swapped request resumes
    before a new (or recompute-preempted) request is admitted.
    """
    priority, arrival_time_s, seq_no = urgency_key(request, now_s, aging_interval_s)
    is_waiting = int(request.status is not RequestStatus.SWAPPED)
    return (priority, is_waiting, arrival_time_s, seq_no)


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
    return request.num_output_tokens > 0 and request.num_tokens - request.num_computed_tokens == 1


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
