"""The suite's own guard: children a test leaves running are found and stopped (tests/processes.py), even one
that ignores SIGTERM; waits scale with the machine's load."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.processes import child_pids, scaled_s, stop_children_started_since


def test_children_left_running_are_stopped_even_when_they_ignore_sigterm() -> None:
    before = child_pids()
    polite = subprocess.Popen(["sleep", "60"])
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                                stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout is not None and stubborn.stdout.readline() == "ready\n"
    assert {polite.pid, stubborn.pid} <= child_pids()
    stopped = stop_children_started_since(before)
    assert sorted(stopped) == sorted([polite.pid, stubborn.pid])
    assert not child_pids() - before
    assert polite.poll() is not None and stubborn.poll() is not None


def test_waits_scale_with_load(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert scaled_s(10) == 10
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cores, 0.0, 0.0))
    assert scaled_s(10) == pytest.approx(30)
    monkeypatch.setenv("TOKENMILL_TEST_TIMEOUT_SCALE", "2")
    assert scaled_s(10) == pytest.approx(60)
