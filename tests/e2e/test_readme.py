"""Every command and Python example of the README runs as written and gives a sensible answer,
against a real SmolLM2 worker and ``tokenmill serve`` started by the README's own commands, on a
Redis server of the test's own (so the README's default queue names are safe to use)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.one_command_helpers import served_models
from tests.processes import free_port
from tokenmill.producer import Producer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOC_PORT = "8000"  # the port the README's server examples use; the test substitutes a free one
# Commands that cannot run inside this test, by the start of the line, and why.
SKIPPED = {
    "make run": "builds a virtualenv and runs the demo (the demo has its own test)",
    "make test": "runs the whole suite, this test included",
    "make lint": "ruff over the checkout: make test runs it, so CI does",
    "make typecheck": "mypy over the package: make test runs it, so CI does",
    ".venv/bin/pytest": "runs the suite, this test included",
    "tokenmill --config configs/gpu.toml": "needs a GPU and a model under /models",
    "tokenmill dashboard": "serves until stopped; tests/e2e/test_dashboard_browser.py drives the same pages",
    "tokenmill worker --fleet-cache": "workers of a prefill / decode split run until stopped; "
                                      "tests/e2e/test_fleet_workers.py runs the same roles",
}
BACKGROUND = ("tokenmill --config configs/cpu-small.toml worker", "tokenmill serve")  # started first, kept running
SKIPPED_PYTHON = {"from celery": "needs a Celery worker process (tests/integration/test_celery.py covers it)"}
Check = Callable[[str, Path], None]


def _has(fragment: str) -> Check:
    def check(out: str, _cwd: Path) -> None:
        assert fragment in out, f"expected {fragment!r} in {out!r}"
    return check


def _words(low: int, high: int) -> Check:
    def check(out: str, _cwd: Path) -> None:
        assert low <= len(out.split()) <= high, f"expected {low}..{high} words, got {out!r}"
    return check


def _bulk_done(out: str, cwd: Path) -> None:
    lines = [json.loads(line) for line in (cwd / "completions.jsonl").read_text().splitlines()]
    assert [line["status"] for line in lines] == ["ok", "ok"] and all(line["text"] for line in lines)
    assert any("4" in line["text"] or "four" in line["text"].lower() for line in lines), lines


def _finish_lines(out: str, _cwd: Path) -> None:
    lines = out.strip().splitlines()
    assert len(lines) >= 2 and all(line.split()[0] in ("stop", "length") for line in lines if line.split()), out


def _haiku(out: str, _cwd: Path) -> None:
    assert len(out.split()) >= 6 and "Write a haiku" not in out, f"not a haiku: {out!r}"


# A fragment of each command / Python example -> what its output must show.
EXPECTED: dict[str, Check] = {
    'submit "Write a haiku about Redis"': _haiku,
    '--system "Answer in one word."': _has("Paris"),
    "--raw --max-tokens 8": _has("Paris"),
    "tokenmill status": _has("live workers: 1"),
    "tokenmill bulk": _bulk_done,
    "printf ": lambda out, cwd: None,
    "curl ": _has("Paris"),
    "Name three rivers.": _words(3, 200),
    "Engine.from_config": _finish_lines,
    "client.chat.completions.create": _has("Paris"),
    "client.batches.create": _has("completed"),
}


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)


def _commands() -> list[str]:
    lines = [line.split("  #")[0].strip() for block in _blocks("bash") for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _check(text: str, out: str, cwd: Path) -> None:
    matches = [check for fragment, check in EXPECTED.items() if fragment in text]
    assert matches, f"no expectation for README example {text[:80]!r}: add one to EXPECTED"
    matches[0](out, cwd)


@contextmanager
def _background(command: str, cwd: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(command, shell=True, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield process
    finally:  # NOTE: the whole session: the shell and the command it runs
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _wait_until(ready: Callable[[], bool], what: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"{what} did not come up"
        time.sleep(0.25)


def test_every_readme_example_runs_and_answers_sensibly(private_redis_url: str, tmp_path: Path) -> None:
    port = str(free_port())
    env = {**os.environ, "REDIS_URL": private_redis_url, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "TOKENMILL_WORKER__LOG_LEVEL": "WARNING", "NO_COLOR": "1", "COLUMNS": "200",
           # NOTE: eager decode steps: compiling them pays off in long runs, not in a test's few requests
           "TOKENMILL_ENGINE__EXECUTION__COMPILE": "off"}
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    commands = [command.replace(DOC_PORT, port) for command in _commands()]
    background = [c for c in commands if c.startswith(BACKGROUND)]
    assert len(background) == len(BACKGROUND), background
    run_first = [c for c in commands if "--burst" in c]  # an echo worker that exits at once on the empty queue
    with Producer(private_redis_url) as producer:
        for command in run_first:
            subprocess.run(command, shell=True, cwd=tmp_path, env=env, check=True, timeout=60)
        with _background(background[0], tmp_path, env), _background(background[1], tmp_path, env):
            _wait_until(lambda: any(w.get("served_model_name") == "smollm2-135m"
                                    for w in producer.stats()["workers"].values()), "the SmolLM2 worker")
            _wait_until(lambda: bool(served_models(int(port))), "tokenmill serve")
            for command in commands:
                if command in background or command in run_first or command.startswith(tuple(SKIPPED)):
                    continue
                done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=300)
                assert done.returncode == 0, f"{command}\n{done.stderr}"
                _check(command, done.stdout, tmp_path)
            for code in _blocks("python"):
                if any(marker in code for marker in SKIPPED_PYTHON):
                    continue
                done = subprocess.run([sys.executable, "-c", code.replace(DOC_PORT, port)], cwd=tmp_path, env=env,
                                      capture_output=True, text=True, timeout=300)
                assert done.returncode == 0, f"{code}\n{done.stderr}"
                _check(code, done.stdout, tmp_path)
