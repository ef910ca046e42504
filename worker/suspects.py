"""Suspects: entries whose worker died holding them (reclaimed from a dead consumer, or left by an earlier process
under this name), each run alone, one after the other, so a request that kills workers takes no innocent one with
it (docs/design.md, "Reclaim by heartbeats"). The one a worker died running alone is dead-lettered at once instead
(worker/poison.py), and one delivered more than ``max_deliveries`` times too.

Imports redis and protocol (schema, outcomes); never the engine (it only sees the outbox and Load).
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from dataclasses import replace

import redis

from tokenmill.protocol.keys import Lane
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.schema import GenerationResult, peek_request_id
from tokenmill.worker.config import WorkerConfig
from tokenmill.worker.messages import DeadLetter, Entry, Outbound
from tokenmill.worker.pending import OwnPending, Pending
from tokenmill.worker.poison import AloneMark, find_culprit
from tokenmill.worker.state import Load

log = logging.getLogger("tokenmill.worker")


class Suspects:
    """The suspects this worker holds, waiting to run alone.

    NOTE: each is held here (pending for this worker, its count unchanged) until it runs; if it kills this worker
    too, only its own delivery count has risen: those waiting behind it are still pending here with the counts they
    had, for the next reclaimer.

    Args:
        client: Redis client (the reader thread's).
        lanes: every lane this worker may read (of every shard): where its own backlog's culprit is looked for.
        config: worker settings (name, ``max_deliveries``, the cancellation poll period it waits in).
        load: shared counters (what this worker holds).
        outbox: dead letters for the writer.
        own: this worker's pending list, which delivers each suspect again.
        alone: this worker's alone mark, which a suspect's delivery sets.
    """

    def __init__(self, client: redis.Redis, lanes: list[Lane], config: WorkerConfig, load: Load,
                 outbox: queue.Queue[Outbound], own: OwnPending, alone: AloneMark) -> None:
        self._client, self._lanes, self._config, self._load, self._outbox = client, lanes, config, load, outbox
        self._own, self._alone = own, alone
        self._waiting: deque[Pending] = deque()
        # NOTE: the entry an earlier process under this name died running alone, looked up with the first backlog page
        self._own_culprit: tuple[str, str] | None | bool = False  # False: not looked up yet

    def __len__(self) -> int:
        return len(self._waiting)

    def add_backlog(self, page: list[Pending]) -> None:
        """A page of this worker's backlog (:meth:`OwnPending.backlog_page`): suspects, since the earlier process
        ended holding them; the one it died running alone is dead-lettered."""
        if self._own_culprit is False:
            self._own_culprit = find_culprit(self._client, self._config.name, None, self._lanes)
        self.add([replace(item, killed_its_worker=True) if (item.stream, item.entry_id) == self._own_culprit
                  else item for item in page])

    def add(self, items: list[Pending]) -> None:
        """Queue entries a dead worker held, to run alone one by one; the one it died running alone is
        dead-lettered at once instead (worker/poison.py)."""
        self._load.hold(item.key for item in items)
        for item in items:
            if not item.killed_its_worker:
                self._waiting.append(item)
                continue
            entry, num_deliveries = self._own.deliver(item, is_counted=False)
            if entry is None:  # answered, taken by a reclaimer, or deleted meanwhile
                self._load.release([item.key])
            else:
                self._outbox.put(self._dead_letter(entry, num_deliveries, killed_its_worker=True))

    def run_next(self) -> Entry | None:
        """Deliver the oldest suspect to run alone: only once this worker holds nothing but suspects, and the next
        one only after it is answered. Returns the entry to hand on (marked as run alone by its delivery), or None:
        not yet, gone meanwhile, or dead-lettered for being delivered more than ``max_deliveries`` times."""
        if self._load.num_held > len(self._waiting):
            self._load.wait_for_room(self._config.cancel_poll_s)
            return None
        item = self._waiting[0]
        entry, num_deliveries = self._own.deliver(item, is_counted=True)
        self._alone.was_set(item.stream)  # NOTE: the delivery marked it: a death now is its doing
        self._waiting.popleft()
        if entry is None:  # answered, taken by a reclaimer, or deleted meanwhile
            self._load.release([item.key])
            return None
        if num_deliveries > self._config.max_deliveries:
            self._outbox.put(self._dead_letter(entry, num_deliveries))
            return None
        log.info("running a suspect alone", extra={"event": "suspect", "entry_id": entry.entry_id,
                                                    "deliveries": num_deliveries})
        return entry

    def _dead_letter(self, entry: Entry, num_deliveries: int, killed_its_worker: bool = False) -> DeadLetter:
        reason = f"{ErrorCode.MAX_DELIVERIES.value}: delivered {num_deliveries} times"
        if killed_its_worker:
            reason = f"{ErrorCode.MAX_DELIVERIES.value}: its worker died while running it alone " \
                     f"(delivered {num_deliveries} times)"
        request_id = peek_request_id(entry.fields)
        result = None
        if request_id is not None:
            result = GenerationResult.failure(request_id, ErrorCode.MAX_DELIVERIES, reason, worker=self._config.name)
        log.warning("dead-lettered", extra={"event": "dead_lettered", "request_id": request_id, "reason": reason})
        return DeadLetter(entry, reason, result)
