"""Reading the lanes (worker/lane_reads.py): one script call per shard takes what one XREADGROUP per lane took,
in the same order, the count shared across the lanes, blocking only when every lane is empty."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from tokenmill.protocol.keys import CONSUMER_GROUP, Lane
from tokenmill.protocol.shards import QueueLayout
from tokenmill.worker.lane_reads import LaneReads, _same_shard_runs


def _reads(client: redis.Redis, prefix: str, num_shards: int = 1) -> tuple[LaneReads, QueueLayout]:
    layout = QueueLayout.build(prefix, "q", 3, num_shards=num_shards)
    reads = LaneReads(client, layout, "c1", layout.lanes_for(frozenset({"m"})), frozenset({"m"}))
    reads.read_shards(range(num_shards))
    reads.ensure_groups()
    return reads, layout


class CountingClient(redis.Redis):
    """A client that counts the commands it sends (a pipeline's are sent as one)."""

    num_commands = 0

    def execute_command(self, *args: Any, **options: Any) -> Any:
        type(self).num_commands += 1
        return super().execute_command(*args, **options)


def test_one_call_takes_the_lanes_in_priority_order_up_to_the_count(redis_url: str, key_prefix: str) -> None:
    client = CountingClient.from_url(redis_url)
    reads, layout = _reads(client, key_prefix)
    keys = layout.home
    assert reads.read(count=7, block_ms=None) == []  # NOTE: the first call also loads the script
    # lane 2 filled first, then lane 1 (shared and the model's), then lane 0: the read goes by lane, not by age
    for priority, model in ((2, None), (1, "m"), (1, None), (0, "m")):
        for i in range(3):
            client.xadd(keys.lane(priority, model), {"n": f"{priority}-{model}-{i}"})
    before = CountingClient.num_commands
    entries = reads.read(count=7, block_ms=None)
    assert CountingClient.num_commands - before == 1  # NOTE: every lane of the shard in one round trip
    taken = [(entry.stream, entry.fields[b"n"].decode(), entry.lane) for entry in entries]
    assert taken == [(keys.lane(0, "m"), f"0-m-{i}", 0) for i in range(3)] + \
        [(keys.lane(1, None), f"1-None-{i}", 1) for i in range(3)] + [(keys.lane(1, "m"), "1-m-0", 1)]
    # the rest comes next, in order, and each entry went to this consumer once
    rest = reads.read(count=100, block_ms=None)
    assert [entry.fields[b"n"].decode() for entry in rest] == ["1-m-1", "1-m-2", "2-None-0", "2-None-1", "2-None-2"]
    num_pending = sum(client.xpending(lane.stream, CONSUMER_GROUP)["pending"] for lane in reads.reading)
    assert num_pending == 12
    assert reads.read(count=10, block_ms=None) == []
    client.close()


def test_an_empty_queue_blocks_until_an_entry_comes(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    reads, layout = _reads(client, key_prefix)
    assert reads.read(count=5, block_ms=50) == []  # waited, found nothing
    client.xadd(layout.home.lane(2), {"n": "late"})
    [entry] = reads.read(count=5, block_ms=50)
    assert entry.fields == {b"n": b"late"} and entry.lane == 2
    client.close()


def test_a_missing_group_is_the_read_s_nogroup_error(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    reads, layout = _reads(client, key_prefix)
    client.delete(layout.home.lane(0))  # NOTE: the stream and its group gone (a queue deleted under the worker)
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        reads.read(count=5, block_ms=None)
    client.close()


def test_runs_of_one_shard_keep_the_order() -> None:
    lanes = [Lane(f"s{shard}:{priority}", priority, None, False, shard)
             for priority, shard in ((0, 0), (0, 0), (0, 1), (1, 1), (1, 0))]
    assert [[lane.stream for lane in run] for run in _same_shard_runs(lanes)] == \
        [["s0:0", "s0:0"], ["s1:0", "s1:1"], ["s0:1"]]
    assert _same_shard_runs([]) == []
