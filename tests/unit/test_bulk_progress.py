"""The bulk progress bar counts only this run's work: items an earlier run finished (skipped from
the files, recovered from Redis) leave its total and are shown as such; requests an earlier run
queued stay in the total; the token rate counts only tokens generated for this run. The workers' predicted
tokens left and their ETA show after the counts, on a terminal and in the plain lines, and nothing shows with
progress off."""

from __future__ import annotations

import io
import re

from rich.console import Console

from tokenmill.producer.bulk.report import BulkProgress
from tokenmill.producer.eta import Eta


def test_earlier_work_is_counted_as_such_not_as_progress() -> None:
    out = io.StringIO()
    with BulkProgress(10, enabled=True, console=Console(file=out, width=200, force_terminal=False)) as progress:
        progress.skip()
        progress.skip()
        progress.recover()  # NOTE: its tokens are not passed on: they were generated before this run
        progress.adopt()
        progress.advance(1, 50)
    line = out.getvalue().strip().splitlines()[-1]
    assert " 1/7 " in line, line  # 10 records - 2 skipped - 1 recovered; the adopted one is still to finish
    assert "skipped 2 recovered 1 adopted 1" in line
    rates = re.search(r"([\d.]+) items/s +([\d.]+) tok/s", line)
    assert rates is not None, line
    items_s, tokens_s = float(rates[1]), float(rates[2])
    assert abs(tokens_s - 50 * items_s) <= 50 * 0.1, "one item, 50 new tokens: the rate counts nothing recovered"


def test_without_a_terminal_progress_is_written_as_lines_not_only_the_last_state() -> None:
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False)
    with BulkProgress(4, enabled=True, console=console, line_interval_s=0.0) as progress:
        for _ in range(4):
            progress.advance(1, 10)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4", "4/4"], lines  # + one at the end
    assert all(line.startswith("bulk ") and "ETA" in line for line in lines), "plain lines, never cut at 80 columns"
    assert "\x1b[" not in out.getvalue(), "no terminal control codes in a file"


def test_the_predicted_eta_shows_next_to_the_progress() -> None:
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False)
    with BulkProgress(4, enabled=True, console=console, line_interval_s=0.0) as progress:
        progress.advance(1, 10)
        progress.predict(Eta(2500.0, 500.0, 5.0))
        progress.advance(1, 10)
    first, second, *_ = out.getvalue().splitlines()
    assert "predicted" not in first, "no prediction yet"
    assert second.endswith(" | predicted 2,500 tok left, ETA 0:00:05"), second
    out = io.StringIO()
    terminal = Console(file=out, width=200, force_terminal=True)
    with BulkProgress(4, enabled=True, console=terminal) as progress:
        progress.predict(Eta(None, 0.0, None))
        progress.advance(1, 10)
    assert "predicted - tok left, ETA -" in out.getvalue()


def test_progress_off_shows_no_prediction() -> None:
    out = io.StringIO()
    with BulkProgress(4, enabled=False, console=Console(file=out, force_terminal=False)) as progress:
        progress.predict(Eta(2500.0, 500.0, 5.0))
        progress.advance(1, 10)
    assert out.getvalue() == ""
