"""Bulk output named ``.parquet``: real Parquet, resumable like the JSONL output.

A Parquet file cannot be appended to a line at a time, so a run appends its results to a JSONL
journal beside it (``OUTPUT.partial.jsonl``, crash-safe like every bulk JSONL file) and, when it
ends (done or interrupted), rewrites OUTPUT as the rows it held plus the journal's, then deletes
the journal. Ids are unique in a job, so a row met twice (a kill between the rewrite and the
delete) is kept once. Plain lines only: OpenAI Batch output is JSONL by definition.

Columns: the plain output line's keys. ``id``, ``status``, ``text``, ``finish_reason``, ``model``,
``index`` and ``usage`` (a struct of the three counts) are typed; ``metadata``, ``samples``,
``logprobs`` and ``token_logprobs`` are free-form and held as JSON text (null when absent).
Never imports torch, the engine or the worker; pyarrow when a job uses this.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenmill.producer.bulk.arrow import import_pyarrow
from tokenmill.producer.bulk.errors import BulkError
from tokenmill.producer.bulk.output import DoneSet, json_text, repair_and_scan

PARQUET_SUFFIXES = (".parquet", ".pq")
JOURNAL_SUFFIX = ".partial.jsonl"
JSON_COLUMNS = ("metadata", "samples", "logprobs", "token_logprobs")
ROWS_PER_GROUP = 10_000


def is_parquet_output(path: Path) -> bool:
    return path.suffix.lower() in PARQUET_SUFFIXES


class ParquetOutput:
    """OUTPUT as Parquet, fed through :attr:`journal`.

    Raises:
        BulkError: pyarrow is missing (raised here, before a job sends anything).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.journal = path.with_name(path.name + JOURNAL_SUFFIX)
        self._pa, self._pq = import_pyarrow("Parquet output")
        usage = self._pa.struct([(name, self._pa.int64()) for name in
                                 ("prompt_tokens", "completion_tokens", "total_tokens")])
        self.schema = self._pa.schema(
            [(name, self._pa.string()) for name in ("id", "status", "text", "finish_reason", "model")]
            + [("index", self._pa.int64()), ("usage", usage)]
            + [(name, self._pa.string()) for name in JSON_COLUMNS])

    def scan(self, done: DoneSet) -> None:
        """Record the ids OUTPUT and the journal hold (the journal's torn last line truncated).

        Raises:
            BulkError: OUTPUT is not a Parquet file of this schema (not a tokenmill bulk output).
        """
        if self.path.exists():
            ids = self._open().read(columns=["id"]).column("id").to_pylist()
            done.item_ids.update(str(item_id) for item_id in ids)
        repair_and_scan(self.journal, done, is_errors=False)

    def merge(self) -> None:
        """Rewrite OUTPUT (atomically: a temp file moved over it) as its rows and then the journal's,
        each id once, and delete the journal. Without a journal an existing OUTPUT stays as it is."""
        if self.path.exists() and not self.journal.exists():
            return
        partial = self.path.with_name(self.path.name + ".tmp")
        seen: set[str] = set()
        with self._pq.ParquetWriter(partial, self.schema) as writer:
            for table in self._tables():
                keep = _first_sightings(table.column("id").to_pylist(), seen)
                if keep:
                    writer.write_table(table.take(keep))
        with partial.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, self.path)
        self.journal.unlink(missing_ok=True)

    def _open(self) -> Any:
        """OUTPUT as a ``pyarrow.parquet.ParquetFile`` of this schema.

        Raises:
            BulkError: it is not one (not a tokenmill bulk output).
        """
        try:
            parquet_file = self._pq.ParquetFile(self.path)
        except (OSError, self._pa.ArrowException) as exc:
            raise BulkError(f"{self.path} is not a Parquet file ({exc}); not a tokenmill bulk output?") from exc
        if not parquet_file.schema_arrow.equals(self.schema):
            raise BulkError(f"{self.path} has the columns {parquet_file.schema_arrow.names}, not those of a "
                            "tokenmill bulk output")
        return parquet_file

    def _tables(self) -> Iterator[Any]:
        """OUTPUT's rows, then the journal's, in tables of at most :data:`ROWS_PER_GROUP` rows."""
        if self.path.exists():
            for batch in self._open().iter_batches(batch_size=ROWS_PER_GROUP):
                yield self._pa.Table.from_batches([batch], schema=self.schema)
        if not self.journal.exists():
            return
        rows: list[dict[str, Any]] = []
        with self.journal.open("rb") as handle:
            for raw in handle:
                if raw.strip():
                    rows.append(self._row(json.loads(raw)))
                if len(rows) >= ROWS_PER_GROUP:
                    yield self._pa.Table.from_pylist(rows, schema=self.schema)
                    rows = []
        if rows:
            yield self._pa.Table.from_pylist(rows, schema=self.schema)

    def _row(self, line: dict[str, Any]) -> dict[str, Any]:
        """A plain output line as a row: free-form fields as JSON text."""
        row = {name: line.get(name) for name in self.schema.names}
        for name in JSON_COLUMNS:
            row[name] = None if row[name] is None else json_text(row[name])
        return row


def _first_sightings(ids: list[str], seen: set[str]) -> list[int]:
    """Positions of the ids not in ``seen`` (each id's first only), which join ``seen``."""
    keep = []
    for position, item_id in enumerate(ids):
        if item_id not in seen:
            seen.add(item_id)
            keep.append(position)
    return keep
