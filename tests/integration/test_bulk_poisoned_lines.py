"""Bulk jobs with poisoned lines: a line that cannot be encoded is one invalid
record, never the end of the run, and the exit status says the errors file is not empty, on
resumed runs too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.integration.bulk_helpers import read_jsonl
from tests.worker_helpers import make_settings, running_worker
from tokenmill.cli.app import app
from tokenmill.cli.bulk import EXIT_INCOMPLETE
from tokenmill.producer import Producer, bulk

runner = CliRunner()
NUM_GOOD = 2_999
SURROGATE_LINE = '{"id":"s","prompt":"\\ud800"}'  # valid JSON, a lone surrogate: not encodable as UTF-8


@pytest.fixture
def echo_worker(redis_url: str, key_prefix: str) -> Iterator[None]:
    with running_worker(make_settings(redis_url, key_prefix)):
        yield


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_one_unencodable_line_is_one_invalid_record(tmp_path: Path, redis_url: str, key_prefix: str,
                                                    echo_worker: None) -> None:
    good = [json.dumps({"id": f"q{i}", "prompt": f"item {i}", "max_tokens": 1}) for i in range(NUM_GOOD)]
    source = _write(tmp_path / "in.jsonl", [*good[:1500], SURROGATE_LINE, *good[1500:]])
    out = tmp_path / "out.jsonl"
    cli = ["--redis-url", redis_url, "--prefix", key_prefix, "bulk", str(source), str(out), "--no-progress", "--json"]
    outcome = runner.invoke(app, cli)
    assert outcome.exit_code == EXIT_INCOMPLETE, outcome.output
    summary = json.loads(outcome.stdout)
    assert (summary["ok"], summary["invalid"], summary["complete"]) == (NUM_GOOD, 1, True)
    assert len(read_jsonl(out)) == NUM_GOOD
    [error] = read_jsonl(Path(summary["errors"]))
    assert (error["id"], error["line"], error["error"]["code"]) == ("s", 1501, "validation")
    assert "UTF-8" in error["error"]["message"]
    resumed = runner.invoke(app, cli)
    assert resumed.exit_code == EXIT_INCOMPLETE, resumed.output
    summary = json.loads(resumed.stdout)
    assert (summary["skipped"], summary["submitted"], summary["earlier_errors"]) == (NUM_GOOD + 1, 0, 1)


def test_unencodable_ids_and_cells_are_invalid_records(tmp_path: Path, producer: Producer,
                                                       echo_worker: None) -> None:
    source = _write(tmp_path / "in.jsonl", ['{"id":"\\udcff","prompt":"x"}', '{"id":"ok","prompt":"fine"}',
                                            '{"id":"m","prompt":"x","metadata":{"k":"\\ud800"}}',
                                            '{"id":"st","prompt":"x","stop":["\\ud800"]}'])
    summary = bulk.run(source, tmp_path / "out.jsonl", producer=producer)
    assert (summary.num_ok, summary.num_invalid, summary.is_complete) == (1, 3, True)
    assert sorted(r["line"] for r in read_jsonl(summary.errors_path)) == [1, 3, 4]
    csv_source = tmp_path / "in.csv"
    csv_source.write_bytes(b"id,prompt,max_tokens\na,fine,2\nb,bad \xff bytes,2\nc,also fine,2\n")
    summary = bulk.run(csv_source, tmp_path / "csv-out.jsonl", producer=producer)
    assert (summary.num_ok, summary.num_invalid, summary.completion_tokens) == (2, 1, 4)
    [error] = read_jsonl(summary.errors_path)
    assert error["line"] == 2 and "UTF-8" in error["error"]["message"]
