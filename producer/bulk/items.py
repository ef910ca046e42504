"""Bulk input: reading JSONL, OpenAI Batch, CSV and Parquet files into :class:`BulkItem` records.

Owns format detection and per-line parsing (never raises for one bad line: the line becomes an
:class:`InvalidItem`). Imports only the standard library and protocol.schema; pyarrow lazily (producer.bulk.arrow).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from tokenmill.producer.bulk.arrow import import_pyarrow
from tokenmill.producer.bulk.errors import BulkInputError
from tokenmill.producer.openai_compat.bodies import ENDPOINTS, BodyError, Endpoint, parse_body
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.protocol.values import is_utf8

InputFormat = Literal["jsonl", "openai", "csv", "parquet"]
FORMATS: tuple[str, ...] = ("auto", "jsonl", "openai", "csv", "parquet")
SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
_PLAIN_FIELDS = frozenset({"id", "prompt", "messages", "params", "metadata", "priority", "model"})
# CSV cells are text: sampling columns are parsed to their field's type ("4" -> 4) before the
# strict wire validation. ``stop`` stays text (one stop string per cell).
_CELL_TYPES = {name: TypeAdapter(info.annotation) for name, info in SamplingParams.model_fields.items()
               if name != "stop" and info.annotation is not None}


@dataclass
class BulkItem:
    """One valid input record."""

    item_id: str  # the user's id (id / custom_id / id column), else the line or row number
    line: int  # 1-based line (JSONL) or data row (CSV, Parquet) in the input
    options: dict[str, Any]  # submit options: prompt or messages, sampling params, metadata, priority, model
    model: str | None = None  # the model the record names (the output names the one that answered)
    endpoint: Endpoint = "chat"  # OpenAI input: the line's url (the output's object type follows it)

    @property
    def index(self) -> int:
        """0-based position in the input."""
        return self.line - 1


@dataclass
class InvalidItem:
    """A record that cannot become a request; reported in the errors file, never dropped."""

    line: int  # 1-based line or data row
    reason: str
    item_id: str | None = None  # when it could be read
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def index(self) -> int:
        return self.line - 1


Parsed = BulkItem | InvalidItem


def detect_format(path: Path, requested: str = "auto") -> InputFormat:
    """The input format: ``requested`` unless ``"auto"``, else by extension and first line.

    Raises:
        BulkInputError: unknown format name, or the file cannot be read.
    """
    if requested not in FORMATS:
        raise BulkInputError(f"unknown format {requested!r}; choose one of {', '.join(FORMATS)}")
    if requested != "auto":
        return requested  # type: ignore[return-value]
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    try:
        with path.open(encoding="utf-8") as handle:
            first = next((line for line in handle if line.strip()), "")
    except (OSError, UnicodeDecodeError) as exc:
        raise BulkInputError(f"cannot read {path}: {exc}") from exc
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return "jsonl"  # NOTE: the bad line is then reported with its line number
    return "openai" if isinstance(record, dict) and "custom_id" in record else "jsonl"


def count_records(path: Path, fmt: InputFormat) -> int:
    """Number of records (for the progress bar's total)."""
    if fmt == "parquet":
        return int(_pyarrow_parquet().ParquetFile(path).metadata.num_rows)
    if fmt == "csv":
        with path.open(newline="", encoding="utf-8", errors="surrogateescape") as handle:
            return max(0, sum(1 for _ in csv.reader(handle)) - 1)
    with path.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def read_items(path: Path, fmt: InputFormat, *, prompt_column: str = "prompt",
               id_column: str = "id") -> Iterator[Parsed]:
    """Yield one record per input line or row, in input order.

    Raises:
        BulkInputError: the file cannot be opened, CSV/Parquet lacks the prompt column, or
            pyarrow is missing for Parquet.
    """
    try:
        if fmt in ("jsonl", "openai"):
            yield from _read_jsonl(path, fmt)
        elif fmt == "csv":
            yield from _read_csv(path, prompt_column, id_column)
        else:
            yield from _read_parquet(path, prompt_column, id_column)
    except OSError as exc:
        raise BulkInputError(f"cannot read {path}: {exc}") from exc


def _read_jsonl(path: Path, fmt: InputFormat) -> Iterator[Parsed]:
    parse = parse_openai if fmt == "openai" else parse_plain
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield InvalidItem(line_no, f"invalid JSON: {exc}")
                continue
            if not isinstance(record, dict):
                yield InvalidItem(line_no, f"expected a JSON object, got {type(record).__name__}")
                continue
            yield parse(record, line_no)


def _id_of(value: Any, line_no: int) -> str | None:
    """The item id: the value (a UTF-8 string or an int), the line number when absent, None when unusable."""
    if value is None or value == "":
        return str(line_no)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value if isinstance(value, str) and is_utf8(value) else None


def parse_plain(record: dict[str, Any], line_no: int) -> Parsed:
    """A ``{"id", "prompt" | "messages", params...}`` record (params top-level or in ``params``)."""
    item_id = _id_of(record.get("id"), line_no)
    if item_id is None:
        return InvalidItem(line_no, "id must be a valid UTF-8 string or an integer")
    unknown = set(record) - _PLAIN_FIELDS - SAMPLING_FIELDS
    if unknown:
        return InvalidItem(line_no, f"unknown field(s): {', '.join(sorted(unknown))}", item_id)
    params = record.get("params") or {}
    if not isinstance(params, dict):
        return InvalidItem(line_no, "params must be an object", item_id)
    bad_params = set(params) - SAMPLING_FIELDS
    if bad_params:
        return InvalidItem(line_no, f"unknown param(s): {', '.join(sorted(bad_params))}", item_id)
    options = {**{k: v for k, v in record.items() if k in SAMPLING_FIELDS}, **params}
    for name in ("prompt", "messages", "metadata", "priority", "model"):
        if record.get(name) is not None:
            options[name] = record[name]
    model = record.get("model")
    return BulkItem(item_id, line_no, options, model=model if isinstance(model, str) else None)


def parse_openai(record: dict[str, Any], line_no: int) -> Parsed:
    """An OpenAI Batch API request line (``custom_id``, ``method``, ``url``, ``body``)."""
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or not is_utf8(custom_id):
        return InvalidItem(line_no, "custom_id must be a non-empty valid UTF-8 string")
    if record.get("method", "POST") != "POST":
        return InvalidItem(line_no, f"method must be POST, got {record.get('method')!r}", custom_id)
    url = record.get("url", "/v1/chat/completions")
    if url not in ENDPOINTS:
        return InvalidItem(line_no, f"url must be one of {sorted(ENDPOINTS)}, got {url!r}", custom_id)
    body = record.get("body")
    if not isinstance(body, dict):
        return InvalidItem(line_no, "body must be an object", custom_id)
    try:
        parsed = parse_body(body, ENDPOINTS[url])
    except BodyError as exc:
        return InvalidItem(line_no, f"body.{exc}", custom_id)
    if parsed.stream:
        return InvalidItem(line_no, "body.stream is not supported in a batch", custom_id)
    return BulkItem(custom_id, line_no, parsed.options, model=parsed.model, endpoint=parsed.endpoint)


def _read_csv(path: Path, prompt_column: str, id_column: str) -> Iterator[Parsed]:
    # NOTE: undecodable bytes become lone surrogates: that row is reported invalid, the run goes on.
    with path.open(newline="", encoding="utf-8", errors="surrogateescape") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or prompt_column not in reader.fieldnames:
            raise BulkInputError(f"{path}: no prompt column {prompt_column!r} (columns: {reader.fieldnames})")
        for row_no, row in enumerate(reader, start=1):
            yield _parse_row(row, row_no, prompt_column, id_column)


def _read_parquet(path: Path, prompt_column: str, id_column: str) -> Iterator[Parsed]:
    parquet = _pyarrow_parquet()
    table_file = parquet.ParquetFile(path)
    if prompt_column not in table_file.schema_arrow.names:
        raise BulkInputError(f"{path}: no prompt column {prompt_column!r} (columns: {table_file.schema_arrow.names})")
    row_no = 0
    for batch in table_file.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            row_no += 1
            yield _parse_row(row, row_no, prompt_column, id_column)


def _parse_row(row: dict[str, Any], row_no: int, prompt_column: str, id_column: str) -> Parsed:
    """A CSV or Parquet row: the prompt column, an optional id column, sampling-param columns;
    other non-empty columns become metadata. Empty cells mean "default"."""
    item_id = _id_of(row.get(id_column), row_no)
    if item_id is None:
        return InvalidItem(row_no, f"column {id_column!r} must be a valid UTF-8 string or an integer")
    prompt = row.get(prompt_column)
    options: dict[str, Any] = {}
    if isinstance(prompt, list):
        options["messages"] = prompt
    elif isinstance(prompt, str) and prompt:
        options["prompt"] = prompt
    else:
        return InvalidItem(row_no, f"column {prompt_column!r} is empty", item_id)
    metadata: dict[str, Any] = {}
    for name, value in row.items():
        if name in (prompt_column, id_column) or value is None or value == "":
            continue
        if name in SAMPLING_FIELDS:
            options[name] = _cell_value(name, value)
        else:
            metadata[str(name)] = value
    if metadata:
        options["metadata"] = metadata
    return BulkItem(item_id, row_no, options)


def _cell_value(name: str, value: Any) -> Any:
    """A sampling cell as its field's type when it is text that parses leniently; else unchanged
    (the strict validation of the request then reports it)."""
    if not isinstance(value, str) or name not in _CELL_TYPES:
        return value
    try:
        return _CELL_TYPES[name].validate_python(value, strict=False)
    except ValidationError:
        return value


def _pyarrow_parquet() -> Any:
    return import_pyarrow("Parquet input", BulkInputError)[1]
