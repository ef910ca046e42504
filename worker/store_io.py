"""The fleet cache's I/O on the worker's side: the engine's :class:`~tokenmill.engine.kv.fleet_io.FleetIO` over a
:class:`~tokenmill.engine.kv.block_store.BlockStore` (the worker's Redis, worker/redis_block_store.py), on two threads
of its own, so that no store call ever runs on the engine thread.

A fetch (fetch thread): ``contains`` gives the leading run the store holds; if enough are held and fetching them
beats computing them (the engine's cost model; always for a handed-off request), ``get`` brings them and the
engine's rules open each value (engine/kv/fetch_rules.py: the envelope, then the values); the first that fails
ends the run and is discarded from the store, so the block computed in its place can be put. A publish (publish
thread): ``contains``, then the blocks the store lacks are sealed and put. Every answer, a store failure
included, goes to a queue the engine drains at its step boundaries.

NOTE: two threads, so a large publish never delays a lookup a waiting request needs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from tokenmill.engine.kv.block_store import BlockStore, seal
from tokenmill.engine.kv.fetch_rules import FetchRules
from tokenmill.engine.kv.fleet_io import Fetched, FetchOrder, Published

logger = logging.getLogger(__name__)


class StoreFleetIO:
    """Fetches and publishes one engine's blocks in ``store`` off the engine thread.

    Args:
        store: the fleet's store, under the engine's namespace.
        rules: the engine's rules every fetch follows.
    """

    def __init__(self, store: BlockStore, rules: FetchRules) -> None:
        self.store = store
        self._rules = rules
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tm-fleet-fetch")
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tm-fleet-publish")
        self._fetches: dict[int, Future[None]] = {}  # ticket -> its fetch, until answered or cancelled (engine thread)
        self._publishes: list[Future[None]] = []
        self._answers: queue.SimpleQueue[Fetched | Published] = queue.SimpleQueue()
        self._fetched = threading.Event()  # set when a fetch's answer is queued, cleared when answers are taken

    # ---- engine thread ---------------------------------------------------------------------------

    def fetch(self, order: FetchOrder) -> None:
        self._fetches[order.ticket] = self._fetcher.submit(self._fetch, order)

    def cancel(self, ticket: int) -> None:
        future = self._fetches.pop(ticket, None)
        if future is not None:
            future.cancel()

    def publish(self, keys: list[bytes], payloads: list[bytes]) -> None:
        self._publishes = [f for f in self._publishes if not f.done()]
        self._publishes.append(self._publisher.submit(self._put, keys, payloads))

    def take_answers(self) -> list[Fetched | Published]:
        self._fetched.clear()
        answers: list[Fetched | Published] = []
        while True:
            try:
                answer = self._answers.get_nowait()
            except queue.Empty:
                return answers
            if isinstance(answer, Fetched):
                self._fetches.pop(answer.ticket, None)
            answers.append(answer)

    def wait(self, timeout_s: float) -> None:
        self._fetched.wait(timeout_s)

    def barrier(self) -> Future[None]:
        return self._publisher.submit(lambda: None)

    def flush(self, timeout_s: float | None = None) -> bool:
        pending = [f for f in self._publishes if not f.done()]
        return not wait_futures(pending, timeout=timeout_s).not_done

    def close(self) -> None:
        for future in self._fetches.values():
            future.cancel()
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._publisher.shutdown(wait=True)

    # ---- fetch thread ----------------------------------------------------------------------------

    def _fetch(self, order: FetchOrder) -> None:
        started_s = time.perf_counter()
        try:
            fetched = self._look_up(order, started_s)
        except Exception as exc:  # noqa: BLE001 - the engine computes the blocks and counts it
            fetched = Fetched(order.ticket, order.keys, [], 0, time.perf_counter() - started_s, error=exc)
        self._answers.put(fetched)
        self._fetched.set()

    def _look_up(self, order: FetchOrder, started_s: float) -> Fetched:
        """How many leading blocks the store holds, and those blocks, verified, if worth fetching."""
        keys = order.keys
        held = self.store.contains(keys)
        num_held = held.index(False) if False in held else len(held)
        latency_s = time.perf_counter() - started_s
        if num_held < order.min_blocks:
            return Fetched(order.ticket, keys, [], num_held, latency_s)
        if not order.at_any_cost and not self._rules.cost.fetch_beats_compute(num_held):
            return Fetched(order.ticket, keys, [], num_held, latency_s, is_too_dear=True)
        blocks, rejected = self._rules.open(keys, self.store.get(keys[:num_held]))
        if rejected is not None:
            self._discard(keys[len(blocks)])
        seconds = time.perf_counter() - started_s
        self._rules.cost.observe_fetch(sum(map(len, blocks)), seconds, latency_s)
        return Fetched(order.ticket, keys, blocks, num_held, seconds, rejected=rejected)

    def _discard(self, key: bytes) -> None:
        """Drop a rejected block's value from the store: the block computed in its place can then be published
        under its address."""
        try:
            self.store.discard([key])
        except Exception as exc:  # noqa: BLE001 - the value stays; the next fetch of it is rejected again
            logger.warning("fleet cache: discarding a rejected block failed (%s: %s)", type(exc).__name__, exc,
                           extra={"event": "fleet_store_error"})

    # ---- publish thread --------------------------------------------------------------------------

    def _put(self, keys: list[bytes], payloads: list[bytes]) -> None:
        """Seal and put what the store does not hold yet."""
        try:
            held = self.store.contains(keys)
            missing = [i for i, is_held in enumerate(held) if not is_held]
            self.store.put([keys[i] for i in missing], [seal(keys[i], payloads[i]) for i in missing])
        except Exception as exc:  # noqa: BLE001 - the blocks stay local; the engine counts and logs it
            self._answers.put(Published(keys, 0, 0, error=exc))
            return
        self._answers.put(Published(keys, len(missing), sum(len(payloads[i]) for i in missing)))
