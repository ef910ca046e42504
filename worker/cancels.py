"""Cancel marks as the reader sees them: which of some request ids are marked (a request about to be admitted is
answered ``cancelled`` instead), and the one cancellation poll of the requests the engine runs (one ZMSCORE over
their ids per ``cancel_poll_s``). Marks live in the cancel set of each id's shard (protocol/keys.py); producers set
them. Imports redis and protocol's key layout; never the engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis

from tokenmill.protocol.shards import QueueLayout


class CancelMarks:
    """Reads the cancel marks of a queue's shards.

    Args:
        client: Redis client (the reader thread's).
        layout: the served queue's shards.
        poll_s: how often :meth:`poll` looks at the running requests.
    """

    def __init__(self, client: redis.Redis, layout: QueueLayout, poll_s: float) -> None:
        self._client, self._layout, self._poll_s = client, layout, poll_s
        self._next_poll_s = 0.0

    def marked(self, request_ids: list[str], pipe: redis.client.Pipeline | None = None) -> set[str]:
        """The ids of ``request_ids`` with a cancel mark (in the cancel set of each one's shard).

        Args:
            pipe: a pipeline holding the caller's own writes, run here with these reads (one round trip); its
                replies before the reads are not looked at (an error among them raises).
        """
        if not request_ids and pipe is None:
            return set()
        shard_to_ids: dict[int, list[str]] = {}
        if not self._layout.is_sharded:  # NOTE: one shard: no pass per id (this runs over every running request)
            if request_ids:
                shard_to_ids[0] = list(request_ids)
        else:
            for request_id in request_ids:
                shard_to_ids.setdefault(self._layout.shard_of(request_id), []).append(request_id)
        if pipe is None and len(shard_to_ids) == 1:
            [(shard, ids)] = shard_to_ids.items()
            scores = self._client.zmscore(self._layout.shards[shard].cancel, ids)
            return {rid for rid, score in zip(ids, scores) if score is not None}
        pipe = pipe if pipe is not None else self._client.pipeline(transaction=False)
        for shard, ids in shard_to_ids.items():
            pipe.zmscore(self._layout.shards[shard].cancel, ids)
        replies = pipe.execute()
        return {rid for ids, scores in zip(shard_to_ids.values(), replies[len(replies) - len(shard_to_ids):])
                for rid, score in zip(ids, scores) if score is not None}

    def poll(self, live_ids: Iterable[str]) -> set[str]:
        """The running requests (``live_ids``) with a cancel mark, once per ``poll_s`` (empty in between).

        NOTE: a hit comes back each poll until the engine drops the request; a repeated abort is a no-op."""
        now_s = time.monotonic()
        if now_s < self._next_poll_s:
            return set()
        self._next_poll_s = now_s + self._poll_s
        return self.marked(sorted(live_ids))
