"""Reclaiming entries of dead consumers (stale or stopped heartbeat) and removing those consumers,
in the lanes this worker reads only: it never takes a request for a model it does not serve.

Imports redis, protocol.keys and worker.heartbeat; never the engine. Entries of a consumer with
a fresh heartbeat are never taken, however long its generation runs. Claims move ownership only
(``JUSTID``: the delivery count stays): an entry counts as delivered again when it runs
(:class:`worker.pending.OwnPending`), so entries that wait here behind a suspect are not counted
again if the suspect kills this worker too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import redis

from tokenmill.protocol.keys import CONSUMER_GROUP, Keys, Lane
from tokenmill.worker.heartbeat import Heartbeat, Workers, as_text, is_dead, read_workers
from tokenmill.worker.pending import Pending, alone_key, list_pending, pending_entry
from tokenmill.worker.poison import find_culprit

log = logging.getLogger("tokenmill.worker")

# NOTE: deleting a consumer drops its pending entries, so the emptiness check and the delete
# must be one atomic step: a consumer that got an entry in between is kept.
# Its mark of an entry run alone (worker/poison.py) goes with it.
#   KEYS: 1 lane stream, 2 its alone-marks hash. ARGV: 1 group, 2 consumer.
DELETE_IF_IDLE_LUA = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) == 0 then
  redis.call('HDEL', KEYS[2], ARGV[2])
  return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
end
return -1
"""


class Reclaimer:
    """Takes pending entries of dead consumers over to this worker.

    Args:
        client: Redis client.
        keys: key layout of the served queue.
        lanes: the lanes this worker reads, most urgent first (:meth:`Keys.lanes_for`): the only ones it
            reclaims from.
        consumer: this worker's consumer name.
        stale_after_s: heartbeat age after which a worker counts as dead.
        min_idle_ms: an entry must be idle this long to be claimed; guards two reclaimers racing.
    """

    def __init__(self, client: redis.Redis, keys: Keys, lanes: Sequence[Lane], consumer: str, stale_after_s: float,
                 min_idle_ms: int) -> None:
        self._client = client
        self._keys = keys
        self._lanes = list(lanes)
        self._consumer = consumer
        self._stale_after_s = stale_after_s
        self._min_idle_ms = min_idle_ms
        self._delete_if_idle = client.register_script(DELETE_IF_IDLE_LUA)

    @property
    def lanes(self) -> list[Lane]:
        return self._lanes

    @lanes.setter
    def lanes(self, lanes: Sequence[Lane]) -> None:
        """The lanes to reclaim from from now on (those of the shards this worker reads: worker/shard_claims.py)."""
        self._lanes = list(lanes)

    def reclaim(self, limit: int, workers: Workers | None = None) -> list[Pending]:
        """Claim up to ``limit`` entries of dead consumers, most urgent lane first; now pending for
        this worker, with the delivery counts they had.

        Dead consumers left with no pending entries are removed from the group.

        Args:
            limit: the most entries to claim.
            workers: every worker's heartbeat and the server's time, read just now; None reads them.
        """
        # NOTE: judged by the server's clock, never this worker's (protocol/heartbeat.py)
        beats, now_s = workers if workers is not None else read_workers(self._client, self._keys)
        claimed: list[Pending] = []
        culprits: dict[str, tuple[str, str] | None] = {}  # dead consumer -> the entry it ran alone, looked up once
        for lane in self._lanes:
            for consumer in self._dead_consumers(lane.stream, beats, now_s):
                name = consumer["name"]
                if consumer["pending"] == 0:
                    self._remove(lane.stream, name)
                elif len(claimed) < limit:
                    if name not in culprits:
                        culprits[name] = find_culprit(self._client, name, beats.get(name), self._lanes)
                    culprit = culprits[name]
                    claimed += self._claim(lane.stream, lane.priority, name, limit - len(claimed),
                                           culprit[1] if culprit is not None and culprit[0] == lane.stream else None)
        return claimed

    def _dead_consumers(self, stream: str, beats: dict[str, Heartbeat], now_s: float) -> list[dict[str, Any]]:
        try:
            consumers = self._client.xinfo_consumers(stream, CONSUMER_GROUP)
        except redis.ResponseError:  # stream or group vanished: nothing to reclaim
            return []
        out = []
        for consumer in consumers:
            name = as_text(consumer["name"])
            if name != self._consumer and is_dead(name, int(consumer["idle"]), beats, now_s, self._stale_after_s):
                out.append({"name": name, "pending": int(consumer["pending"])})
        return out

    def _claim(self, stream: str, lane: int, owner: str, limit: int, culprit: str | None) -> list[Pending]:
        """Up to ``limit`` of ``owner``'s entries in ``stream``; ``culprit`` (an entry id) is claimed first and marked
        as having killed its worker."""
        listed = list_pending(self._client, stream, lane, owner, limit)
        if culprit is not None:
            found = pending_entry(self._client, stream, lane, owner, culprit)
            others = [p for p in listed if p.entry_id != culprit]
            listed = others if found is None else [replace(found, killed_its_worker=True), *others][:limit]
        pending = {p.entry_id: p for p in listed}
        if not pending:
            return []
        claimed: Any = self._client.xclaim(stream, CONSUMER_GROUP, self._consumer, self._min_idle_ms,
                                           list(pending), justid=True)
        # NOTE: an entry deleted from the stream meanwhile is dropped by XCLAIM (Redis 7) or comes
        # back here and is acked when it is delivered (6.2)
        out = [pending[as_text(entry_id)] for entry_id in claimed if as_text(entry_id) in pending]
        if out:
            log.info("reclaimed", extra={"event": "reclaimed", "count": len(out), "from": owner, "stream": stream})
        return out

    def _remove(self, stream: str, name: str) -> None:
        if int(self._delete_if_idle(keys=[stream, alone_key(stream)], args=[CONSUMER_GROUP, name])) >= 0:
            log.info("consumer removed", extra={"event": "consumer_removed", "consumer": name, "stream": stream})
