"""Entries in a consumer's pending list: listing them (XPENDING), and this worker's own list
(:class:`OwnPending`): the backlog an earlier process under its name left, the entries whose delivery
never reached it, and delivering one of them again, atomically and only while it is still this
worker's (Lua).

A pending entry that is delivered again is the one Redis counts: XPENDING's ``times_delivered``
is how often the entry reached a worker, which ``max_deliveries`` and the quarantine of suspects
read (docs/design.md, "Reclaim by heartbeats"). Imports redis and protocol.keys; never the engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from tokenmill.protocol.keys import CONSUMER_GROUP, Lane
from tokenmill.worker.heartbeat import as_text
from tokenmill.worker.messages import Entry
from tokenmill.worker.state import Load

PENDING_PAGE = 1000  # entries per XPENDING while comparing the pending list with what is held

# NOTE: XCLAIM with min-idle 0 takes an entry from whoever holds it; the ownership check and the
# claim must be one step, so a worker never takes back what a reclaimer took from it. A delivery
# that does not count (an entry whose reply was lost on the way) keeps the count (RETRYCOUNT).
# An entry deleted from the stream meanwhile is acked: there is nothing left to run. A counted delivery (a
# suspect about to run alone) also marks the entry as the one this consumer runs alone, in the same step, so a
# death that follows is charged to it (worker/poison.py).
#   KEYS: 1 lane stream, 2 its alone-marks hash. ARGV: 1 group, 2 entry id, 3 consumer, 4 count this delivery (1/0).
#   Returns nil when the entry is not this consumer's, else {deliveries, fields or nil}.
DELIVER_OWN_LUA = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then return false end
local count = tonumber(p[1][4])
local claim = {'XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2]}
if ARGV[4] == '1' then
  count = count + 1
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[2])
else
  claim[#claim + 1] = 'RETRYCOUNT'
  claim[#claim + 1] = count
end
local claimed = redis.call(unpack(claim))
if #claimed == 0 or not claimed[1][2] then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  return {count, false}
end
return {count, claimed[1][2]}
"""


def alone_key(stream: str) -> str:
    """The hash of the suspects run alone from ``stream`` (consumer -> entry id); on the stream's cluster slot
    (the stream's hash tag comes first). Read by worker/poison.py, cleared with the consumer (worker/reclaim.py)."""
    return f"{stream}:alone"


@dataclass(frozen=True)
class Pending:
    """An entry in a consumer's pending list: delivered, not acked."""

    stream: str  # the lane stream
    lane: int
    entry_id: str
    num_deliveries: int  # how often Redis delivered it so far
    killed_its_worker: bool = False  # its last worker died running it alone (worker/poison.py): dead-letter it

    @property
    def key(self) -> tuple[str, str]:
        """What :class:`worker.state.Load` holds it by."""
        return self.stream, self.entry_id


def list_pending(client: redis.Redis, stream: str, lane: int, consumer: str, count: int,
                 after: str | None = None) -> list[Pending]:
    """Up to ``count`` entries pending for ``consumer`` in ``stream``, oldest first, after id ``after``."""
    start = "-" if after is None else f"({after}"
    rows = client.xpending_range(stream, CONSUMER_GROUP, min=start, max="+", count=count, consumername=consumer)
    return [Pending(stream, lane, as_text(row["message_id"]), int(row["times_delivered"])) for row in rows]


def pending_entry(client: redis.Redis, stream: str, lane: int, consumer: str, entry_id: str) -> Pending | None:
    """Entry ``entry_id`` of ``stream`` if it is pending for ``consumer``, else None."""
    rows: Any = client.xpending_range(stream, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1,
                                      consumername=consumer)
    return Pending(stream, lane, entry_id, int(rows[0]["times_delivered"])) if rows else None


class OwnPending:
    """This worker's own pending list, on every lane it may read: what an earlier process under its name left
    (the backlog, taken a page at a time, most urgent lane first), what it holds no longer (a delivery whose
    reply was lost: looked for every ``check_interval_s``, and at once when asked), and delivering one of these
    entries again (see :data:`DELIVER_OWN_LUA`).

    Args:
        client: Redis client (the reader thread's).
        consumer: this worker's consumer name.
        lanes: every lane this worker may read (of every shard), most urgent first.
        check_interval_s: how often the pending list is compared with what the worker holds.
    """

    def __init__(self, client: redis.Redis, consumer: str, lanes: Sequence[Lane], check_interval_s: float) -> None:
        self._client, self._consumer = client, consumer
        self._lane_of = {lane.stream: lane for lane in lanes}
        self._script = client.register_script(DELIVER_OWN_LUA)
        # Lanes whose entries already delivered to this consumer name are still to be taken (a restart under the
        # same --name), with the id to list after (None: from the start).
        self._backlog: dict[str, str | None] = dict.fromkeys(self._lane_of)
        self._check_interval_s = check_interval_s
        self._next_check_s = time.monotonic() + check_interval_s
        self._is_check_asked = False  # a connection failed: a reply may have been lost on the way

    @property
    def has_backlog(self) -> bool:
        return bool(self._backlog)

    def backlog_page(self, count: int) -> list[Pending]:
        """The next page of the backlog, of its most urgent lane left (a page shorter than ``count`` ends the lane)."""
        stream = next(iter(self._backlog))
        page = list_pending(self._client, stream, self._lane_of[stream].priority, self._consumer, count,
                            after=self._backlog[stream])
        if len(page) < count:
            del self._backlog[stream]
        else:
            self._backlog[stream] = page[-1].entry_id
        return page

    def forget_backlog(self) -> None:
        """The consumer group was re-created: it has no pending entries of this worker's."""
        self._backlog.clear()

    def ask_for_check(self) -> None:
        """A command may have run without its reply arriving: compare the pending list with what is held soon."""
        self._is_check_asked = True

    def is_check_due(self, now_s: float) -> bool:
        return self._is_check_asked or now_s >= self._next_check_s

    def lost(self, load: Load) -> list[Pending]:
        """The entries pending for this worker that it does not hold (``load``): each was delivered by a command
        whose reply never arrived. Schedules the next check."""
        self._is_check_asked = False
        self._next_check_s = time.monotonic() + self._check_interval_s
        lost: list[Pending] = []
        for stream, lane in self._lane_of.items():
            held = load.held_ids(stream)
            after = None
            while True:
                page = list_pending(self._client, stream, lane.priority, self._consumer, PENDING_PAGE, after=after)
                lost += [p for p in page if p.entry_id not in held]
                if len(page) < PENDING_PAGE:
                    break
                after = page[-1].entry_id
        return lost

    def deliver(self, item: Pending, *, is_counted: bool) -> tuple[Entry | None, int]:
        """The entry's fields once more, with its delivery count after this delivery.

        Args:
            item: an entry pending for this worker.
            is_counted: this delivery counts (a suspect about to run) or not (a lost reply recovered).

        Returns:
            ``(entry, deliveries)``; the entry is None when it is no longer this worker's (answered,
            or taken by a reclaimer) or was deleted from the stream (then it is acked).
        """
        reply: Any = self._script(keys=[item.stream, alone_key(item.stream)],
                                  args=[CONSUMER_GROUP, item.entry_id, self._consumer, int(is_counted)])
        if reply is None:
            return None, item.num_deliveries
        count, flat = int(reply[0]), reply[1]
        if not flat:
            return None, count
        fields = dict(zip(flat[0::2], flat[1::2]))
        return Entry(item.stream, item.entry_id, item.lane, fields), count
