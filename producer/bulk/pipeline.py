"""The bulk job: a windowed, resumable pipeline from an input file through the queue to JSONL.

Request ids are deterministic per (job, item, attempt), the job being the OUTPUT path, so a
re-run finishes only what is missing and picks up results that landed while it was dead.
Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field

from producer import common
from producer.bulk.items import BulkItem, InvalidItem, Parsed, count_records, detect_format, read_items
from producer.bulk.output import DoneSet, LineWriter, OutputFormat, invalid_line, repair_and_scan, result_line
from producer.bulk.report import BulkProgress, BulkSummary
from producer.client import Producer
from producer.errors import SchemaError
from producer.schema import ErrorCode, GenerationResult, decode_result

# Remote failures worth another attempt; every other non-ok result is final.
RETRYABLE_CODES = frozenset({ErrorCode.INTERNAL.value, ErrorCode.MAX_DELIVERIES.value})
REPLY_BLOCK_MS = 1000  # one XREAD BLOCK on the reply stream
RECHECK_INTERVAL_S = 5.0  # fallback MGET of in-flight result keys, in case a reply was missed
ABANDONED_REPLY_TTL_S = 86_400  # an interrupted job's reply stream lives this long for the re-run


class BulkOptions(BaseModel):
    """Options of one bulk run; per-item params override the sampling defaults here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = Field("auto", description="auto, jsonl, openai, csv or parquet")
    prompt_column: str = Field("prompt", min_length=1, description="CSV/Parquet column holding the prompt")
    id_column: str = Field("id", min_length=1, description="CSV/Parquet column holding the item id (optional)")
    priority: str | int = Field("low", description="high, normal, low or a lane number")
    max_in_flight: int = Field(256, ge=1, le=100_000, description="most requests outstanding at once")
    retries: int = Field(2, ge=0, le=20, description="extra attempts for retryable failures (e.g. internal)")
    errors_path: Path | None = Field(None, description="failures file; default OUTPUT + '.errors.jsonl'")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None


@dataclass
class Flight:
    """One outstanding (or to-be-sent) attempt of an item."""

    item: BulkItem
    attempt: int  # 0 for the first request; each retry uses a new id


def job_id_of(output_path: Path) -> str:
    """The job's identity: a hash of the absolute OUTPUT path (same OUTPUT = same job)."""
    return hashlib.sha256(str(output_path.resolve()).encode()).hexdigest()[:16]


def request_id_of(job_id: str, item_id: str, attempt: int) -> str:
    """Deterministic request id of one attempt of one item (no whitespace, <= 64 chars)."""
    item_hash = hashlib.sha256(item_id.encode()).hexdigest()[:24]
    return f"bulk-{job_id}-{item_hash}-{attempt}"


class BulkJob:
    """One run of a bulk job. Use :func:`producer.bulk.run` rather than this class directly.

    Args:
        producer: the queue to feed (its client is used for the reply stream too).
        input_path: JSONL, OpenAI Batch JSONL, CSV or Parquet.
        output_path: results JSONL; also the job's identity for resuming.
        options: see :class:`BulkOptions`.
        show_progress: draw a progress bar on stderr.
    """

    def __init__(self, producer: Producer, input_path: Path, output_path: Path, options: BulkOptions,
                 *, show_progress: bool = False) -> None:
        self.producer, self.options = producer, options
        self.input_path, self.output_path = input_path, output_path
        self.errors_path = options.errors_path or output_path.with_name(output_path.name + ".errors.jsonl")
        self.input_format = detect_format(input_path, options.format)
        self.output_format: OutputFormat = "openai" if self.input_format == "openai" else "plain"
        self.job_id = job_id_of(output_path)
        self.reply_stream = producer.keys.bulk_replies(self.job_id)
        self.summary = BulkSummary(output_path, self.errors_path)
        self._show_progress = show_progress
        self._flights: dict[str, Flight] = {}  # request id -> attempt in flight
        self._to_send: deque[Flight] = deque()
        self._last_reply_id = b"0"  # NOTE: from the start: replies an interrupted run never read
        self._last_recheck_s = time.monotonic()
        self._defaults = {k: v for k, v in options.model_dump(include={
            "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}).items() if v is not None}

    def run(self) -> BulkSummary:
        """Process every record not finished by an earlier run; Ctrl-C leaves valid files.

        Returns:
            The summary; ``is_interrupted`` is set after KeyboardInterrupt.
        """
        start_s = time.monotonic()
        done = DoneSet()
        repair_and_scan(self.output_path, done, is_errors=False)
        repair_and_scan(self.errors_path, done, is_errors=True)
        self.summary.num_earlier_errors = len(done.lines)
        self.summary.num_total = count_records(self.input_path, self.input_format)
        records = self._unfinished(read_items(self.input_path, self.input_format,
                                              prompt_column=self.options.prompt_column,
                                              id_column=self.options.id_column), done)
        self._out, self._err = LineWriter(self.output_path), LineWriter(self.errors_path)
        progress = BulkProgress(self.summary.num_total, enabled=self._show_progress)
        try:
            with progress:
                self._progress = progress
                progress.advance(self.summary.num_skipped)
                self._drive(records)
            self.producer.client.delete(self.reply_stream)
        except KeyboardInterrupt:
            self.summary.is_interrupted = True
            self.producer.client.expire(self.reply_stream, ABANDONED_REPLY_TTL_S)
        finally:
            self._out.close()
            self._err.close()
            self.summary.wall_s = time.monotonic() - start_s
        return self.summary

    def _drive(self, records: Iterator[Parsed]) -> None:
        has_input = True
        while True:
            if has_input:
                has_input = self._fill(records)
            else:
                self._send()
            if not self._flights and not self._to_send and not has_input:
                return
            if self._flights:
                self._wait()

    def _unfinished(self, records: Iterator[Parsed], done: DoneSet) -> Iterator[Parsed]:
        """Records not yet in the output/errors files; duplicate ids become invalid records."""
        seen: set[str] = set()
        for record in records:
            if record.line in done.lines:
                self.summary.num_skipped += 1
                if record.item_id is not None:
                    seen.add(record.item_id)
            elif isinstance(record, BulkItem) and record.item_id in seen:
                yield InvalidItem(record.line, f"duplicate id {record.item_id!r}", record.item_id)
            elif isinstance(record, BulkItem) and record.item_id in done.item_ids:
                seen.add(record.item_id)
                self.summary.num_skipped += 1
            else:
                if record.item_id is not None:
                    seen.add(record.item_id)
                yield record

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
        try:
            self._build(Flight(item, 0))
        except SchemaError as exc:
            return exc.message
        return None

    def _build(self, flight: Flight) -> Any:
        options: dict[str, Any] = {"priority": self.options.priority, **self._defaults, **flight.item.options,
                                   "request_id": request_id_of(self.job_id, flight.item.item_id, flight.attempt),
                                   "reply_to": self.reply_stream}
        return common.build_request(self.producer.keys, options)

    def _recover(self, items: list[BulkItem]) -> None:
        """Pick up results an earlier run left in Redis (every attempt id); queue the rest."""
        if not items:
            return
        num_attempts = self.options.retries + 1
        keys = [self.producer.keys.result(request_id_of(self.job_id, item.item_id, attempt))
                for item in items for attempt in range(num_attempts)]
        raws = cast("list[bytes | None]", self.producer.client.mget(keys))
        for position, item in enumerate(items):
            found = [(attempt, raw) for attempt, raw in
                     enumerate(raws[position * num_attempts:(position + 1) * num_attempts]) if raw is not None]
            if not found:
                self._to_send.append(Flight(item, 0))
                continue
            attempt, raw = found[-1]
            self.summary.num_recovered += 1
            self._settle(Flight(item, attempt), decode_result(raw))

    def _send(self) -> None:
        if not self._to_send:
            return
        batch = list(self._to_send)
        self._to_send.clear()
        requests = [self._build(flight) for flight in batch]
        for flight, request in zip(batch, requests):
            self._flights[request.id] = flight
            self.summary.num_retried += flight.attempt > 0
        self.producer.submit_many(requests)
        self.summary.num_submitted += len(requests)

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
        for start in range(0, len(request_ids), common.MGET_CHUNK):
            chunk = request_ids[start:start + common.MGET_CHUNK]
            raws = cast("list[bytes | None]", self.producer.client.mget([self.producer.keys.result(i) for i in chunk]))
            for raw in raws:
                if raw is not None:
                    self._land(decode_result(raw))

    def _land(self, result: GenerationResult) -> None:
        flight = self._flights.pop(result.id, None)
        if flight is not None:  # NOTE: unknown ids are replies of an earlier run, already settled
            self._settle(flight, result)

    def _settle(self, flight: Flight, result: GenerationResult) -> None:
        """Write a final result, or queue the next attempt of a retryable failure."""
        is_retryable = result.status == "error" and result.error is not None and result.error.code in RETRYABLE_CODES
        if is_retryable and flight.attempt < self.options.retries:
            self._to_send.append(Flight(flight.item, flight.attempt + 1))
            return
        line = result_line(self.output_format, flight.item, result)
        if result.ok:
            self._out.write(line)
        else:
            line["attempts"] = flight.attempt + 1
            self._err.write(line)
        self.summary.status_counts[result.status] += 1
        self.summary.prompt_tokens += result.usage.prompt_tokens
        self.summary.completion_tokens += result.usage.completion_tokens
        self._progress.advance(1, result.usage.completion_tokens)

    def _write_invalid(self, record: InvalidItem) -> None:
        self._err.write(invalid_line(self.output_format, record))
        self.summary.num_invalid += 1
        self._progress.advance(1)
