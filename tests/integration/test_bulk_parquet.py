"""A bulk output named ``.parquet`` is real Parquet (read back with pyarrow): the rows of the JSONL
output, typed, free-form fields as JSON text; resumable (a journal beside it, each id once after a
kill between the rewrite and the journal's delete); interrupted runs leave a valid file; no pyarrow,
OpenAI Batch input or a foreign Parquet file at OUTPUT are clear errors before anything is sent."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from typer.testing import CliRunner

from tests.integration.bulk_helpers import read_jsonl, write_input
from tests.worker_helpers import make_settings, running_worker
from tokenmill.cli.app import app
from tokenmill.producer import Producer, bulk
from tokenmill.producer.bulk import BulkError, BulkJob, BulkOptions
from tokenmill.producer.bulk.parquet_output import JOURNAL_SUFFIX
from tokenmill.protocol.keys import Keys

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

RECORDS = [
    {"id": "plain", "prompt": "hello there", "max_tokens": 5},
    {"id": "chat", "messages": [{"role": "user", "content": "héllo wörld"}], "max_tokens": 32},
    {"id": "samples", "prompt": "twice", "n": 2, "max_tokens": 8, "metadata": {"k": [1, "x"]}},
    {"id": "logprobs", "prompt": "abc", "logprobs": 1, "max_tokens": 3},
    {"id": "bad", "prompt": "x", "max_tokens": 0},  # invalid: to the errors file
]


@pytest.fixture
def echo_worker(redis_url: str, key_prefix: str) -> Iterator[None]:
    with running_worker(make_settings(redis_url, key_prefix)):
        yield


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _rows(path: Path) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in pq.read_table(path).to_pylist()}


def _as_line(row: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row as the JSONL line it stands for: JSON-text columns parsed, nulls left out."""
    line = {name: json.loads(value) if name in ("metadata", "samples", "logprobs", "token_logprobs") and value
            else value for name, value in row.items()}
    return {name: value for name, value in line.items() if value is not None}


def test_a_parquet_output_holds_the_jsonl_outputs_rows(tmp_path: Path, producer: Producer,
                                                      echo_worker: None) -> None:
    source = _write(tmp_path / "in.jsonl", RECORDS)
    summary = bulk.run(source, tmp_path / "out.parquet", producer=producer)
    bulk.run(source, tmp_path / "out.jsonl", producer=producer)
    assert (summary.num_ok, summary.num_invalid) == (4, 1)
    schema = pq.read_schema(tmp_path / "out.parquet")
    assert schema.field("id").type == pa.string() and schema.field("index").type == pa.int64()
    assert schema.field("usage").type == pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                                                    ("total_tokens", pa.int64())])
    rows = _rows(tmp_path / "out.parquet")
    assert {item_id: _as_line(row) for item_id, row in rows.items()} == {
        line["id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    assert rows["chat"]["text"] == "héllo wörld" and rows["plain"]["usage"]["completion_tokens"] == 5
    assert [sample["text"] for sample in json.loads(rows["samples"]["samples"])] == ["twice", "twice"]
    assert json.loads(rows["samples"]["metadata"]) == {"k": [1, "x"]} and rows["plain"]["metadata"] is None
    assert [line["id"] for line in read_jsonl(summary.errors_path)] == ["bad"]  # failures stay JSONL
    assert summary.errors_path == tmp_path / "out.parquet.errors.jsonl"
    assert not (tmp_path / f"out.parquet{JOURNAL_SUFFIX}").exists()


def test_a_parquet_output_resumes_and_keeps_each_id_once(tmp_path: Path, producer: Producer,
                                                        echo_worker: None) -> None:
    out = tmp_path / "out.parquet"
    records = [{"id": f"q{i}", "prompt": f"item {i}", "max_tokens": 4} for i in range(6)]
    bulk.run(_write(tmp_path / "first.jsonl", records[:2]), out, producer=producer)
    # A run that died after rewriting OUTPUT but before deleting its journal, and one that died
    # before rewriting: the journal repeats q1 (already in OUTPUT) and holds q2 (not yet in it).
    bulk.run(_write(tmp_path / "side.jsonl", records[1:3]), tmp_path / "side.jsonl.out", producer=producer)
    journal = out.with_name(out.name + JOURNAL_SUFFIX)
    journal.write_text((tmp_path / "side.jsonl.out").read_text())
    summary = bulk.run(_write(tmp_path / "all.jsonl", records), out, producer=producer)
    assert (summary.num_skipped, summary.num_ok) == (3, 3), "q0-q2 are done; only q3-q5 are generated"
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == [f"q{i}" for i in range(6)]
    assert set(table.column("text").to_pylist()) == {"item"} and not journal.exists()


def test_an_interrupted_run_leaves_a_valid_parquet_file_to_resume(tmp_path: Path, producer: Producer,
                                                                  redis_url: str, key_prefix: str) -> None:
    source = write_input(tmp_path / "in.jsonl", "jsonl", num_items=5)
    out = tmp_path / "out.parquet"
    job = BulkJob(producer, source, out, BulkOptions())
    runner = threading.Thread(target=job.run)
    runner.start()  # no worker: every request waits in its lane
    while producer.client.xlen(producer.keys.lane(2)) < 5 and runner.is_alive():
        runner.join(0.01)
    job.stopping.set()
    runner.join(timeout=30)
    assert job.summary.is_interrupted and pq.read_table(out).num_rows == 0  # valid, nothing finished yet
    # NOTE: paced, so the queued requests are still running when the resumed run adopts them (a result
    # already there when it starts is recovered instead)
    with running_worker(make_settings(redis_url, key_prefix, model="echo:step_delay_s=0.1")):
        summary = bulk.run(source, out, producer=producer)
    assert summary.is_complete and summary.num_adopted == 5 and summary.num_submitted == 0
    assert sorted(pq.read_table(out).column("id").to_pylist()) == [f"q{i}" for i in range(5)]


def _nothing_sent(client: redis.Redis, keys: Keys) -> bool:
    return all(client.xlen(lane) == 0 for lane in keys.lanes)


def test_without_pyarrow_a_parquet_output_is_refused_before_anything_is_sent(
        tmp_path: Path, producer: Producer, redis_client: redis.Redis, redis_url: str, key_prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    source = _write(tmp_path / "in.jsonl", RECORDS[:1])
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # NOTE: import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(BulkError, match=r"Parquet output needs pyarrow: pip install 'tokenmill\[parquet\]'"):
        bulk.run(source, tmp_path / "out.parquet", producer=producer)
    outcome = CliRunner().invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "bulk", str(source),
                                       str(tmp_path / "out.parquet"), "--no-progress"])
    assert outcome.exit_code == 1, outcome.output
    assert "error: Parquet output needs pyarrow: pip install 'tokenmill[parquet]'" in outcome.output
    assert _nothing_sent(redis_client, producer.keys) and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_openai_input_and_a_foreign_parquet_file_are_refused_before_anything_is_sent(
        tmp_path: Path, producer: Producer, redis_client: redis.Redis) -> None:
    openai_input = write_input(tmp_path / "batch.jsonl", "openai", num_items=2)
    with pytest.raises(BulkError, match="OpenAI Batch output lines, which are JSONL: name the output .jsonl"):
        bulk.run(openai_input, tmp_path / "out.parquet", producer=producer)
    foreign = tmp_path / "theirs.parquet"
    pq.write_table(pa.table({"id": ["a"], "score": [0.5]}), foreign)
    with pytest.raises(BulkError, match="not those of a tokenmill bulk output"):
        bulk.run(_write(tmp_path / "in.jsonl", RECORDS[:1]), foreign, producer=producer)
    assert pq.read_table(foreign).column_names == ["id", "score"]  # untouched
    assert _nothing_sent(redis_client, producer.keys)
