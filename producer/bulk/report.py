"""Bulk progress and summary: a rich progress bar (items/s, tokens/s, ETA, the predicted tokens left and their
ETA) and the final counts.

Owns presentation only; the pipeline calls ``advance``. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from tokenmill.producer.eta import Eta


@dataclass
class BulkSummary:
    """What one run of a bulk job did. Counts are items (input records), not requests."""

    output_path: Path  # JSONL results
    errors_path: Path  # JSONL failures and invalid records
    num_total: int = 0  # records in the input
    num_skipped: int = 0  # already finished by an earlier run (found in the output/errors files)
    num_earlier_ok: int = 0  # of the skipped: in the output file (done earlier)
    num_recovered: int = 0  # results an earlier run left in Redis, written without regenerating
    num_adopted: int = 0  # requests an earlier run queued: waited for, not sent again
    num_cancelled: int = 0  # requests of this run cancelled on interrupt (--cancel-on-interrupt)
    num_rerun_cancelled: int = 0  # items an earlier run cancelled (--cancel-on-interrupt), run again by this one
    num_kept_cancelled: int = 0  # items an earlier run cancelled, left cancelled in the errors file (retry_cancelled
    #                              off): skipped, or written there by this run
    num_submitted: int = 0  # requests sent by this run (retries included)
    num_retried: int = 0  # retry requests sent
    num_invalid: int = 0  # records that never became a request (bad JSON, bad params, duplicate id)
    num_earlier_errors: int = 0  # records an earlier run wrote to the errors file (failed or invalid)
    status_counts: Counter[str] = field(default_factory=Counter)  # final status of items finished this run
    prompt_tokens: int = 0
    completion_tokens: int = 0  # of results that landed during this run (recovered ones excluded)
    recovered_tokens: int = 0  # completion tokens of recovered results
    wall_s: float = 0.0
    is_interrupted: bool = False  # Ctrl-C / SIGTERM: the files are valid; re-run to finish

    @property
    def num_ok(self) -> int:
        return self.status_counts["ok"]

    @property
    def num_failed(self) -> int:
        """Items finished this run with a non-ok status (retries exhausted or not retryable)."""
        return sum(n for status, n in self.status_counts.items() if status != "ok")

    @property
    def num_done(self) -> int:
        """Items finished in this run (ok, failed or invalid)."""
        return sum(self.status_counts.values()) + self.num_invalid

    @property
    def has_errors(self) -> bool:
        """Some record is in the errors file: failed or invalid in this run or an earlier one."""
        return bool(self.num_failed or self.num_invalid or self.num_earlier_errors)

    @property
    def num_in_errors_file(self) -> int:
        """Records in the errors file after this run (failed or invalid, in this run or an earlier one)."""
        return self.num_failed + self.num_invalid + self.num_earlier_errors

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens that landed during this run per wall-clock second (recovered ones excluded)."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def is_complete(self) -> bool:
        """Every input record is accounted for in the output or errors file."""
        return not self.is_interrupted and self.num_skipped + self.num_done == self.num_total

    def as_dict(self) -> dict[str, Any]:
        return {"output": str(self.output_path), "errors": str(self.errors_path), "total": self.num_total,
                "skipped": self.num_skipped, "earlier_ok": self.num_earlier_ok, "recovered": self.num_recovered,
                "adopted": self.num_adopted, "cancelled_on_interrupt": self.num_cancelled,
                "rerun_cancelled": self.num_rerun_cancelled, "kept_cancelled": self.num_kept_cancelled,
                "submitted": self.num_submitted,
                "retried": self.num_retried, "invalid": self.num_invalid,
                "earlier_errors": self.num_earlier_errors, "statuses": dict(self.status_counts),
                "ok": self.num_ok, "failed": self.num_failed, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "recovered_tokens": self.recovered_tokens,
                "wall_s": round(self.wall_s, 3),
                "tokens_per_s": round(self.tokens_per_s, 1), "interrupted": self.is_interrupted,
                "complete": self.is_complete}


PROGRESS_LINE_INTERVAL_S = 10.0  # how often progress is written as a line where stderr is no terminal


class BulkProgress:
    """A progress bar over the work of this run; a no-op when ``enabled`` is False.

    Where the console is no terminal (stderr sent to a file or a log collector), a live bar would
    leave only its last state: the progress is written instead as a plain line every
    ``line_interval_s`` and once at the end.

    NOTE: items finished by an earlier run (skipped: in the files; recovered: results found in
    Redis) leave the bar's total instead of advancing it, and are shown as counts, so that the
    rates and the ETA measure only what this run generates.

    The ETA after the bar is the items' (as fast as items went so far); :meth:`predict` adds the one the workers'
    length predictions give (``12,345 tok left, ETA 0:02:05``), which knows long rows from short ones.
    """

    def __init__(self, total: int, *, enabled: bool, console: Console | None = None,
                 line_interval_s: float = PROGRESS_LINE_INTERVAL_S) -> None:
        self._start_s = time.monotonic()
        self._num_tokens = 0
        self._counts = {"skipped": 0, "recovered": 0, "adopted": 0}
        self._predicted = ""  # the last prediction, described
        self._progress: Progress | None = None
        self._console = console or Console(stderr=True)
        self._line_interval_s = line_interval_s
        self._next_line_s: float | None = None  # None: a live bar (a terminal), else when the next line is due
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]bulk"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[items_s]:>7.1f} items/s {task.fields[tokens_s]:>8.1f} tok/s"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[earlier]}"),
                TextColumn("{task.fields[predicted]}"), console=self._console, disable=not self._console.is_terminal,
            )
            self._task = self._progress.add_task("bulk", total=total, items_s=0.0, tokens_s=0.0, earlier="",
                                                 predicted="")
            if not self._console.is_terminal:
                self._next_line_s = self._start_s + line_interval_s

    def advance(self, num_items: int = 1, num_tokens: int = 0) -> None:
        """Items this run finished (generated, failed or invalid) and their completion tokens."""
        if self._progress is None:
            return
        self._num_tokens += num_tokens
        self._progress.advance(self._task, num_items)
        elapsed_s = max(1e-6, time.monotonic() - self._start_s)
        done = self._progress.tasks[0].completed
        self._progress.update(self._task, items_s=done / elapsed_s, tokens_s=self._num_tokens / elapsed_s)
        if self._next_line_s is not None and time.monotonic() >= self._next_line_s:
            self._write_line()

    def _write_line(self) -> None:
        """The progress as one plain line (no terminal): counts, rates, elapsed time and ETA."""
        assert self._progress is not None and self._next_line_s is not None
        task = self._progress.tasks[0]
        total, done = int(task.total or 0), int(task.completed)
        elapsed_s = time.monotonic() - self._start_s
        items_s = done / elapsed_s if elapsed_s > 0 else 0.0
        eta = f"{(total - done) / items_s:.0f} s" if items_s > 0 else "?"
        percent = 100.0 * done / total if total else 100.0
        earlier = "".join(f" {name} {n}" for name, n in self._counts.items() if n)
        self._console.print(f"bulk {done}/{total} ({percent:.1f}%) {items_s:.1f} items/s "
                            f"{self._num_tokens / max(elapsed_s, 1e-6):.1f} tok/s elapsed {elapsed_s:.0f} s "
                            f"ETA {eta}{earlier}{self._predicted and ' | ' + self._predicted}", markup=False,
                            highlight=False, soft_wrap=True)
        self._next_line_s = time.monotonic() + self._line_interval_s

    def predict(self, eta: Eta) -> None:
        """The job's predicted completion tokens left and their ETA, shown until the next prediction."""
        if self._progress is None:
            return
        self._predicted = f"predicted {eta.describe()}"
        self._progress.update(self._task, predicted=self._predicted)

    def skip(self) -> None:
        """An item already in the output or errors file."""
        self._count_earlier("skipped", leaves_total=True)

    def recover(self) -> None:
        """An item whose result an earlier run left in Redis."""
        self._count_earlier("recovered", leaves_total=True)

    def adopt(self) -> None:
        """A request an earlier run queued: still to finish here, so it stays in the total."""
        self._count_earlier("adopted", leaves_total=False)

    def _count_earlier(self, what: str, *, leaves_total: bool) -> None:
        self._counts[what] += 1
        if self._progress is None:
            return
        total = self._progress.tasks[0].total or 0
        earlier = " ".join(f"{name} {n}" for name, n in self._counts.items() if n)
        self._progress.update(self._task, total=total - 1 if leaves_total else total, earlier=earlier)

    def __enter__(self) -> BulkProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            if self._next_line_s is not None:
                self._write_line()


def render_summary(summary: BulkSummary, console: Console) -> None:
    """Print what happened to the records (done earlier, done now, failed, cancelled and run again, skipped),
    then the requests, tokens, wall time and tokens/s."""
    table = Table(title="bulk summary", show_header=False, title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("records", str(summary.num_total)),
        ("done earlier (in the output, skipped)", str(summary.num_earlier_ok)),
        ("failed earlier (in the errors file, skipped)", str(summary.num_skipped - summary.num_earlier_ok)),
        ("done now", str(summary.num_ok)),
        ("failed now", str(summary.num_failed + summary.num_invalid))]
    rows += [(f"  status {status}", str(n)) for status, n in sorted(summary.status_counts.items()) if status != "ok"]
    rows += [("  invalid records", str(summary.num_invalid)),
             ("cancelled earlier, run again", str(summary.num_rerun_cancelled)),
             ("cancelled earlier, not run again (--no-retry-cancelled)", str(summary.num_kept_cancelled)),
             ("picked up from Redis (finished while no run waited)", str(summary.num_recovered)),
             ("queued by an earlier run (waited for, not re-sent)", str(summary.num_adopted)),
             ("requests sent", str(summary.num_submitted)), ("retries", str(summary.num_retried)),
             ("cancelled on interrupt", str(summary.num_cancelled)),
             ("prompt tokens", str(summary.prompt_tokens)), ("completion tokens", str(summary.completion_tokens)),
             ("wall time", f"{summary.wall_s:.2f} s"), ("tokens/s", f"{summary.tokens_per_s:.1f}")]
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)
    console.print(f"output: {summary.output_path}  errors: {summary.errors_path}  ({describe_state(summary)})")


def describe_state(summary: BulkSummary) -> str:
    """How the job stands after this run, in words (the summary's last line)."""
    if summary.is_interrupted:
        cancelled = (f"; {summary.num_cancelled} queued requests cancelled (the re-run runs them again)"
                     if summary.num_cancelled else "")
        return f"interrupted{cancelled}; re-run the same command to finish"
    if not summary.is_complete:
        return "incomplete"
    if summary.has_errors:
        count = summary.num_in_errors_file
        return f"complete with errors: {count} record{'s' if count != 1 else ''} in the errors file"
    return "complete"
