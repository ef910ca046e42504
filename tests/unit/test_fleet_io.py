"""The fleet cache over the worker's I/O, without a model: blocks one engine publishes are fetched, verified and
loaded by another through the answers the engine drains at its step boundaries; a rejected block is counted,
discarded from the store and never loaded; a failing store is counted on both paths. The device pool is bytes."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from tests.doubles import LocalBlockStore
from tokenmill.engine.config import FleetCacheConfig
from tokenmill.engine.core.fleet_cache import FleetCache
from tokenmill.engine.core.request import Request
from tokenmill.engine.kv.block_manager import BlockManager
from tokenmill.engine.kv.block_store import block_digests, seal
from tokenmill.engine.kv.fetch_rules import FetchRules, TransferCost
from tokenmill.engine.kv.prefix_cache import PrefixCache
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.store_io import StoreFleetIO

BLOCK_SIZE = 4
BLOCK_BYTES = 8
ROOT = b"r" * 16
PROMPT = list(range(1, 15))  # three full blocks, and two tokens after them


class BytesPool:
    """A device pool of bytes; a block whose bytes start with 0xFF holds values no model computes."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [bytes([i]) * BLOCK_BYTES for i in range(num_blocks)]

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [self.blocks[i] for i in block_ids]

    def write_blocks(self, block_ids: list[int], blocks: Sequence[bytes | memoryview]) -> None:
        for block_id, block in zip(block_ids, blocks, strict=True):
            self.blocks[block_id] = bytes(block)

    def check_blocks(self, blocks: Sequence[bytes | memoryview]) -> list[str | None]:
        return ["implausible values" if bytes(block[:1]) == b"\xff" else None for block in blocks]


class _FailingStore(LocalBlockStore):
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        raise ConnectionError("store down")


def _fleet(store: LocalBlockStore, num_blocks: int = 16,
           min_blocks: int = 1) -> tuple[FleetCache, BytesPool, PrefixCache]:
    pool = BytesPool(num_blocks)
    prefix_cache = PrefixCache(BLOCK_SIZE)
    manager = BlockManager(num_blocks, 0, BLOCK_SIZE, prefix_cache)
    cost = TransferCost(BLOCK_BYTES, BLOCK_SIZE)
    io = StoreFleetIO(store, FetchRules(cost, BLOCK_BYTES, pool.check_blocks))
    fleet = FleetCache(FleetCacheConfig(enabled=True, min_blocks=min_blocks), io, ROOT, pool, cost, manager,
                       prefix_cache)
    return fleet, pool, prefix_cache


def _request(request_id: str = "r") -> Request:
    return Request(request_id, list(PROMPT), SamplingParams(max_tokens=4), arrival_time_s=0.0)


def _poll_until_done(fleet: FleetCache, request: Request) -> None:
    deadline = time.monotonic() + 10
    while request.is_fetching_kv and time.monotonic() < deadline:
        fleet.poll(wait_s=0.05)
    assert not request.is_fetching_kv


def _publish_prompt(store: LocalBlockStore) -> list[bytes]:
    """The prompt's three blocks as a first engine publishes them; their payloads."""
    fleet, pool, _ = _fleet(store)
    request = _request("first")
    fleet.publish([(request, index, 5 + index) for index in range(3)])
    assert fleet.flush(timeout_s=10)
    stats = fleet.stats()
    assert (stats.num_published_blocks, stats.num_published_bytes) == (3, 3 * BLOCK_BYTES)
    fleet.close()
    return pool.read_blocks([5, 6, 7])


def test_published_blocks_are_fetched_verified_and_loaded_as_prefix_hits() -> None:
    store = LocalBlockStore()
    payloads = _publish_prompt(store)
    assert len(store) == 3
    fleet, pool, prefix_cache = _fleet(store)
    request = _request()
    fleet.look_up(request)
    assert request.is_fetching_kv and fleet.num_fetching == 1
    _poll_until_done(fleet, request)
    hit_block_ids, _ = prefix_cache.match(PROMPT)
    assert pool.read_blocks(hit_block_ids) == payloads
    stats = fleet.stats()
    assert (stats.num_hits, stats.num_hit_blocks, stats.num_fetched_blocks) == (1, 3, 3)
    assert stats.num_fallbacks == 0 and stats.num_rejected_blocks == 0
    fleet.close()


def test_a_handed_off_request_fetches_what_a_plain_one_would_not() -> None:
    """A prefill worker made its blocks for it: fetched below ``min_blocks`` (and whatever they cost)."""
    store = LocalBlockStore()
    _publish_prompt(store)
    fleet, _, prefix_cache = _fleet(store, min_blocks=4)
    plain, handed_off = _request("plain"), _request("handed-off")
    fleet.look_up(plain)
    assert not plain.is_fetching_kv  # three blocks are fewer than min_blocks
    fleet.look_up(handed_off, is_handed_off=True)
    _poll_until_done(fleet, handed_off)
    assert len(prefix_cache.match(PROMPT)[0]) == 3
    stats = fleet.stats()
    assert (stats.num_handoffs, stats.num_lookups, stats.num_hit_blocks) == (1, 1, 3)
    fleet.close()


def test_a_rejected_block_is_counted_discarded_and_never_loaded(caplog: pytest.LogCaptureFixture) -> None:
    store = LocalBlockStore()
    _publish_prompt(store)
    keys = block_digests(ROOT, PROMPT, BLOCK_SIZE)
    store.discard([keys[1]])
    store.put([keys[1]], [seal(keys[1], b"\xff" * BLOCK_BYTES)])  # sealed as a worker would: only its values tell
    fleet, _, prefix_cache = _fleet(store)
    request = _request()
    fleet.look_up(request)
    with caplog.at_level("WARNING", logger="tokenmill.engine.core.fleet_cache"):
        _poll_until_done(fleet, request)
    rejections = [r for r in caplog.records if getattr(r, "event", None) == "fleet_block_rejected"]
    assert len(rejections) == 1 and "implausible values" in rejections[0].getMessage()
    assert getattr(rejections[0], "digest", None) == keys[1].hex()
    assert len(prefix_cache.match(PROMPT)[0]) == 1  # the block before the bad one
    stats = fleet.stats()
    assert stats.num_rejected_blocks == 1 and stats.fallbacks["rejected"] == 1 and stats.fallback_blocks == 2
    assert store.contains(keys) == [True, False, True]  # the bad value is gone: the computed block can replace it
    fleet.close()


def test_a_failing_store_is_counted_on_both_paths() -> None:
    fleet, _, prefix_cache = _fleet(_FailingStore())
    request = _request()
    fleet.look_up(request)
    _poll_until_done(fleet, request)
    fleet.publish([(request, 0, 3)])
    assert fleet.flush(timeout_s=10)
    stats = fleet.stats()
    assert stats.fallbacks["error"] == 1 and stats.num_publish_errors == 1 and stats.num_hits == 0
    assert prefix_cache.match(PROMPT) == ([], [])
    fleet.close()
