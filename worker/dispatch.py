"""Handing on what the reader took: each entry triaged (worker/intake.py) into a request to run (to the engine
thread, in one hand-off per read), an answer now (a refusal, a request cancelled before it ran) or a dead letter
(to the writer). On the way the entry is held (worker/state.py), an entry on a shard its id does not live on is
moved to its own, and the alone mark (worker/poison.py) follows what the worker holds.

Imports redis and protocol (keys, shards, schema, outcomes); never the engine.
"""

from __future__ import annotations

import logging
import queue
import time

import redis

from tokenmill.protocol.connection import REDIS_ERRORS
from tokenmill.protocol.keys import CONSUMER_GROUP, Lane
from tokenmill.protocol.outcomes import AbortReason, ErrorCode
from tokenmill.protocol.schema import peek_request_id
from tokenmill.protocol.shards import QueueLayout
from tokenmill.worker.cancels import CancelMarks
from tokenmill.worker.config import WorkerConfig
from tokenmill.worker.intake import IntakePolicy, answer, triage
from tokenmill.worker.messages import Admit, AdmitBatch, DeadLetter, Entry, Finish, Incoming, Outbound
from tokenmill.worker.pending import OwnPending
from tokenmill.worker.poison import AloneMark
from tokenmill.worker.state import Load

log = logging.getLogger("tokenmill.worker")


class Dispatcher:
    """Triages the entries the reader took and passes them on.

    Args:
        client: Redis client (the reader thread's).
        layout: the served queue's shards.
        lane_of: every lane this worker may read, by stream.
        model_names: the names a request's ``model`` may give (a request naming another is refused).
        config: worker settings (name, largest request).
        load: shared counters (what this worker holds, the queued count).
        inbox: admits for the engine thread.
        outbox: immediate answers and dead letters for the writer.
        cancels: the cancel marks, read as requests are admitted.
        own: this worker's pending list, told to look for lost deliveries when Redis fails mid-dispatch.
        alone: this worker's alone mark.
    """

    def __init__(self, client: redis.Redis, layout: QueueLayout, lane_of: dict[str, Lane],
                 model_names: frozenset[str], config: WorkerConfig, load: Load, inbox: queue.Queue[Incoming],
                 outbox: queue.Queue[Outbound], cancels: CancelMarks, own: OwnPending, alone: AloneMark) -> None:
        self._client, self._layout, self._lane_of, self._name = client, layout, lane_of, config.name
        self._load, self._inbox, self._outbox = load, inbox, outbox
        self._cancels, self._own, self._alone = cancels, own, alone
        # NOTE: one policy per shard: a lane parses as its shard's; reply streams are queue-wide in every one
        self._intake = [IntakePolicy(keys, model_names, config.name, config.max_request_bytes)
                        for keys in layout.shards]

    def dispatch(self, entries: list[Entry], is_marked: bool = False) -> None:
        """Triage ``entries`` and pass them on (to the engine, or answered at once).

        Args:
            is_marked: a suspect whose delivery marked it as run alone already; otherwise an entry that leaves
                this worker holding it alone is marked here, and a mark is cleared before a second entry joins it.
        """
        entries = self._moved_misplaced(entries)
        self._load.hold((e.stream, e.entry_id) for e in entries)
        now_s = time.time()
        decided = [self._triage(e, now_s) for e in entries]
        admits = [d for d in decided if isinstance(d, Admit)]
        try:
            # NOTE: the alone mark's write and the cancel marks' read in one round trip (a request's first wait)
            pipe = None
            if not is_marked and entries:
                pipe = self._client.pipeline(transaction=False)
                if len(entries) == 1 and self._load.num_held == 1:
                    self._alone.set(entries[0].stream, entries[0].entry_id, pipe)
                else:
                    self._alone.clear(pipe)
            cancelled = self._cancels.marked([a.request.id for a in admits], pipe)
        except REDIS_ERRORS:
            # NOTE: held entries are skipped by the pending check: let go of them, so the check after
            # the reconnect takes them back (they are still pending under this name).
            self._load.release([(e.stream, e.entry_id) for e in entries])
            self._own.ask_for_check()
            raise
        running = []
        for item in decided:
            if isinstance(item, Admit) and item.request.id in cancelled:
                self._outbox.put(answer(item.request, item.entry, AbortReason.CANCELLED, "cancelled before it ran",
                                        self._name, status=AbortReason.CANCELLED))
            elif isinstance(item, Admit):
                running.append(item)
            else:
                _log_refusal(item)
                self._outbox.put(item)
        if running:  # NOTE: one hand-off for the read: each put may wake the engine thread
            self._load.add_queued(len(running))
            self._inbox.put(AdmitBatch(running))

    def _moved_misplaced(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` without those on a shard their id does not live on (written to a lane by hand, or by a
        producer with another ``shards``): each is added to its own shard's lane and then acked and deleted here,
        so its answer lands where its id is looked for. A crash in between leaves a copy: the finish's SET NX
        answers the id once."""
        if not self._layout.is_sharded:
            return entries
        kept = []
        for entry in entries:
            request_id = peek_request_id(entry.fields)
            lane = self._lane_of.get(entry.stream)
            if request_id is None or lane is None or self._layout.shard_of(request_id) == lane.shard:
                kept.append(entry)
                continue
            target = self._layout.for_id(request_id).lane(lane.priority, lane.model, lane.is_decode)
            self._client.xadd(target, entry.fields)  # type: ignore[arg-type]
            pipe = self._client.pipeline(transaction=False)
            pipe.xack(entry.stream, CONSUMER_GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
            pipe.execute()
            log.info("moved to its shard", extra={"event": "misplaced", "request_id": request_id, "stream": target})
        return kept

    def _triage(self, entry: Entry, now_s: float) -> Admit | Finish | DeadLetter:
        """:func:`triage`, turning any failure into a dead letter that says why (never a lost entry)."""
        try:
            shard = self._layout.shard_of_stream(entry.stream)
            return triage(entry, now_s, self._intake[shard or 0])
        except Exception as exc:  # one entry's problem must not stop the reader
            log.exception("triage failed", extra={"event": "triage_failed", "entry_id": entry.entry_id})
            return DeadLetter(entry, reason=f"{ErrorCode.INTERNAL.value}: triage failed: {type(exc).__name__}: {exc}")


def _log_refusal(item: Finish | DeadLetter) -> None:
    if isinstance(item, DeadLetter):
        log.warning("dead-lettered", extra={"event": "dead_lettered", "entry_id": item.entry.entry_id,
                                            "reason": item.reason})
    else:
        error = item.result.error
        log.info("refused", extra={"event": "error", "request_id": item.result.id,
                                   "code": error.code if error else item.result.status})
