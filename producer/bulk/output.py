"""Bulk output: shaping results as plain or OpenAI Batch lines, and the resumable JSONL files.

Owns the on-disk format and crash safety (whole lines, flush per line, periodic fsync, a torn
last line truncated on resume). Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from tokenmill.producer.bulk.errors import BulkError
from tokenmill.producer.bulk.items import BulkItem, InvalidItem
from tokenmill.producer.closing import Closing
from tokenmill.producer.openai_compat.objects import completion_object, result_error
from tokenmill.protocol.schema import GenerationResult
from tokenmill.protocol.values import is_utf8

OutputFormat = Literal["plain", "openai"]
CANCELLED_CODE = "request_cancelled"  # the OpenAI error code of a cancelled result (openai_compat.objects)
FSYNC_INTERVAL_S = 2.0
UNKNOWN_MODEL = "tokenmill"  # the model named in outputs of results that do not say (written by older workers)
# Result fields a plain output line carries when the result has them (asked-for extras).
_PLAIN_EXTRAS = ("logprobs", "token_logprobs", "samples")


def _short_hash(text: str, num_chars: int = 24) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:num_chars]


def result_line(fmt: OutputFormat, item: BulkItem, result: GenerationResult) -> dict[str, Any]:
    """The output line of a finished item (ok, or a terminal failure for the errors file)."""
    if fmt == "openai":
        return _openai_line(item, result)
    line: dict[str, Any] = {"id": item.item_id, "status": result.status, "text": result.text,
                            "finish_reason": result.finish_reason, "usage": result.usage.model_dump(),
                            "model": result.model or item.model, "index": item.index}
    dumped = result.model_dump(mode="json", include=set(_PLAIN_EXTRAS), exclude_none=True)
    line.update(dumped)
    if result.error is not None:
        line["error"] = result.error.model_dump()
        line["line"] = item.line
    if result.metadata:
        line["metadata"] = result.metadata
    return line


def _openai_line(item: BulkItem, result: GenerationResult) -> dict[str, Any]:
    """OpenAI's Batch output line: the HTTP response a request would have had (200 with the
    completion, or the error status with OpenAI's error body; failures also carry their input line)."""
    line: dict[str, Any] = {"id": f"batch_req_{_short_hash(result.id)}", "custom_id": item.item_id}
    if result.ok:
        body = completion_object(item.endpoint, result, model=item.model or UNKNOWN_MODEL, created=int(time.time()))
        return {**line, "response": {"status_code": 200, "request_id": result.id, "body": body}, "error": None}
    status_code, error_body = result_error(result)
    return {**line, "response": {"status_code": status_code, "request_id": result.id, "body": error_body},
            "error": None, "line": item.line}


def invalid_line(fmt: OutputFormat, item: InvalidItem) -> dict[str, Any]:
    """The errors-file line of a record that never became a request."""
    error = {"code": "validation", "message": item.reason}
    if fmt == "openai":
        return {"id": f"batch_req_{_short_hash(f'invalid-{item.line}-{item.reason}')}", "custom_id": item.item_id,
                "response": None, "error": error, "line": item.line}
    return {"id": item.item_id, "status": "error", "error": error, "line": item.line, "index": item.index}


@dataclass
class DoneSet:
    """What earlier runs already finished: ids in the output file, lines in the errors file."""

    item_ids: set[str] = field(default_factory=set)  # ids (plain) or custom_ids (openai) written as output
    lines: set[int] = field(default_factory=set)  # input lines written to the errors file (cancelled ones aside)
    cancelled_lines: set[int] = field(default_factory=set)  # input lines in the errors file as cancelled

    def __len__(self) -> int:
        return len(self.item_ids) + len(self.lines)


def repair_and_scan(path: Path, done: DoneSet, *, is_errors: bool) -> int:
    """Truncate a torn last line of ``path`` (a kill mid-write) and record its finished items.

    Returns:
        The number of complete lines in the file.

    Raises:
        BulkError: a complete line is not a JSON object (the file is not ours).
    """
    if not path.exists():
        return 0
    with path.open("r+b") as handle:
        data = handle.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # NOTE: only the last line can be torn: every write is one whole line
            handle.truncate(end)
    num_lines = 0
    for line_no, raw in enumerate(data[:end].splitlines(), start=1):
        if not raw.strip():
            continue
        num_lines += 1
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BulkError(f"{path} line {line_no} is not JSON ({exc}); not a tokenmill bulk output?") from exc
        if not isinstance(record, dict):
            raise BulkError(f"{path} line {line_no} is not a JSON object; not a tokenmill bulk output?")
        if is_errors and isinstance(record.get("line"), int):
            (done.cancelled_lines if is_cancelled_line(record) else done.lines).add(record["line"])
        elif not is_errors:
            item_id = record.get("custom_id", record.get("id"))
            if item_id is not None:
                done.item_ids.add(str(item_id))
    return num_lines


def is_cancelled_line(record: dict[str, Any]) -> bool:
    """Whether an errors-file line is a result ``cancelled`` (plain: its status; OpenAI: its error code)."""
    if record.get("status") == "cancelled":
        return True
    response = record.get("response")
    body = response.get("body") if isinstance(response, dict) else None
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == CANCELLED_CODE


def drop_cancelled_lines(path: Path) -> int:
    """Rewrite the errors file ``path`` without its cancelled lines (their rows run again), atomically: a
    kill leaves the old file or the new one. Call after :func:`repair_and_scan` (whole lines only).

    Returns:
        The number of lines dropped.
    """
    kept: list[bytes] = []
    num_dropped = 0
    for raw in path.read_bytes().splitlines(keepends=True):
        record = json.loads(raw) if raw.strip() else None
        if isinstance(record, dict) and is_cancelled_line(record):
            num_dropped += 1
        else:
            kept.append(raw)
    if num_dropped:
        scratch = path.with_name(path.name + ".tmp")
        with scratch.open("wb") as handle:
            handle.write(b"".join(kept))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    return num_dropped


def json_text(value: Any) -> str:
    """``value`` as JSON text, non-ASCII as it is; valid UTF-8 (lone surrogates from a bad input
    line are kept as JSON escapes)."""
    text = json.dumps(value, ensure_ascii=False)
    return text if is_utf8(text) else json.dumps(value)


class LineWriter(Closing):
    """Appends whole JSON lines: flushed per line, fsynced every ``FSYNC_INTERVAL_S`` and on close."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handle: IO[str] = path.open("a", encoding="utf-8")
        self._last_sync_s = time.monotonic()
        self.num_written = 0

    def write(self, record: dict[str, Any]) -> None:
        # NOTE: one write() call per line, so a kill leaves at most one torn line at the end.
        self._handle.write(json_text(record) + "\n")
        self._handle.flush()
        self.num_written += 1
        if time.monotonic() - self._last_sync_s > FSYNC_INTERVAL_S:
            self.sync()

    def sync(self) -> None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._last_sync_s = time.monotonic()

    def close(self) -> None:
        if not self._handle.closed:
            self.sync()
            self._handle.close()
