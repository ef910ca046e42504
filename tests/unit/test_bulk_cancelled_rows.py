"""Rows an earlier bulk run cancelled (``--cancel-on-interrupt``): their errors-file lines are recognised in
both output shapes and dropped atomically (every other line kept) so that the re-run runs them; the summary
says what happened to each group of rows, and "complete" with errors says how many are in the errors file."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import pytest
from rich.console import Console

from tokenmill.producer.bulk.items import BulkItem, InvalidItem
from tokenmill.producer.bulk.output import (
    DoneSet,
    OutputFormat,
    drop_cancelled_lines,
    invalid_line,
    is_cancelled_line,
    repair_and_scan,
    result_line,
)
from tokenmill.producer.bulk.report import BulkSummary, describe_state, render_summary
from tokenmill.protocol.schema import GenerationResult


def _lines(fmt: OutputFormat) -> list[dict[str, object]]:
    """Errors-file lines: a cancelled row (line 1), a failed row (line 2), an invalid record (line 3)."""
    cancelled = GenerationResult.failure("r1", "cancelled", "request cancelled while waiting", status="cancelled")
    failed = GenerationResult.failure("r2", "internal", "boom")
    return [result_line(fmt, BulkItem("a", 1, {"prompt": "x"}), cancelled),
            result_line(fmt, BulkItem("b", 2, {"prompt": "y"}), failed),
            invalid_line(fmt, InvalidItem(3, "bad params", "c"))]


@pytest.mark.parametrize("fmt", ["plain", "openai"])
def test_cancelled_lines_are_told_apart_and_dropped_keeping_the_rest(fmt: OutputFormat, tmp_path: Path) -> None:
    lines = _lines(fmt)
    assert [is_cancelled_line(line) for line in lines] == [True, False, False]
    errors = tmp_path / "out.jsonl.errors.jsonl"
    errors.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = DoneSet()
    repair_and_scan(errors, done, is_errors=True)
    assert (done.lines, done.cancelled_lines) == ({2, 3}, {1})
    assert drop_cancelled_lines(errors) == 1
    assert [json.loads(line) for line in errors.read_text().splitlines()] == lines[1:]
    assert sorted(path.name for path in tmp_path.iterdir()) == [errors.name], "no scratch file left behind"
    assert drop_cancelled_lines(errors) == 0


def _summary(**counts: int) -> BulkSummary:
    statuses = Counter({name: counts.pop(name) for name in ("ok", "error", "cancelled") if name in counts})
    summary = BulkSummary(Path("out.jsonl"), Path("out.jsonl.errors.jsonl"), status_counts=statuses)
    for name, value in counts.items():
        setattr(summary, name, value)
    return summary


def test_the_summary_says_what_happened_to_each_group_of_rows() -> None:
    summary = _summary(num_total=200, num_skipped=171, num_earlier_ok=171, ok=29, num_rerun_cancelled=29,
                       num_submitted=29)
    out = io.StringIO()
    render_summary(summary, Console(file=out, width=200))
    text = out.getvalue()
    for what, value in [("done earlier (in the output, skipped)", 171), ("failed earlier", 0), ("done now", 29),
                        ("failed now", 0), ("cancelled earlier, run again", 29),
                        ("cancelled earlier, not run again", 0)]:
        assert any(what in row and row.rstrip(" │").endswith(f" {value}") for row in text.splitlines()), (what, text)
    assert text.rstrip().endswith("(complete)")
    assert summary.as_dict()["rerun_cancelled"] == 29 and summary.as_dict()["earlier_ok"] == 171


def test_complete_with_errors_and_interrupted_with_cancels_say_so() -> None:
    kept = _summary(num_total=200, num_skipped=171, num_earlier_ok=171, cancelled=29, num_kept_cancelled=29)
    assert kept.is_complete and kept.has_errors
    assert describe_state(kept) == "complete with errors: 29 records in the errors file"
    interrupted = _summary(num_total=200, num_cancelled=29, ok=171, is_interrupted=True)
    assert "29 queued requests cancelled (the re-run runs them again)" in describe_state(interrupted)
