"""The engine thread: admits requests, steps the engine, turns outputs into results.

Owns the engine object and the table of live requests. Never touches Redis (the reader and
writer threads do all I/O through queues), so Redis latency never stalls a step. What one iteration
sends the writer goes in one put: each put wakes the writer, which then takes the GIL from this thread.
"""

from __future__ import annotations

import heapq
import logging
import queue
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from tokenmill.engine.engine import Engine
from tokenmill.engine.output.prompts import PromptError
from tokenmill.engine.output.request_output import RequestOutput
from tokenmill.protocol.outcomes import AbortReason, ErrorCode, FinishReason
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.protocol.schema import GenerationResult
from tokenmill.worker.convert import build_result
from tokenmill.worker.messages import (
    Abort,
    Admit,
    AdmitBatch,
    Entry,
    Finish,
    Handoff,
    Incoming,
    Outbound,
    Outgoing,
    Prepared,
    TokenDelta,
)
from tokenmill.worker.metrics import WorkerMetrics
from tokenmill.worker.preparation import Preparation
from tokenmill.worker.state import Load

log = logging.getLogger("tokenmill.worker")

# NOTE: the engine's whole stats (metrics, heartbeat fields) are taken this often while it runs: they cost about a
# millisecond with a few hundred requests live, and the heartbeat (every 2 s) and a scrape read them.
STATS_EVERY_S = 0.25
# NOTE: what a prefill worker runs: the prompt and one greedy token, so every full prompt block is computed and
# published; the decode worker computes the last prompt token again and samples with the request's own parameters.
PREFILL_PARAMS = SamplingParams(max_tokens=1)


@dataclass
class _Live:
    admit: Admit
    extra_entries: list[Entry] = field(default_factory=list)  # duplicates of the same id, acked together
    is_started: bool = False  # produced tokens; deadlines no longer apply
    abort_status: AbortReason | None = None  # why the worker aborted it (a hand-over: no result)
    is_prefill: bool = False  # a prefill worker's: computes the prompt's KV, then hands the request to decode


class EngineLoop:
    """Drives one engine from the inbox (admits, aborts) to the outbox (token deltas, finishes).

    Args:
        engine: the engine; only this loop's thread touches it.
        inbox: admits from the reader, aborts from the writer.
        outbox: token deltas and finished results for the writer.
        load: shared counters this loop publishes after every step.
        worker_name: recorded in every result.
        metrics: receives the engine's stats after every step; None = no metrics.
        role: ``[worker] role``: ``prefill`` runs each request's prompt only and hands it to the decode pool.
    """

    def __init__(self, engine: Engine, inbox: queue.Queue[Incoming], outbox: queue.Queue[Outbound],
                 load: Load, worker_name: str, metrics: WorkerMetrics | None = None, role: str = "both") -> None:
        self._metrics = metrics
        self._engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._load = load
        self._worker_name = worker_name
        self._live: dict[str, _Live] = {}
        # NOTE: kept beside _live, so that a step costs nothing per live request: the ids the reader polls for
        # cancellation (live, not aborted; published as a frozenset when changed), and the deadlines of requests
        # that may still expire, soonest first (a heap: an iteration looks at the due ones only; entries of requests
        # that started, finished or were aborted are dropped when due, or all at once when they outnumber the live).
        self._live_ids: set[str] = set()
        self._published_ids: frozenset[str] = frozenset()
        self._deadlines: list[tuple[float, str]] = []
        self._sending: list[Outgoing] = []  # for the writer, put in the outbox at the end of the iteration
        self._role = role
        # Prefilled requests waiting for their blocks' publish to finish before they are handed off.
        self._handoffs: list[tuple[Future[None], _Live]] = []
        self.is_admitting = True  # False while draining: admits stay pending in Redis
        self._next_stats_s = 0.0  # when the engine's whole stats are taken next
        self._preparation = Preparation(engine, inbox)

    @property
    def num_live(self) -> int:
        """Requests this loop still owes an answer or a hand-off."""
        return len(self._live) + len(self._handoffs)

    def run_once(self, idle_wait_s: float) -> None:
        """One iteration: take commands, expire overdue waiting requests, step if there is work.

        Args:
            idle_wait_s: how long to wait for a command when the engine has nothing to do.
        """
        try:
            self._take_commands(wait_s=0.0 if self._engine.has_unfinished() else idle_wait_s)
            if self._deadlines:
                self._expire_waiting(time.time())
            if self._engine.has_unfinished():
                for output in self._engine.step():
                    self._handle_output(output)
            if self._handoffs:
                self._hand_off_published()
        finally:
            if self._sending:
                self._outbox.put(self._sending)
                self._sending = []
        # NOTE: the whole stats (counters copied, every live request's predicted length) cost more than a short
        # step: taken every STATS_EVERY_S and whenever the engine goes idle, for metrics and the heartbeat; the
        # queues the reader's backpressure needs are published after every step.
        stats = None
        now_s = time.monotonic()
        scheduler = self._engine.scheduler
        is_idle = not self._engine.has_unfinished()
        if now_s >= self._next_stats_s or is_idle:
            if is_idle:
                # NOTE: the writer, woken for the results just put, runs first (until its round trip lets go of
                # the GIL): otherwise it waits for this thread's stats, on the path of every result at light load
                time.sleep(0)
            self._next_stats_s = now_s + STATS_EVERY_S
            stats = self._engine.stats()
            if self._metrics is not None:
                self._metrics.observe_engine(stats)
        if self._published_ids != self._live_ids:
            self._published_ids = frozenset(self._live_ids)
        self._load.publish(scheduler.num_waiting, scheduler.num_running, self._published_ids, stats)

    def hand_back_waiting(self) -> None:
        """Stop admitting and abort every request that has not started, leaving its entry pending."""
        self.is_admitting = False
        for request_id, live in self._live.items():
            if not live.is_started and live.abort_status is None:
                self._stop(request_id, live, AbortReason.HANDOVER)

    def close(self) -> None:
        """Stop preparing (requests still being tokenized stay pending in Redis)."""
        self._preparation.close()

    def _take_commands(self, wait_s: float) -> None:
        while True:
            try:
                command = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            if isinstance(command, Abort):
                self._abort(command)
            elif isinstance(command, AdmitBatch):
                # NOTE: an idle engine thread prepares light requests itself (a request's wait at light load)
                self._take_prepared(self._preparation.submit(command.admits,
                                                             inline=not self._engine.has_unfinished()))
            else:
                self._take_prepared(command.prepared)

    def _take_prepared(self, prepared: list[Prepared]) -> None:
        self._load.add_queued(-len(prepared))
        if self.is_admitting:  # NOTE: while draining, a dropped admit stays pending in Redis
            for one in prepared:
                self._admit(one)

    def _abort(self, command: Abort) -> None:
        live = self._live.get(command.request_id)
        if live is not None and live.abort_status is None:
            self._stop(command.request_id, live, command.status)

    def _stop(self, request_id: str, live: _Live, status: AbortReason) -> None:
        """Abort a live request in the engine; its result gets ``status`` (none for a hand-over)."""
        live.abort_status = status
        self._live_ids.discard(request_id)
        self._engine.abort(request_id)

    def _admit(self, prepared: Prepared) -> None:
        admit = prepared.admit
        request = admit.request
        if request.id in self._live:
            self._live[request.id].extra_entries.append(admit.entry)
            return
        if prepared.prompt_token_ids is None:
            self._finish_early(admit, _error_code(prepared.error), str(prepared.error))
            return
        is_prefill = self._role == "prefill" and not admit.is_handed_off
        try:
            # NOTE: a reply stream is a job's (each bulk job and batch has its own): its finished requests predict
            # the next ones' lengths best, and the heartbeat reports its predicted backlog under that name.
            self._engine.add_request(request.id, prepared.prompt_token_ids,
                                     PREFILL_PARAMS if is_prefill else request.params, priority=admit.entry.lane,
                                     length_group=request.reply_to, is_handed_off=admit.is_handed_off,
                                     streams=request.stream_tokens)
        except Exception as exc:  # one request's failure must not stop the engine thread
            log.exception("admission failed", extra={"event": "error", "request_id": request.id})
            self._finish_early(admit, ErrorCode.INTERNAL, f"admission failed: {type(exc).__name__}: {exc}")
            return
        self._live[request.id] = _Live(admit, is_prefill=is_prefill)
        self._live_ids.add(request.id)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.id))
            if len(self._deadlines) > 2 * len(self._live) + 64:
                self._deadlines = [(deadline, request_id) for deadline, request_id in self._deadlines
                                   if self._may_expire(request_id)]
                heapq.heapify(self._deadlines)
        if log.isEnabledFor(logging.DEBUG):  # NOTE: at info, this and the writer's line were a quarter of its CPU
            log.debug("claimed", extra={"event": "claimed", "request_id": request.id, "lane": admit.entry.lane,
                                        "prefill_only": is_prefill, "handed_off": admit.is_handed_off})

    def _finish_early(self, admit: Admit, code: ErrorCode | str, message: str) -> None:
        result = GenerationResult.failure(admit.request.id, code, message, worker=self._worker_name,
                                          metadata=admit.request.metadata)
        self._sending.append(Finish(result, admit.entry, admit.request.reply_to, admit.request.stream_tokens))

    def _expire_waiting(self, now_s: float) -> None:
        """Abort (``expired``) the requests whose deadline passed before they started."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_s:
            _, request_id = heapq.heappop(deadlines)
            if self._may_expire(request_id):
                self._stop(request_id, self._live[request_id], AbortReason.EXPIRED)

    def _may_expire(self, request_id: str) -> bool:
        """Whether the request is live and has neither started nor been aborted."""
        live = self._live.get(request_id)
        return live is not None and not live.is_started and live.abort_status is None

    def _handle_output(self, output: RequestOutput) -> None:
        live = self._live.get(output.request_id)
        if live is None:
            return
        live.is_started = live.is_started or bool(output.token_ids)
        request = live.admit.request
        is_handed_over = live.abort_status is AbortReason.HANDOVER
        if request.stream_tokens and output.text_delta and not is_handed_over and not live.is_prefill:
            self._sending.append(TokenDelta(request.id, output.text_delta))
        if not output.finished:
            return
        del self._live[output.request_id]
        self._live_ids.discard(output.request_id)
        if live.abort_status is AbortReason.HANDOVER:
            return
        if live.is_prefill and live.abort_status is None and output.finish_reason in (FinishReason.LENGTH,
                                                                                      FinishReason.STOP):
            assert self._engine.fleet is not None  # NOTE: a prefill role needs the fleet cache (worker/config.py)
            self._handoffs.append((self._engine.fleet.barrier(), live))
            return
        try:
            result = build_result(output, live.admit, self._worker_name, live.abort_status)
        except Exception as exc:  # answer this request with why, keep serving the others
            log.exception("result failed", extra={"event": "error", "request_id": output.request_id})
            result = GenerationResult.failure(request.id, ErrorCode.INTERNAL,
                                              f"the result could not be built: {type(exc).__name__}: {exc}",
                                              worker=self._worker_name)
        self._load.count_finished(len(output.token_ids))
        for entry in [live.admit.entry, *live.extra_entries]:
            self._sending.append(Finish(result, entry, request.reply_to, request.stream_tokens))


    def _hand_off_published(self) -> None:
        """Hand the prefilled requests whose blocks are published to the decode pool (the writer moves each entry)."""
        waiting = []
        for published, live in self._handoffs:
            if not published.done():
                waiting.append((published, live))
                continue
            for entry in [live.admit.entry, *live.extra_entries]:
                self._sending.append(Handoff(entry, live.admit.request.id))
        self._handoffs = waiting


def _error_code(exc: Exception | None) -> ErrorCode:
    """The wire error code of a preparation failure: the prompt's own code, else ``internal``."""
    return exc.code if isinstance(exc, PromptError) else ErrorCode.INTERNAL
