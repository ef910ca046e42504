"""Which entry killed its worker: the one request a worker was running alone when it died.

A crash no engine can contain (the OOM killer, a segfault, ``os._exit``) leaves every entry its worker held
pending, and nothing in Redis says which one caused it, except where the worker held one entry only. So a
worker says so itself, before it runs it: whenever the reader leaves the worker holding exactly one entry
(a read of one request into an idle worker: worker/dispatch.py, or a suspect delivered to run alone:
worker/suspects.py), it marks that entry in ``<lane stream>:alone`` (a hash, consumer -> entry id, on the
stream's cluster slot), and it clears the mark before it takes a second entry along. A death while the mark
names an entry still pending for that consumer is that entry's doing, for certain.

Such an entry is dead-lettered by whoever reclaims it (or by the same name's next process, from its backlog),
without running again: a poison that arrives alone kills one worker; one batched with others kills a second
one as the suspects run alone, never five. A worker that stopped cleanly (``stopped`` heartbeat) died of
nothing, and clears its mark as it stops. A worker killed from outside while it held one request (an
operator's ``kill -9``, a host lost) charges that request all the same: it is dead-lettered, not lost, and
``tokenmill dead --requeue`` runs it again.

Imports redis and protocol's key layout; never the engine.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from tokenmill.protocol.heartbeat import STOPPED, Heartbeat
from tokenmill.protocol.keys import Lane
from tokenmill.worker.heartbeat import as_text
from tokenmill.worker.pending import alone_key, pending_entry


def find_culprit(client: redis.Redis, consumer: str, beat: Heartbeat | None,
                 lanes: Iterable[Lane]) -> tuple[str, str] | None:
    """``(stream, entry id)`` of the entry ``consumer`` was running alone when it died, in ``lanes``; or None.

    Args:
        client: Redis client.
        consumer: the dead consumer's name.
        beat: its last heartbeat (None: it never beat).
        lanes: the lanes to look in (those the caller reads and reclaims from).
    """
    if beat is not None and beat.state == STOPPED:
        return None
    streams = [lane.stream for lane in lanes]
    pipe = client.pipeline(transaction=False)
    for stream in streams:
        pipe.hget(alone_key(stream), consumer)
    for stream, marked in zip(streams, pipe.execute(raise_on_error=False)):
        if marked is None or isinstance(marked, redis.RedisError):
            continue
        entry_id = as_text(marked)
        if pending_entry(client, stream, 0, consumer, entry_id) is not None:
            return stream, entry_id
    return None


class AloneMark:
    """This worker's own mark (see the module docstring): set while it holds exactly one entry, cleared before
    it holds more, and as it stops. Only the reader thread uses it.

    Args:
        client: Redis client.
        consumer: this worker's consumer name.
    """

    def __init__(self, client: redis.Redis, consumer: str) -> None:
        self._client = client
        self._consumer = consumer
        self.stream: str | None = None  # the stream of the marked entry; None: nothing marked

    def set(self, stream: str, entry_id: str, pipe: redis.client.Pipeline | None = None) -> None:
        """Mark ``entry_id`` as the one entry this worker holds (before it runs); on ``pipe``, the caller runs it."""
        self._on(pipe).hset(alone_key(stream), self._consumer, entry_id)
        self.was_set(stream, pipe)

    def was_set(self, stream: str, pipe: redis.client.Pipeline | None = None) -> None:
        """The delivery script (worker/pending.py), or :meth:`set`, set the mark in ``stream``."""
        if self.stream is not None and self.stream != stream:
            self.clear(pipe)
        self.stream = stream

    def clear(self, pipe: redis.client.Pipeline | None = None) -> None:
        """Clear the mark: this worker is about to hold more than one entry (or stops); on ``pipe``, the caller
        runs it."""
        if self.stream is not None:
            self._on(pipe).hdel(alone_key(self.stream), self._consumer)
            self.stream = None

    def _on(self, pipe: redis.client.Pipeline | None) -> redis.Redis | redis.client.Pipeline:
        # NOTE: not ``pipe or client``: a pipeline has a length (its queued commands), so its truth is not its being
        # there
        return self._client if pipe is None else pipe
