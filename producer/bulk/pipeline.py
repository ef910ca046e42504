"""The bulk job: a windowed, resumable pipeline from an input file through the queue to JSONL.

Request ids are deterministic per (job, item, attempt), the job being the OUTPUT path, so a
re-run finishes only what is missing: results that landed while it was dead are picked up, and
requests an earlier run queued are waited for, never queued again (submit-once markers). Rows an
earlier run cancelled (``--cancel-on-interrupt``) run again under their next attempt's id, using
no retry, unless ``retry_cancelled`` is off.
Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis

from tokenmill.producer import submit_options
from tokenmill.producer.bulk.errors import BulkError
from tokenmill.producer.bulk.items import BulkItem, InvalidItem, Parsed, count_records, detect_format, read_items
from tokenmill.producer.bulk.options import BulkOptions, job_id_of, request_id_of
from tokenmill.producer.bulk.output import (
    DoneSet,
    LineWriter,
    OutputFormat,
    drop_cancelled_lines,
    invalid_line,
    repair_and_scan,
    result_line,
)
from tokenmill.producer.bulk.parquet_output import ParquetOutput, is_parquet_output
from tokenmill.producer.bulk.record import JobRecord
from tokenmill.producer.bulk.report import BulkProgress, BulkSummary
from tokenmill.producer.client import Producer
from tokenmill.producer.eta import Eta, JobMeter, job_eta, live_beats
from tokenmill.producer.openai_compat import ENDPOINTS
from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.heartbeat import READ_WORKERS_LUA, STALE_AFTER_S, split_workers_reply
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.schema import GenerationRequest, GenerationResult, decode_result

# Remote failures worth another attempt; every other non-ok result is final.
RETRYABLE_CODES = frozenset({ErrorCode.INTERNAL.value, ErrorCode.MAX_DELIVERIES.value})
REPLY_BLOCK_MS = 1000  # one XREAD BLOCK on the reply stream
RECHECK_INTERVAL_S = 5.0  # fallback MGET of in-flight result keys, in case a reply was missed
ABANDONED_REPLY_TTL_S = 86_400  # an interrupted job's reply stream lives this long for the re-run
ETA_INTERVAL_S = 5.0  # how often a job tracking its ETA reads the workers' heartbeats (one HGETALL)


class Stopped(Exception):
    """Raised inside a run when :attr:`BulkJob.stopping` is set; handled like Ctrl-C."""


@dataclass
class Flight:
    """One outstanding (or to-be-sent) attempt of an item."""

    item: BulkItem
    attempt: int  # 0 for the first request; each retry (or run again after a cancel) uses a new id
    num_cancelled: int = 0  # earlier attempts an earlier run cancelled: they use none of the retries
    is_rerun: bool = False  # the attempt after a cancelled one (not a retry)


class BulkJob:
    """One run of a bulk job. Use :func:`producer.bulk.run` rather than this class directly.

    Args:
        producer: the queue to feed (its client is used for the reply stream too).
        input_path: JSONL, OpenAI Batch JSONL, CSV or Parquet.
        output_path: results JSONL, or Parquet when named ``.parquet`` / ``.pq`` (see
            :mod:`producer.bulk.parquet_output`); by default also the job's identity for resuming.
        options: see :class:`BulkOptions`.
        show_progress: draw a progress bar on stderr (with the predicted ETA: ``track_eta``).
        job_id: the job's identity when it is not the OUTPUT path (e.g. an OpenAI batch id): runs
            with the same id share their requests and results in Redis.
        track_eta: keep :attr:`eta` current without a progress bar (a batch object shows it).
        kind: what the dashboard calls the job (``bulk``, or ``batch`` for an OpenAI batch's run).

    The job's progress is written to Redis as it runs (producer/bulk/record.py), for the dashboard.
    """

    def __init__(self, producer: Producer, input_path: Path, output_path: Path, options: BulkOptions,
                 *, show_progress: bool = False, job_id: str | None = None, track_eta: bool = False,
                 kind: str = "bulk") -> None:
        self.producer, self.options = producer, options
        self.input_path, self.output_path = input_path, output_path
        self.errors_path = options.errors_path or output_path.with_name(output_path.name + ".errors.jsonl")
        self.input_format = detect_format(input_path, options.format)
        self.output_format: OutputFormat = "openai" if self.input_format == "openai" else "plain"
        self._parquet = self._parquet_output(output_path)
        # Where results are appended: OUTPUT itself, or the journal a Parquet OUTPUT is built from.
        self.results_path = output_path if self._parquet is None else self._parquet.journal
        self.job_id = job_id or job_id_of(output_path)
        self.reply_stream = producer.keys.bulk_replies(self.job_id)
        self.summary = BulkSummary(output_path, self.errors_path)
        self.stopping = threading.Event()  # set from any thread: stop like Ctrl-C (e.g. a cancelled batch)
        self._show_progress = show_progress
        self._progress = BulkProgress(0, enabled=False)
        self._flights: dict[str, Flight] = {}  # request id -> attempt in flight
        self._queued_here: set[str] = set()  # request ids this run enqueued (what --cancel-on-interrupt cancels)
        self._rerun_lines: set[int] = set()  # input lines whose cancelled errors-file line this run dropped
        self._rerun_items: set[str] = set()  # item ids cancelled by an earlier run that this run runs again
        self._to_send: deque[Flight] = deque()
        self._last_reply_id = b"0"  # NOTE: from the start: replies an interrupted run never read
        self._last_recheck_s = time.monotonic()
        self._tracks_eta = show_progress or track_eta
        self._meter = JobMeter()
        self._next_eta_s = 0.0
        # The job's predicted remaining tokens and ETA (producer/eta.py), renewed every ETA_INTERVAL_S while the
        # job tracks it; None before the first look. Replaced whole: other threads may read it.
        self.eta: Eta | None = None
        self._record = JobRecord(producer.client, producer.keys, self.job_id, kind=kind,
                                 input_name=str(input_path), output_name=str(output_path))

    def run(self) -> BulkSummary:
        """Process every record not finished by an earlier run; Ctrl-C leaves valid files.

        Returns:
            The summary; ``is_interrupted`` is set after KeyboardInterrupt.
        """
        start_s = time.monotonic()
        done = DoneSet()
        if self._parquet is None:
            repair_and_scan(self.output_path, done, is_errors=False)
        else:
            self._parquet.scan(done)
        repair_and_scan(self.errors_path, done, is_errors=True)
        if not self.options.retry_cancelled:
            done.lines |= done.cancelled_lines
        elif done.cancelled_lines:  # NOTE: before the errors file is opened for appending
            self._rerun_lines = done.cancelled_lines - done.lines
            drop_cancelled_lines(self.errors_path)
        self.summary.num_earlier_errors = len(done.lines)
        self.summary.num_total = count_records(self.input_path, self.input_format)
        records = self._unfinished(read_items(self.input_path, self.input_format,
                                              prompt_column=self.options.prompt_column,
                                              id_column=self.options.id_column), done)
        self._out, self._err = LineWriter(self.results_path), LineWriter(self.errors_path)
        self._record.start(self.summary.num_total, self.summary.num_skipped)
        try:
            with BulkProgress(self.summary.num_total, enabled=self._show_progress) as self._progress:
                self._drive(records)
            self.producer.client.delete(self.reply_stream)
            self._record_counts()
            self._record.finish("done")
        except (KeyboardInterrupt, Stopped):
            self._interrupt()
            with contextlib.suppress(redis.RedisError):
                self._record_counts()
                self._record.finish("interrupted")
        finally:
            self._out.close()
            self._err.close()
            self.summary.wall_s = time.monotonic() - start_s
        if self._parquet is not None:  # NOTE: also after an interrupt: OUTPUT then holds what is finished
            self._parquet.merge()
        return self.summary

    def _parquet_output(self, output_path: Path) -> ParquetOutput | None:
        """The Parquet OUTPUT of a path named ``.parquet``, else None (JSONL).

        Raises:
            BulkError: OpenAI Batch input (its output lines are JSONL), or pyarrow is missing.
        """
        if not is_parquet_output(output_path):
            return None
        if self.output_format == "openai":
            raise BulkError(f"{output_path}: OpenAI Batch input is answered with OpenAI Batch output lines, "
                            "which are JSONL: name the output .jsonl")
        return ParquetOutput(output_path)

    def _interrupt(self) -> None:
        """Leave the job resumable; with ``cancel_on_interrupt``, cancel what this run queued."""
        self.summary.is_interrupted = True
        if self.options.cancel_on_interrupt:
            request_ids = [request_id for request_id in self._flights if request_id in self._queued_here]
            self.producer.cancel_many(request_ids)
            self.summary.num_cancelled = len(request_ids)
        self.producer.client.expire(self.reply_stream, ABANDONED_REPLY_TTL_S)

    def _drive(self, records: Iterator[Parsed]) -> None:
        has_input = True
        while True:
            if self.stopping.is_set():
                raise Stopped
            if has_input:
                has_input = self._fill(records)
            else:
                self._send()
            if not self._flights and not self._to_send and not has_input:
                self._predict(Eta(0.0, 0.0, 0.0))  # NOTE: done, whatever a last heartbeat still says
                return
            if self._flights:
                self._wait()
            if time.monotonic() >= self._next_eta_s:  # NOTE: always: the job's record shows it (dashboard)
                self._renew_eta()
            self._record_counts()
            self._record.flush()

    def _record_counts(self) -> None:
        summary = self.summary
        self._record.counts(ok=summary.num_ok, failed=summary.num_failed + summary.num_invalid,
                            skipped=summary.num_skipped, tokens=summary.completion_tokens + summary.recovered_tokens)

    def _renew_eta(self) -> None:
        """Predict what the job still generates from the live workers' heartbeats and its own results."""
        self._next_eta_s = time.monotonic() + ETA_INTERVAL_S
        # NOTE: judged by the Redis server's clock, read with the hash (protocol/heartbeat.py)
        reply = self.producer.client.eval(READ_WORKERS_LUA, 1, self.producer.keys.workers)
        workers, now_s = split_workers_reply(reply)
        summary = self.summary
        self._predict(job_eta(live_beats(workers, now_s, STALE_AFTER_S), self.reply_stream,
                              summary.num_total - summary.num_skipped - summary.num_done,
                              finished_mean_length=self._meter.mean_length,
                              job_tokens_per_s=self._meter.tokens_per_s()))

    def _predict(self, eta: Eta) -> None:
        """Show ``eta`` (and keep it in :attr:`eta`) when the job tracks its ETA; the job's record has it always."""
        self._record_counts()
        self._record.predict(eta)
        if self._tracks_eta:
            self.eta = eta
            self._progress.predict(eta)

    def _unfinished(self, records: Iterator[Parsed], done: DoneSet) -> Iterator[Parsed]:
        """Records not yet in the output/errors files; duplicate ids become invalid records."""
        seen: set[str] = set()
        for record in records:
            if record.line in done.lines:
                self._skip()
                if record.line in done.cancelled_lines and not self.options.retry_cancelled:
                    self.summary.num_kept_cancelled += 1  # NOTE: only then are cancelled lines among done.lines
                if record.item_id is not None:
                    seen.add(record.item_id)
            elif isinstance(record, BulkItem) and record.item_id in seen:
                yield InvalidItem(record.line, f"duplicate id {record.item_id!r}", record.item_id)
            elif isinstance(record, BulkItem) and record.item_id in done.item_ids:
                seen.add(record.item_id)
                self._skip()
                self.summary.num_earlier_ok += 1
            else:
                if record.item_id is not None:
                    seen.add(record.item_id)
                if isinstance(record, BulkItem) and record.line in self._rerun_lines:
                    self._count_rerun(record.item_id)
                yield record

    def _skip(self) -> None:
        self.summary.num_skipped += 1
        self._progress.skip()

    def _fill(self, records: Iterator[Parsed]) -> bool:
        """Top the window up: retries first, then new records. Returns whether input remains."""
        has_input = True
        fresh: list[BulkItem] = []
        while len(self._flights) + len(self._to_send) + len(fresh) < self.options.max_in_flight:
            record = next(records, None)
            if record is None:
                has_input = False
                break
            if isinstance(record, InvalidItem):
                self._write_invalid(record)
            elif (reason := self._check(record)) is not None:
                self._write_invalid(InvalidItem(record.line, reason, record.item_id))
            else:
                fresh.append(record)
        self._recover(fresh)
        self._send()
        return has_input

    def _check(self, item: BulkItem) -> str | None:
        """Validate an item's request locally; the reason when it is bad (never retried)."""
        endpoint = self.options.endpoint
        if endpoint is not None and self.input_format == "openai" and ENDPOINTS.get(endpoint) != item.endpoint:
            return f"url must be the batch's endpoint {endpoint}"
        try:
            self._build(Flight(item, 0))
        except SchemaError as exc:
            return exc.message
        return None

    def _build(self, flight: Flight) -> GenerationRequest:
        options: dict[str, Any] = {"priority": self.options.priority, **self.options.sampling_defaults,
                                   **flight.item.options,
                                   "request_id": request_id_of(self.job_id, flight.item.item_id, flight.attempt),
                                   "reply_to": self.reply_stream}
        # NOTE: an OpenAI body is taken as the HTTP API takes it: a completions prompt is raw text.
        if self.input_format == "openai" or self.options.raw:
            options["raw"] = True
        elif "prompt" in options:  # the job's system message goes before plain prompts only (not messages)
            options["system"] = self.options.system
        # NOTE: on a sharded queue the id moves to the shard of the row's prompt prefix (rows of one template
        # meet the same prefix caches), deterministically: a resumed run builds the same ids (_recover)
        return self.producer.layout.placed_from(submit_options.build_request(self.producer.keys, options))

    def _request_id(self, item: BulkItem, attempt: int) -> str:
        """The id attempt ``attempt`` of ``item`` is (was) queued under (built only where the prompt moves it)."""
        base_id = request_id_of(self.job_id, item.item_id, attempt)
        if not self.producer.layout.places_by_prefix:
            return base_id
        try:
            return self._build(Flight(item, attempt)).id
        except SchemaError:  # never queued: its base id finds nothing, as it should
            return base_id

    def _recover(self, items: list[BulkItem]) -> None:
        """Pick up results an earlier run left in Redis (every attempt id); queue the rest (requests an
        earlier run queued are then waited for, not sent again: see :meth:`_send`)."""
        if not items:
            return
        window = self.options.retries + 1
        found: list[list[tuple[int, GenerationResult]]] = [[] for _ in items]
        positions, first = list(range(len(items))), 0
        while positions:  # NOTE: attempts past retries + 1 exist only after cancelled ones (they use no retry)
            raws = self.producer.raw_results([self._request_id(items[position], first + offset)
                                              for position in positions for offset in range(window)])
            further: list[int] = []
            for index, position in enumerate(positions):
                chunk = raws[index * window:(index + 1) * window]
                found[position] += [(first + offset, decode_result(raw)) for offset, raw in enumerate(chunk)
                                    if raw is not None]
                if chunk[-1] is not None and any(result.status == "cancelled" for _, result in found[position]):
                    further.append(position)
            positions, first = further, first + window
        for item, results in zip(items, found):
            if not results:
                self._to_send.append(Flight(item, 0))
                continue
            attempt, result = results[-1]
            num_cancelled = sum(earlier.status == "cancelled" for _, earlier in results[:-1])
            self._settle(Flight(item, attempt, num_cancelled), result, is_recovered=True)

    def _send(self) -> None:
        """Submit the queued attempts once each: ids an earlier run queued are adopted, not re-sent."""
        if not self._to_send:
            return
        batch = list(self._to_send)
        self._to_send.clear()
        built = [(flight, self._build(flight)) for flight in batch]
        sent = [(flight, request) for flight, request in built if not self._refuse_unserved(flight, request)]
        before_s = time.time()
        first_submits = self.producer.submit_once([request for _, request in sent])
        for (flight, request), first_submit_s in zip(sent, first_submits):
            self._flights[request.id] = flight
            if first_submit_s >= before_s:
                self._queued_here.add(request.id)
                self.summary.num_submitted += 1
                self.summary.num_retried += flight.attempt > 0 and not flight.is_rerun
            else:
                self.summary.num_adopted += 1
                self._progress.adopt()

    def _refuse_unserved(self, flight: Flight, request: GenerationRequest) -> bool:
        """Answer, unsent, a request naming a model outside ``served_models`` (as a worker serving another
        model would: ``model_not_served``); whether it was refused."""
        served = self.options.served_models
        if served is None or request.model is None or request.model in served:
            return False
        names = ", ".join(map(repr, sorted(served))) or "none"
        message = f"no live worker serves model {request.model!r} (served: {names})"
        self._settle(flight, GenerationResult.failure(request.id, ErrorCode.MODEL_NOT_SERVED, message))
        return True

    def _wait(self) -> None:
        """One XREAD BLOCK on the job's reply stream; a fallback MGET when it stays quiet."""
        reply = cast("list[Any] | None", self.producer.client.xread(
            {self.reply_stream: self._last_reply_id}, count=1024, block=REPLY_BLOCK_MS))
        entries: list[tuple[bytes, Mapping[bytes, bytes]]] = reply[0][1] if reply else []
        for entry_id, fields in entries:
            self._last_reply_id = entry_id
            if b"d" in fields:
                self._land(decode_result(fields[b"d"]))
        if entries:
            self.producer.client.xtrim(self.reply_stream, minid=self._last_reply_id.decode())
        if not entries or time.monotonic() - self._last_recheck_s > RECHECK_INTERVAL_S:
            self._recheck()

    def _recheck(self) -> None:
        self._last_recheck_s = time.monotonic()
        request_ids = list(self._flights)
        for raw in self.producer.raw_results(request_ids):
            if raw is not None:
                self._land(decode_result(raw))

    def _land(self, result: GenerationResult) -> None:
        flight = self._flights.pop(result.id, None)
        if flight is not None:  # NOTE: unknown ids are replies of an earlier run, already settled
            self._settle(flight, result)

    def _settle(self, flight: Flight, result: GenerationResult, *, is_recovered: bool = False) -> None:
        """Write a final result, or queue the next attempt of a retryable failure.

        NOTE: a ``cancelled`` result of a request an earlier run queued (its ``--cancel-on-interrupt``; found in
        Redis, or landing while this run waits for it) runs again, using no retry: that run gave the row up,
        this one wants it done. Unless ``retry_cancelled`` is off: then it is final, as a cancel in this run is.
        """
        is_earlier_cancel = result.status == "cancelled" and result.id not in self._queued_here
        if is_earlier_cancel and self.options.retry_cancelled:
            self._count_rerun(flight.item.item_id)
            self._to_send.append(Flight(flight.item, flight.attempt + 1, flight.num_cancelled + 1, is_rerun=True))
            return
        is_retryable = result.status == "error" and result.error is not None and result.error.code in RETRYABLE_CODES
        if is_retryable and flight.attempt - flight.num_cancelled < self.options.retries:
            self._to_send.append(Flight(flight.item, flight.attempt + 1, flight.num_cancelled))
            return
        self.summary.num_kept_cancelled += is_earlier_cancel
        line = result_line(self.output_format, flight.item, result)
        if result.ok:
            self._out.write(line)
        else:
            line["attempts"] = flight.attempt + 1
            self._err.write(line)
            error = result.error
            self._record.failure(line=flight.item.line, item_id=flight.item.item_id, request_id=result.id,
                                 status=result.status, code=error.code if error else result.status,
                                 message=error.message if error else "")
        self.summary.status_counts[result.status] += 1
        self.summary.prompt_tokens += result.usage.prompt_tokens
        if is_recovered:
            self.summary.num_recovered += 1
            self.summary.recovered_tokens += result.usage.completion_tokens
            self._progress.recover()
        else:
            self.summary.completion_tokens += result.usage.completion_tokens
            self._meter.add(result.usage.completion_tokens)
            self._progress.advance(1, result.usage.completion_tokens)

    def _count_rerun(self, item_id: str) -> None:
        """A row an earlier run cancelled runs again (counted once however often it was cancelled)."""
        if item_id not in self._rerun_items:
            self._rerun_items.add(item_id)
            self.summary.num_rerun_cancelled += 1

    def _write_invalid(self, record: InvalidItem) -> None:
        self._err.write(invalid_line(self.output_format, record))
        self.summary.num_invalid += 1
        self._record.failure(line=record.line, item_id=record.item_id, request_id=None, status="invalid",
                             code="invalid", message=record.reason)
        self._progress.advance(1)
