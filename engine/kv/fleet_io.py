"""The fleet cache's I/O as the engine sees it: requests that never block (fetch these blocks, publish these), and
their answers handed back through a queue the engine drains at step boundaries (engine/core/fleet_cache.py).

The threads and the store's calls live behind :class:`FleetIO`, with the worker (worker/store_io.py, over the
worker's :class:`~tokenmill.engine.kv.block_store.BlockStore`); a fetch there follows the engine's
:class:`~tokenmill.engine.kv.fetch_rules.FetchRules` (the cost model, and the verification every fetched value
passes before it is handed back). Standard library only; never torch, never redis.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from tokenmill.engine.kv.fetch_rules import FetchRules


@dataclass(frozen=True, slots=True)
class FetchOrder:
    """Fetch the leading run of ``keys`` the store holds."""

    ticket: int  # names the answer (:class:`Fetched`)
    keys: list[bytes]  # the addresses of consecutive prompt blocks, in chain order
    min_blocks: int  # fewer leading blocks held: nothing is fetched
    at_any_cost: bool  # fetch them without asking the cost model (a handed-off request: its prefill was made for it)


@dataclass(slots=True)
class Fetched:
    """A fetch's answer."""

    ticket: int
    keys: list[bytes]  # the addresses it looked up
    blocks: list[memoryview]  # the leading blocks it fetched and verified (payloads; possibly none)
    num_held: int  # leading blocks the store held
    seconds: float  # wall time of the lookup
    is_too_dear: bool = False  # held, but the cost model chose computing
    rejected: str | None = None  # why the block after ``blocks`` failed verification (None: none did)
    error: Exception | None = None  # the store failed (nothing else is set)


@dataclass(frozen=True, slots=True)
class Published:
    """A publish's answer."""

    keys: list[bytes]  # the addresses handed to :meth:`FleetIO.publish`
    num_blocks: int  # of those, the blocks put (the store held the others already)
    num_bytes: int  # their payloads' bytes
    error: Exception | None = None  # the store failed: none were put


class FleetIO(Protocol):
    """The fleet's store, reached off the engine thread. Every call but :meth:`wait`, :meth:`flush` and
    :meth:`close` returns at once; the engine thread makes them all."""

    def fetch(self, order: FetchOrder) -> None:
        """Start a fetch; its :class:`Fetched` comes out of :meth:`take_answers` (unless cancelled first). Values
        are verified by the engine's rules before they are handed back: the first that fails ends the run, and is
        discarded from the store."""

    def cancel(self, ticket: int) -> None:
        """Nobody waits for this fetch any more: it does not start if it has not (an answer may still come)."""

    def publish(self, keys: list[bytes], payloads: list[bytes]) -> None:
        """Seal and put the blocks the store does not hold yet, in order after every publish before; the
        :class:`Published` comes out of :meth:`take_answers`."""

    def take_answers(self) -> list[Fetched | Published]:
        """The answers that came since the last call, in the order they came."""

    def wait(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` for a fetch's answer to come (none waiting in :meth:`take_answers`)."""

    def barrier(self) -> Future[None]:
        """Done once every publish started so far is done."""

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every publish started so far is done; whether they all were in time."""

    def close(self) -> None:
        """Stop the threads: publishes in flight finish, fetches are dropped."""


# The fleet's I/O for an engine: its namespace (the root of its block addresses, engine/kv/block_store.py
# ``namespace``) and the rules its fetches follow. A worker builds it over its Redis.
FleetIOFactory = Callable[[bytes, FetchRules], FleetIO]
