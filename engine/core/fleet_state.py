"""What the fleet cache keeps on a request (``Request.fleet_state``): whether a prefill worker handed it over,
and the store addresses of its full prompt blocks. Made and read by engine/core/fleet_cache.py only (the
scheduler reads ``Request.is_fetching_kv``, a scheduling gate). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class FleetState:
    """One request's fleet-cache state."""

    is_handed_off: bool = False  # a prefill worker computed and published its prompt blocks (a decode pool's request)
    block_digests: list[bytes] | None = None  # the store addresses of its full prompt blocks (computed once)
