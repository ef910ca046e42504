"""Child processes and waits of the test suite: waits that scale with the machine's load, and the children a
test leaves running found and stopped (tests/conftest.py runs :func:`stop_children_started_since` after each).

A fixed start-up limit fails on a loaded 2-core machine (a second suite beside this one doubles every start),
and a failed test used to leave its worker processes running after pytest exited (46 minutes, once). Standard
library only.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

TERM_GRACE_S = 5.0


def scaled_s(seconds: float) -> float:
    """``seconds`` scaled by the machine's load: x1 on an idle machine, more when the run queue is longer than
    the cores (a second suite beside this one), times ``TOKENMILL_TEST_TIMEOUT_SCALE`` (default 1)."""
    load_per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * max(1.0, load_per_core) * float(os.environ.get("TOKENMILL_TEST_TIMEOUT_SCALE", "1"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a Redis, metrics or HTTP server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def child_pids() -> set[int]:
    """The live (not zombie) children of this process."""
    me = os.getpid()
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # NOTE: it ended while listed
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            children.add(int(stat.parent.name))
    return children


def multiprocessing_children() -> set[int]:
    """The children multiprocessing started (``spawn``'s command line runs ``multiprocessing.spawn``, or the
    resource tracker): they belong to objects, not to the test that happened to start them."""
    found = set()
    for pid in child_pids():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing" in command:
            found.add(pid)
    return found


def stop_children_started_since(before: set[int]) -> list[int]:
    """Stop this process's children that are not in ``before``: SIGTERM, then SIGKILL after a grace period.
    Returns the pids it had to stop."""
    leftover = sorted(child_pids() - before)
    for pid in leftover:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline and child_pids() & set(leftover):
        time.sleep(0.05)
    for pid in child_pids() & set(leftover):
        _signal(pid, signal.SIGKILL)
    for pid in leftover:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # NOTE: reaped by its Popen already
            pass
    return leftover


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
