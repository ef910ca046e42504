"""The worker process's garbage collector: what start-up loaded frozen, young passes rarer."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pydantic
import pytest

from tokenmill.worker import runtime
from tokenmill.worker.config import Settings, WorkerConfig


def _collector_after(young_threshold: int) -> dict[str, Any]:
    """The collector's state in a fresh interpreter after ``tune_gc(young_threshold)`` (it is process-wide)."""
    code = (
        "import gc, json\n"
        "from tokenmill.worker.gc_tuning import tune_gc\n"
        "before = gc.get_threshold()\n"
        "kept = [[i] for i in range(1000)]  # alive at the freeze\n"
        f"tune_gc({young_threshold})\n"
        "print(json.dumps({'before': before, 'after': gc.get_threshold(), 'frozen': gc.get_freeze_count(),\n"
        "                  'kept_frozen': all(o is not kept for o in gc.get_objects())}))\n")  # no pass walks it
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def test_tuning_freezes_what_is_alive_and_raises_only_the_young_threshold() -> None:
    state = _collector_after(20_000)
    assert state["frozen"] > 1000 and state["kept_frozen"]
    assert state["after"] == [20_000, *state["before"][1:]]  # the older generations' ratios as Python set them


def test_zero_leaves_the_collector_as_python_sets_it() -> None:
    state = _collector_after(0)
    assert state["frozen"] == 0
    assert state["after"] == state["before"]


def test_a_tuned_process_exits_without_an_extensions_leak_report() -> None:
    """Frozen objects are given back to the collector at exit: triton's nanobind bindings (loaded by a model worker)
    count their objects then, and a frozen one made them print a "leaked" report of dozens of lines."""
    pytest.importorskip("triton")
    code = "import triton\nfrom tokenmill.worker.gc_tuning import tune_gc\ntune_gc(20_000)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "leaked" not in done.stderr, done.stderr[-2000:]


def test_the_worker_process_tunes_its_collector_once_the_engine_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[Any] = []

    class BuiltWorker:
        def __init__(self, settings: Settings, *, burst: bool = False) -> None:
            events.append("built")

        def run(self) -> int:
            events.append("run")
            return 0

    monkeypatch.setattr(runtime, "Worker", BuiltWorker)
    monkeypatch.setattr(runtime, "setup_logging", lambda *_args: None)
    monkeypatch.setattr(runtime, "tune_gc", lambda young_threshold: events.append(("tuned", young_threshold)))
    settings = Settings(worker=WorkerConfig(gc_young_threshold=5_000))
    assert runtime.run_worker(settings) == 0
    assert events == ["built", ("tuned", 5_000), "run"]


def test_a_commands_own_worker_tunes_the_commands_process_once_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --model`` and ``bulk --model`` run their worker in their own process (cli/local_worker.py)."""
    from tokenmill.cli import local_worker
    from tokenmill.worker import gc_tuning

    events: list[Any] = []

    class BuiltWorker:
        def __init__(self, settings: Settings, *, handle_signals: bool = True) -> None:
            events.append("built")

    monkeypatch.setattr(runtime, "Worker", BuiltWorker)
    monkeypatch.setattr(gc_tuning, "tune_gc", lambda young_threshold: events.append(("tuned", young_threshold)))
    local_worker.LocalWorker(Settings(worker=WorkerConfig(gc_young_threshold=0)), on_failure=lambda: None)
    assert events == ["built", ("tuned", 0)]


def test_a_negative_threshold_is_refused_with_the_settings_name() -> None:
    with pytest.raises(pydantic.ValidationError, match="gc_young_threshold"):
        WorkerConfig(gc_young_threshold=-1)
