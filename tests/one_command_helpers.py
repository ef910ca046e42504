"""``tokenmill serve --model`` and ``tokenmill bulk --model`` as a fresh clone's user runs them: the CLI as a process
of its own, no Redis configured (the embedded one, in the private data dir of the ``redis_dir`` fixture,
tests/conftest.py), no settings from this machine's environment; the process stopped even when the test fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.processes import scaled_s

ROOT = Path(__file__).resolve().parents[1]


def fresh_env(redis_dir: Path, **extra: str) -> dict[str, str]:
    """This environment without a Redis URL, a settings file or any ``TOKENMILL_<SECTION>__<KEY>`` setting; the
    embedded Redis in ``redis_dir`` (the default, ``$TOKENMILL_HOME/redis``, is the user's)."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("REDIS_URL", "TOKENMILL_CONFIG") and not (name.startswith("TOKENMILL_") and "__" in name)}
    return {**env, "TOKENMILL_REDIS__EMBEDDED_DIR": str(redis_dir), "NO_COLOR": "1", "COLUMNS": "200", **extra}


@contextmanager
def cli(args: list[str], env: dict[str, str], logs: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m tokenmill.cli ARGS``, its output in ``logs`` (``.stdout``, ``.stderr``); SIGTERM (then SIGKILL)
    at the end if it still runs."""
    with logs.with_suffix(".stdout").open("wb") as out, logs.with_suffix(".stderr").open("wb") as err:
        process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", *args], cwd=ROOT, env=env, stdout=out,
                                   stderr=err)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=scaled_s(30))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def output(logs: Path) -> tuple[str, str]:
    """What the command of ``logs`` wrote: (stdout, stderr)."""
    return logs.with_suffix(".stdout").read_text(), logs.with_suffix(".stderr").read_text()


def served_models(port: int) -> list[str]:
    """The ids ``/v1/models`` lists (none while the port is closed)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
            return [model["id"] for model in json.loads(response.read())["data"]]
    except OSError:
        return []


def wait_serving(process: subprocess.Popen[bytes], port: int, model: str, timeout_s: float, logs: Path) -> float:
    """Seconds until ``/v1/models`` lists ``model`` (the command fails the test if it exits first)."""
    start_s = time.monotonic()
    deadline = start_s + scaled_s(timeout_s)
    while model not in served_models(port):
        assert process.poll() is None, f"the command exited {process.returncode}:\n{output(logs)[1]}"
        assert time.monotonic() < deadline, f"{model} not served in {timeout_s} s:\n{output(logs)[1]}"
        time.sleep(0.1)
    return time.monotonic() - start_s
