"""Reading the lanes: which lanes a worker of a role reads (:func:`lanes_for_role`), their consumer groups, and the
XREADGROUPs that take new entries from them, lane 0 first, the shards in turn within a priority, blocking only when
every lane is empty.

A read is one round trip per shard (:data:`READ_LANES_LUA`), not one per lane: a worker reads 2 x 3 lanes (shared and
its model's, three priorities), and each round trip of the reader thread waits for the GIL behind the engine thread.

On a sharded queue (protocol/shards.py) a worker reads the lanes of the shards it claims (worker/shard_claims.py;
every shard by default). Imports redis and protocol (keys, shards); never the engine.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import redis

from tokenmill.protocol.keys import CONSUMER_GROUP, Keys, Lane
from tokenmill.protocol.shards import QueueLayout
from tokenmill.worker.heartbeat import as_text
from tokenmill.worker.messages import Entry

# NOTE: on a cluster one XREADGROUP names one shard's lanes: an idle worker blocks on the shards in turn, this
# long each (after a non-blocking look at every one), so a request on any shard waits about this long at most.
SHARD_BLOCK_MS = 25

# NOTE: the non-blocking reads of one shard's lanes in one call, in the order given (most urgent first), each taking
# what the earlier ones left of the count: the entries and their order are those of one XREADGROUP per lane. A script
# may run XREADGROUP (never blocking); every lane of a shard is in its slot (protocol/shards.py). A missing group is
# the call's NOGROUP error, as a plain XREADGROUP's.
#   KEYS: the lanes.  ARGV: 1 group, 2 consumer, 3 count
#   Returns: per lane that gave entries, its name and its entries (each: id, flat field list)
READ_LANES_LUA = """
local left = tonumber(ARGV[3])
local out = {}
for i = 1, #KEYS do
  if left <= 0 then break end
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS', KEYS[i], '>')
  if reply then
    local entries = reply[1][2]
    out[#out + 1] = KEYS[i]
    out[#out + 1] = entries
    left = left - #entries
  end
end
return out
"""


def lanes_for_role(keys: Keys | QueueLayout, model_names: frozenset[str], role: str,
                   is_fleet_cache_on: bool) -> list[Lane]:
    """The lanes a worker of ``role`` reads (of every shard), most urgent first: a prefill worker the request lanes,
    a decode worker the decode pool's, a worker doing both the request lanes and, with the fleet cache on (a fleet
    that may have prefill workers), the decode pool's too (within a priority the decode lane first: its prompt is
    computed already)."""
    request_lanes = keys.lanes_for(model_names) if role != "decode" else []
    reads_decode = role == "decode" or (role == "both" and is_fleet_cache_on)
    decode_lanes = keys.lanes_for(model_names, is_decode=True) if reads_decode else []
    return sorted(decode_lanes + request_lanes, key=lambda lane: (lane.priority, not lane.is_decode))


class LaneReads:
    """Takes new entries from the lanes of the shards this worker reads now.

    Args:
        client: Redis client (a blocking read holds one connection of its pool).
        layout: the served queue's shards.
        consumer: this worker's consumer name.
        lanes: every lane this worker may read (of every shard), most urgent first.
        model_names: the names a request's ``model`` may give: registered in every shard with the groups.
    """

    def __init__(self, client: redis.Redis, layout: QueueLayout, consumer: str, lanes: list[Lane],
                 model_names: frozenset[str]) -> None:
        self._client, self._layout, self._consumer = client, layout, consumer
        self._model_names = model_names
        self.lane_of = {lane.stream: lane for lane in lanes}
        self._all_lanes = lanes
        self.reading: list[Lane] = []  # the lanes read now (those of the shards claimed)
        self.needs_groups = True  # (re-)create the consumer groups before the next read
        self._turn = 0  # rotates the shards' order within a priority, and the shard an idle read blocks on
        self._read_script = client.register_script(READ_LANES_LUA)

    def read_shards(self, shards: Collection[int]) -> None:
        """Read the lanes of ``shards`` from now on; their groups are made sure of before the next read."""
        self.reading = [lane for lane in self._all_lanes if lane.shard in shards]
        self.needs_groups = True

    def ensure_groups(self) -> None:
        """Create the consumer group on every lane read (MKSTREAM, from id 0) if missing, and register
        the model names in every shard (so stats list their lanes)."""
        for lane in self.reading:
            try:
                self._client.xgroup_create(lane.stream, CONSUMER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        if self._model_names:
            for keys in self._layout.shards:
                self._client.sadd(keys.models, *sorted(self._model_names))
        self.needs_groups = False

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` new entries, lane 0 (of every model and shard) first, the shards in turn within a lane;
        blocks only when every lane is empty (on a cluster, on one shard's lanes: :data:`SHARD_BLOCK_MS`)."""
        self._turn += 1
        num_shards = self._layout.num_shards
        order = sorted(self.reading, key=lambda lane: (lane.priority, not lane.is_decode,
                                                       (lane.shard - self._turn) % num_shards))
        entries: list[Entry] = []
        for run in _same_shard_runs(order):
            if len(entries) < count:
                entries += self._read_lanes(run, count - len(entries))
        groups = self._block_groups(order)
        if not entries and block_ms is not None and groups:
            if len(groups) > 1:
                block_ms = min(block_ms, SHARD_BLOCK_MS)
            entries = self._xreadgroup(dict.fromkeys(groups[self._turn % len(groups)], ">"), count, block_ms)
        return entries

    def _block_groups(self, lanes: list[Lane]) -> list[list[str]]:
        """The lanes one blocking XREADGROUP may name together: all of them on one instance, one shard's on a
        cluster (different slots cannot share a command)."""
        if not self._layout.is_cluster:
            return [[lane.stream for lane in lanes]] if lanes else []
        by_shard: dict[int, list[str]] = {}
        for lane in lanes:
            by_shard.setdefault(lane.shard, []).append(lane.stream)
        return [by_shard[shard] for shard in sorted(by_shard)]

    def _read_lanes(self, lanes: list[Lane], count: int) -> list[Entry]:
        """Up to ``count`` new entries of ``lanes`` (one shard's), the first lane first: one round trip."""
        reply: Any = self._read_script(keys=[lane.stream for lane in lanes],
                                       args=[CONSUMER_GROUP, self._consumer, count])
        out = []
        for index in range(0, len(reply), 2):
            stream = as_text(reply[index])
            priority = self.lane_of[stream].priority
            for eid, flat in reply[index + 1]:
                if flat:
                    out.append(Entry(stream, as_text(eid), priority, dict(zip(flat[::2], flat[1::2]))))
        return out

    def _xreadgroup(self, streams: dict[Any, Any], count: int, block_ms: int | None) -> list[Entry]:
        reply: Any = self._client.xreadgroup(CONSUMER_GROUP, self._consumer, streams, count=count, block=block_ms)
        out = []
        for raw_stream, items in reply or []:
            stream = as_text(raw_stream)
            out += [Entry(stream, as_text(eid), self.lane_of[stream].priority, dict(fields))
                    for eid, fields in items if fields]
        return out


def _same_shard_runs(lanes: list[Lane]) -> list[list[Lane]]:
    """``lanes`` cut into runs of consecutive lanes of one shard (each run one script call, the order kept)."""
    runs: list[list[Lane]] = []
    for lane in lanes:
        if runs and runs[-1][0].shard == lane.shard:
            runs[-1].append(lane)
        else:
            runs.append([lane])
    return runs
