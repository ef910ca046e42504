"""Waiting for results, shared by the sync and asyncio producers: the wait budget (:class:`Deadline`), the BLPOPs
on the done lists (one result, or many in rotating batches over the shards), the re-arm script that lets several
waiters see one done token, the pipelined reads of landed results, and the timeout error. No I/O here: the
producers send what this plans. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.producer.errors import JobFailed, ResultTimeout
from tokenmill.protocol.config import MAX_BLOCK_S
from tokenmill.protocol.schema import GenerationResult, decode_result
from tokenmill.protocol.shards import QueueLayout

# Longest single blocking command; a wait longer than this is a loop of such slices, each
# followed by a re-check of the result keys (so a lost wake-up costs at most one slice).
WAIT_SLICE_S = MAX_BLOCK_S
DONE_KEYS_PER_BLPOP = 256
# NOTE: on a cluster one BLPOP watches the done lists of one shard only: while results are awaited on several
# shards, each wait is this short, in turn over the shards (a result on another shard waits at most about this
# long per shard to be seen).
SHARDED_WAIT_SLICE_S = 0.05
MGET_CHUNK = 1000

# NOTE: the multiple-waiter scheme. The worker pushes one token onto the done list; a
# waiter's BLPOP consumes it, so the waiter puts it back for the others, but only while the
# result exists (else a waiter would pop and re-push forever). One script = one round trip
# that also returns the result. KEYS: result, done. ARGV: token, ttl seconds.
REARM_SCRIPT = """
local value = redis.call('GET', KEYS[1])
if value then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return value
"""


class Deadline:
    """A wait budget: ``timeout_s=None`` waits forever."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._end = math.inf if timeout_s is None else time.monotonic() + timeout_s

    @property
    def is_expired(self) -> bool:
        return time.monotonic() >= self._end

    def slice_s(self, cap_s: float) -> float:
        """Seconds to block next: the remaining budget, at most ``cap_s``, at least 1 ms."""
        return max(0.001, min(cap_s, self._end - time.monotonic()))


class OneResultWait:
    """The wait for one result (``Producer.result``, ``AsyncProducer.result``): its keys, its budget, and how long
    each BLPOP on its done list may block."""

    def __init__(self, layout: QueueLayout, request_id: str, timeout_s: float | None) -> None:
        keys = layout.for_id(request_id)
        self.request_id, self.timeout_s = request_id, timeout_s
        self.result_key, self.done_key = keys.result(request_id), keys.done(request_id)
        self.deadline = Deadline(timeout_s)

    def next_slice_s(self) -> float:
        """Seconds the next BLPOP may block: what is left of the budget, one wait slice at most.

        Raises:
            ResultTimeout: the budget has run out with no result.
        """
        if self.deadline.is_expired:
            raise timeout_error([self.request_id], self.timeout_s)
        return self.deadline.slice_s(WAIT_SLICE_S)


def finish(raw: bytes, *, raise_on_error: bool) -> GenerationResult:
    """Decode a stored result; raise :class:`JobFailed` for non-ok ones when asked."""
    result = decode_result(raw)
    if raise_on_error and not result.ok:
        raise JobFailed(result)
    return result


def timeout_error(missing_ids: Sequence[str], timeout_s: float | None) -> ResultTimeout:
    if len(missing_ids) == 1:
        return ResultTimeout(f"no result for request {missing_ids[0]!r} within {timeout_s} s")
    shown = ", ".join(repr(i) for i in missing_ids[:5]) + (", ..." if len(missing_ids) > 5 else "")
    return ResultTimeout(f"{len(missing_ids)} results did not land within {timeout_s} s: {shown}")


def rotate(pending: Sequence[str], offset: int) -> list[str]:
    """The next batch of ids to BLPOP on: up to ``DONE_KEYS_PER_BLPOP`` of them from ``offset`` on,
    wrapping around the end, each id at most once (``pending`` holds distinct ids)."""
    start = offset % len(pending)
    num_ids = min(DONE_KEYS_PER_BLPOP, len(pending))
    return [pending[(start + i) % len(pending)] for i in range(num_ids)]


def take_pending(pending: dict[str, None], request_id: str) -> bool:
    """Drop ``request_id`` from ``pending``; whether it was there, so a repeated id is yielded once."""
    if request_id not in pending:
        return False
    del pending[request_id]
    return True


@dataclass(frozen=True)
class WaitBatch:
    """One BLPOP of a wait for many results: the done lists it watches and for how long, and the ids to
    re-check (one MGET per slot group) when it times out."""

    key_to_id: dict[str, str]  # done-list key -> request id
    slice_cap_s: float  # the longest this wait may block
    recheck_ids: list[str]


def next_batch(layout: QueueLayout, pending: dict[str, None], turn: int, deadline: Deadline,
               timeout_s: float | None) -> WaitBatch:
    """The ``turn``-th BLPOP of a wait for ``pending``: up to ``DONE_KEYS_PER_BLPOP`` done lists of one slot
    group (all ids on one instance; one shard's on a cluster, the shards in turn), rotating over larger sets.
    After a timeout every pending id is re-checked; on a cluster with several shards awaited, the batch's ids
    only (each id's turn comes once per round), since its waits are short (:data:`SHARDED_WAIT_SLICE_S`).

    Raises:
        ResultTimeout: ``deadline`` has passed with results still pending.
    """
    if deadline.is_expired:
        raise timeout_error(list(pending), timeout_s)
    groups = layout.slot_groups(list(pending))
    group = groups[turn % len(groups)]
    ids = rotate(group, turn // len(groups) * DONE_KEYS_PER_BLPOP)
    key_to_id = {layout.for_id(request_id).done(request_id): request_id for request_id in ids}
    if len(groups) == 1:
        return WaitBatch(key_to_id, WAIT_SLICE_S, list(pending))
    return WaitBatch(key_to_id, SHARDED_WAIT_SLICE_S, ids)


def queue_result_reads(pipe: Any, layout: QueueLayout, request_ids: Sequence[str]) -> Callable[[list[Any]], list[Any]]:
    """Queue the reads of the results of ``request_ids`` (sync or asyncio pipeline); returns what turns the
    pipeline's replies into one raw result (or None) per id. One MGET per ``MGET_CHUNK`` ids; on a cluster one
    GET per id (redis-py's cluster pipeline refuses MGET), which it sends to each node at once."""
    keys = [layout.for_id(request_id).result(request_id) for request_id in request_ids]
    if layout.is_cluster:
        for key in keys:
            pipe.get(key)
        return lambda replies: replies
    for start in range(0, len(keys), MGET_CHUNK):
        pipe.mget(keys[start:start + MGET_CHUNK])
    return lambda replies: [raw for chunk in replies for raw in chunk]
