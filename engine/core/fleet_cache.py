"""The fleet-wide prefix cache: full prompt blocks one engine computes are published to a block store
(engine/kv/block_store.py), and an engine whose local prefix cache misses fetches the next blocks from it
when fetching beats computing them again. Standard library only; never torch, never redis, never a thread:
the store is reached through :class:`~tokenmill.engine.kv.fleet_io.FleetIO` (the worker's threads,
worker/store_io.py), whose answers this engine thread drains at its step boundaries.

Life of a lookup (engine thread unless named)::

    add_request ─> look_up: local match k blocks, the prompt has n ─ n - k >= min_blocks? ─> the I/O's thread:
                   contains(k..n) -> m leading blocks held ─ worth fetching m? (cost model) ─> get(k..k+m)
                   ─> each fetched value opened (engine/kv/block_store.py ``unseal``) and its values checked
                   (the pool's ``check_blocks``) by the engine's rules (engine/kv/fetch_rules.py); the first that
                   fails ends the run, and is discarded from the store
    each step   ─> poll: the answers are drained; a done fetch is written into free device blocks and indexed by
                   the local prefix cache (cached, evictable), so the admission that follows hits them like any
                   local prefix
    after step  ─> publish: blocks the step computed and indexed (prompt blocks only) are copied out of the
                   device pool, then sealed and put to the store on the I/O's publish thread (those it already
                   holds skipped)

A request waits (``Request.is_fetching_kv``) while its blocks travel, at most ``max_wait_s``. Whatever ends
in the request computing blocks the store held is counted as a fallback with its reason: the store failed,
the fetch was too slow, the device pool had no room, the blocks were gone by admission, the cost model judged
computing cheaper, or a fetched block was rejected. Only verified tokens are ever in indexed blocks (the
scheduler indexes nothing else), and partial blocks are never published.

NOTE: a fetched block enters the device pool only once verified: sealed for the address asked for, its payload
matching its digest, its values finite and within float16's range. A rejected block (corrupted, another prompt's
or namespace's, implausible values) is counted, logged, discarded from the store, and computed with the blocks
after it, never used. The store's write path is trusted (only workers write it): verification does not stop a
forger who can compute the digests (engine/kv/block_store.py, the trust model).
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.engine.config import FleetCacheConfig
from tokenmill.engine.core.fleet_state import FleetState
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.kv.block_manager import BlockManager
from tokenmill.engine.kv.block_store import block_digests
from tokenmill.engine.kv.fetch_rules import TransferCost
from tokenmill.engine.kv.fleet_io import Fetched, FetchOrder, FleetIO, Published
from tokenmill.engine.kv.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

KNOWN_DIGESTS = 1 << 16  # digests this engine published or fetched lately: not published again


class BlockIO(Protocol):
    """What the fleet cache needs of the KV pool (engine/model/kv_cache.py)."""

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each device block's keys and values, every layer, as bytes."""

    def write_blocks(self, block_ids: list[int], blocks: Sequence[bytes | memoryview]) -> None:
        """Overwrite device blocks with bytes :meth:`read_blocks` gave (on any engine of the namespace)."""


class Fallback(str, enum.Enum):
    """Why a request computed prompt blocks the fleet's store held (or may have held)."""

    ERROR = "error"  # the store failed (unreachable, a bad reply)
    TIMEOUT = "timeout"  # the fetch took longer than max_wait_s
    NO_ROOM = "no_room"  # the device pool had no free blocks to load them into
    EVICTED = "evicted"  # loaded, but reused for other work before the request was admitted
    COST = "cost"  # the cost model judged computing them cheaper than fetching
    REJECTED = "rejected"  # a fetched block failed verification: it and the blocks after it were computed


@dataclass
class FleetCacheStats:
    """Counters since the engine started; all zero with the fleet cache off."""

    is_on: bool = False
    num_lookups: int = 0  # requests whose missing prompt blocks were looked up in the store
    num_hits: int = 0  # lookups that loaded at least one block
    num_hit_blocks: int = 0  # blocks fetched and loaded into the device pool
    num_fetched_blocks: int = 0  # blocks fetched (one fetch serves every request waiting for the same blocks)
    num_fetched_bytes: int = 0
    fetch_seconds: float = 0.0  # wall time of the lookups that fetched (contains + get)
    num_published_blocks: int = 0  # blocks put to the store
    num_published_bytes: int = 0
    num_publish_errors: int = 0  # puts the store refused (those blocks stay local)
    num_rejected_blocks: int = 0  # fetched blocks that failed verification (discarded from the store, computed)
    fallbacks: dict[str, int] = field(default_factory=lambda: {reason.value: 0 for reason in Fallback})
    fallback_blocks: int = 0  # blocks the store held that were computed again instead (all reasons)
    num_handoffs: int = 0  # requests a prefill worker handed to this (decode) engine
    handoff_recomputed_blocks: int = 0  # of their full prompt blocks, those this engine computed after all

    @property
    def num_fallbacks(self) -> int:
        return sum(self.fallbacks.values())

    def copy(self) -> FleetCacheStats:
        return FleetCacheStats(**{**self.__dict__, "fallbacks": dict(self.fallbacks)})


@dataclass
class _Lookup:
    request: Request
    first_index: int  # the prompt block the fetch starts at (the local cache held those before)
    ticket: int  # the fetch it waits for (FetchOrder.ticket)
    started_s: float
    first_key: bytes  # the address of that block
    is_follower: bool = False  # it waits for another request's fetch of the same blocks


def _state(request: Request) -> FleetState:
    """The request's fleet-cache state, made on first use (a forked sample's blocks are published too)."""
    state = request.fleet_state
    if state is None:
        state = request.fleet_state = FleetState()
    return state


class FleetCache:
    """Looks up, loads and publishes one engine's prompt blocks in the fleet's shared store.

    Args:
        config: ``[engine.fleet_cache]``.
        io: the fleet's store, reached off this thread (its fetches follow rules over ``cost``).
        root: the namespace every digest chain starts from (:func:`block_store.namespace`).
        block_io: reads and writes device blocks' bytes.
        cost: the fetch-or-compute cost model its fetches consult (this engine observes its prefill steps).
        block_manager: the device pool the fetched blocks are loaded into.
        prefix_cache: the local index they join.
        clock: seconds, for waits (the engine's wall clock, not a test's scripted one).
    """

    def __init__(self, config: FleetCacheConfig, io: FleetIO, root: bytes, block_io: BlockIO, cost: TransferCost,
                 block_manager: BlockManager, prefix_cache: PrefixCache,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.root = root
        self.block_size = block_manager.block_size
        self.cost = cost
        self._io = io
        self._block_io = block_io
        self._block_manager = block_manager
        self._prefix_cache = prefix_cache
        self._clock = clock
        self._stats = FleetCacheStats(is_on=True)
        self._lookups: dict[str, _Lookup] = {}
        self._fetching: dict[bytes, _Lookup] = {}  # first block address -> the lookup fetching from there
        self._tickets = itertools.count()
        self._answers: dict[int, Fetched] = {}  # ticket -> its fetch's answer, while a lookup waits for it
        self._loaded: dict[str, tuple[Request, int]] = {}  # request id -> (it, its prompt blocks held once loaded)
        self._handed_off: dict[str, Request] = {}  # handed-off requests not admitted yet
        self._known: OrderedDict[bytes, None] = OrderedDict()

    def stats(self) -> FleetCacheStats:
        self._take_answers()
        return self._stats.copy()

    @property
    def num_fetching(self) -> int:
        return len(self._lookups)

    def digests(self, request: Request) -> list[bytes]:
        """The store addresses of the request's full prompt blocks (computed once per request)."""
        state = _state(request)
        if state.block_digests is None:
            state.block_digests = block_digests(self.root, request.prompt_token_ids, self.block_size)
        return state.block_digests

    # ---- engine thread: lookups ------------------------------------------------------------------

    def look_up(self, request: Request, is_handed_off: bool = False) -> None:
        """Start fetching the prompt blocks the local cache lacks, if enough are missing; the request
        waits for them (:attr:`Request.is_fetching_kv`) until :meth:`poll` loads them or gives up.

        Args:
            request: a request just added.
            is_handed_off: a prefill worker published its prompt blocks: they are fetched whatever they cost, and
                those it computes after all are counted.
        """
        request.fleet_state = FleetState(is_handed_off)
        if is_handed_off:
            self._stats.num_handoffs += 1
            self._handed_off[request.request_id] = request
        self._start_lookup(request)

    def _start_lookup(self, request: Request) -> None:
        # NOTE: as the prefix cache's match, one prompt token is always left to compute (it gives the logits).
        num_blocks = (request.num_prompt_tokens - 1) // self.block_size
        num_local = len(self._prefix_cache.match(request.prompt_token_ids)[0])
        is_handed_off = _state(request).is_handed_off
        min_blocks = 1 if is_handed_off else self.config.min_blocks
        if num_blocks - num_local < min_blocks:
            return
        keys = self.digests(request)[num_local:num_blocks]
        leader = self._fetching.get(keys[0])
        if leader is not None:  # NOTE: requests that arrive together with one prompt prefix fetch it once
            lookup = _Lookup(request, num_local, leader.ticket, self._clock(), keys[0], is_follower=True)
        else:
            ticket = next(self._tickets)
            self._io.fetch(FetchOrder(ticket, keys, min_blocks, at_any_cost=is_handed_off))
            lookup = _Lookup(request, num_local, ticket, self._clock(), keys[0])
            self._fetching[keys[0]] = lookup
        self._lookups[request.request_id] = lookup
        request.is_fetching_kv = True
        self._stats.num_lookups += 1

    def _take_answers(self) -> None:
        """Drain the I/O's answers: count publishes and rejected blocks, and keep each fetch's answer for the
        lookups waiting for it (:meth:`poll` loads it)."""
        for answer in self._io.take_answers():
            if isinstance(answer, Published):
                self._count_publish(answer)
                continue
            if answer.rejected is not None:
                self._count_rejection(answer)
            if any(lookup.ticket == answer.ticket for lookup in self._lookups.values()):
                self._answers[answer.ticket] = answer

    def _count_rejection(self, fetched: Fetched) -> None:
        """A fetched block failed verification (the I/O discarded it from the store, so the block computed in its
        place can be published under its address): counted and logged."""
        self._stats.num_rejected_blocks += 1
        logger.warning("fleet cache: rejected a fetched block (%s); computing it and the %d held after it",
                       fetched.rejected, fetched.num_held - len(fetched.blocks) - 1,
                       extra={"event": "fleet_block_rejected", "digest": fetched.keys[len(fetched.blocks)].hex()})

    def poll(self, wait_s: float = 0.0) -> None:
        """Load finished fetches into the device pool and release their requests; give up on slow ones.

        Args:
            wait_s: wait this long for a fetch to finish when none has (the engine has nothing else to run).
        """
        self._take_answers()
        self._check_admitted()
        if not self._lookups:
            return
        if wait_s > 0 and not any(lookup.ticket in self._answers for lookup in self._lookups.values()):
            self._io.wait(wait_s)
            self._take_answers()
        now_s = self._clock()
        for request_id, lookup in list(self._lookups.items()):
            request = lookup.request
            if request.status is not RequestStatus.WAITING:  # aborted (or finished) while it waited
                self._end(lookup)
                continue
            fetched = self._answers.get(lookup.ticket)
            if fetched is not None:
                self._end(lookup)
                self._finish_lookup(lookup, fetched)
            elif now_s - lookup.started_s > self.config.max_wait_s:
                self._end(lookup)
                num_blocks = (request.num_prompt_tokens - 1) // self.block_size - lookup.first_index
                self._fall_back(Fallback.TIMEOUT, num_blocks)
                logger.warning("fleet cache: blocks did not arrive within max_wait_s; computing them",
                               extra={"event": "fleet_fetch_timeout", "request_id": request_id})

    def _end(self, lookup: _Lookup) -> None:
        """The request stops waiting for this lookup (its fetch is cancelled unless another request waits for it)."""
        del self._lookups[lookup.request.request_id]
        lookup.request.is_fetching_kv = False
        if self._fetching.get(lookup.first_key) is lookup:
            del self._fetching[lookup.first_key]
        if not any(other.ticket == lookup.ticket for other in self._lookups.values()):
            self._answers.pop(lookup.ticket, None)
            self._io.cancel(lookup.ticket)

    def _finish_lookup(self, lookup: _Lookup, fetched: Fetched) -> None:
        exc = fetched.error
        if exc is not None:  # the store failed: compute the blocks, count it
            num_blocks = (lookup.request.num_prompt_tokens - 1) // self.block_size - lookup.first_index
            self._fall_back(Fallback.ERROR, num_blocks)
            logger.warning("fleet cache: lookup failed (%s: %s); computing the blocks", type(exc).__name__, exc,
                           extra={"event": "fleet_store_error", "request_id": lookup.request.request_id})
            return
        if fetched.is_too_dear:
            self._fall_back(Fallback.COST, fetched.num_held)
            return
        if fetched.rejected is not None:  # NOTE: computed again, so published again (the bad value is gone)
            for key in fetched.keys[len(fetched.blocks):]:
                self._known.pop(key, None)
        blocks, num_held = fetched.blocks, fetched.num_held
        request = lookup.request
        if lookup.is_follower:  # NOTE: the leader's prompt may go on differently after the blocks they share
            num_blocks = (request.num_prompt_tokens - 1) // self.block_size
            own_keys = self.digests(request)[lookup.first_index:num_blocks]
            num_shared = next((i for i, (a, b) in enumerate(zip(own_keys, fetched.keys)) if a != b),
                              min(len(own_keys), len(fetched.keys)))
            blocks, num_held = blocks[:num_shared], min(num_held, num_shared)
        if fetched.rejected is not None and len(blocks) < num_held:
            self._fall_back(Fallback.REJECTED, num_held - len(blocks))
        if not blocks:
            return  # a miss: nothing (or nothing verified) was there to fetch
        if not lookup.is_follower:
            self._stats.fetch_seconds += fetched.seconds
            self._stats.num_fetched_blocks += len(fetched.blocks)
            self._stats.num_fetched_bytes += sum(map(len, fetched.blocks))
        num_loaded = self._load(lookup, blocks)
        if isinstance(num_loaded, Fallback):
            self._fall_back(num_loaded, len(blocks))
            return
        if lookup.is_follower and num_shared < len(own_keys) and len(blocks) == num_shared:
            self._start_lookup(request)  # its own blocks after the shared ones
        self._stats.num_hits += 1
        self._stats.num_hit_blocks += num_loaded
        self._loaded[lookup.request.request_id] = (lookup.request, lookup.first_index + len(blocks))

    def _load(self, lookup: _Lookup, blocks: list[memoryview]) -> int | Fallback:
        """Write fetched blocks into free device blocks and index them (cached, evictable), after the
        leading blocks the local cache holds now.

        Returns:
            The blocks written; or why none could be: no room, or the local blocks the fetched ones follow
            were reused meanwhile (the chain would have a gap).
        """
        token_ids = lookup.request.prompt_token_ids
        pool = self._block_manager.gpu_pool
        hit_block_ids, entry_ids = self._prefix_cache.match(token_ids)
        num_local = len(hit_block_ids)
        if num_local < lookup.first_index:
            return Fallback.EVICTED
        wanted = blocks[num_local - lookup.first_index:]
        if not wanted:
            return 0  # another request computed or fetched them meanwhile
        pool.share(hit_block_ids)  # NOTE: pinned, so taking blocks below cannot evict the chain it extends
        try:
            new_block_ids = pool.take(len(wanted))
            if new_block_ids is None:
                return Fallback.NO_ROOM
            self._block_io.write_blocks(new_block_ids, wanted)
            num_tokens = (num_local + len(wanted)) * self.block_size
            self._prefix_cache.register(token_ids, hit_block_ids + new_block_ids, entry_ids, num_tokens)
            pool.release(new_block_ids)  # indexed: they stay cached until a hit takes them
        finally:
            pool.release(hit_block_ids)
        for digest in self.digests(lookup.request)[num_local:num_local + len(wanted)]:
            self._remember(digest)
        return len(wanted)

    def _check_admitted(self) -> None:
        """Blocks loaded for a request and lost before it was admitted (reused by other work) count as a
        fallback: it computed them again. So do a handed-off request's prompt blocks it computed itself."""
        for request_id, handed_off in list(self._handed_off.items()):
            if handed_off.status is not RequestStatus.WAITING:
                del self._handed_off[request_id]
                num_blocks = (handed_off.num_prompt_tokens - 1) // self.block_size
                # NOTE: admitted, whatever its status now (one may finish in its admission step: max_tokens=1, EOS);
                # a request that finished waiting (aborted, never fits) computed nothing.
                if handed_off.first_scheduled_time_s is not None:
                    num_cached = handed_off.num_cached_prompt_tokens // self.block_size
                    self._stats.handoff_recomputed_blocks += num_blocks - num_cached
        for request_id, (request, num_loaded) in list(self._loaded.items()):
            if request.status is RequestStatus.WAITING:
                continue
            del self._loaded[request_id]
            num_lost = num_loaded - request.num_cached_prompt_tokens // self.block_size
            if num_lost > 0 and request.first_scheduled_time_s is not None:
                self._fall_back(Fallback.EVICTED, num_lost)

    def _fall_back(self, reason: Fallback, num_blocks: int) -> None:
        self._stats.fallbacks[reason.value] += 1
        self._stats.fallback_blocks += max(0, num_blocks)

    # ---- engine thread: publishing ---------------------------------------------------------------

    def publish(self, blocks: list[tuple[Request, int, int]]) -> None:
        """Copy newly computed prompt blocks out of the device pool and put them to the store off the engine
        thread; blocks this engine published or fetched lately are skipped.

        Args:
            blocks: ``(request, block index in its prompt, device block id)`` of blocks the prefix cache just
                indexed (the scheduler collects them after each step).
        """
        self._check_admitted()  # NOTE: after every step, so the books include requests admitted and finished in it
        keys, block_ids = [], []
        for request, index, block_id in blocks:
            digest = self.digests(request)[index]
            if digest not in self._known:
                self._remember(digest)
                keys.append(digest)
                block_ids.append(block_id)
        if not keys:
            return
        # NOTE: copied now, on the engine thread: the blocks may be reused by the next step.
        self._io.publish(keys, self._block_io.read_blocks(block_ids))

    def _count_publish(self, published: Published) -> None:
        """A publish's answer: the blocks put, or (the store failed) counted and logged, the blocks staying local
        (and publishable again)."""
        exc = published.error
        if exc is not None:
            self._stats.num_publish_errors += 1
            for key in published.keys:
                self._known.pop(key, None)
            logger.warning("fleet cache: publishing %d blocks failed (%s: %s)", len(published.keys),
                           type(exc).__name__, exc, extra={"event": "fleet_store_error"})
            return
        self._stats.num_published_blocks += published.num_blocks
        self._stats.num_published_bytes += published.num_bytes

    def _remember(self, digest: bytes) -> None:
        self._known[digest] = None
        self._known.move_to_end(digest)
        if len(self._known) > KNOWN_DIGESTS:
            self._known.popitem(last=False)

    def barrier(self) -> Future[None]:
        """Done once every publish started so far is done (publishes run in order): a prefill worker hands a
        request on only after its blocks are in the store."""
        return self._io.barrier()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every publish started so far is done, and count them; whether they all finished in time."""
        is_done = self._io.flush(timeout_s)
        self._take_answers()
        return is_done

    def close(self) -> None:
        """Stop the I/O's threads (publishes in flight finish; lookups are dropped)."""
        self._io.close()
