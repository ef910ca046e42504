"""Helpers shared by the benchmark scripts: percentiles, peak memory, tables, JSON reports, and the long-running
helper processes (a worker, a server) they start and stop. Standard library only (the scripts import torch/redis
themselves). A benchmark's measured systems run in child processes of their own: ops/bench/children.py.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"


def fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned text table (first column left-aligned, the rest right-aligned)."""
    cells = [[str(h) for h in headers]] + [[fmt(c) if not isinstance(c, str) else c for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    print(f"\n{title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))


def machine_info() -> dict[str, Any]:
    """Where the numbers came from."""
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_json(path: str | None, report: dict[str, Any]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\nJSON report: {path}")


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a long-running helper (a worker, a server) from the repository root, output to ``log_path``."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=full_env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
