"""Where a worker's Python goes per result, counted rather than timed: the Python opcodes each of its threads
runs per stored result of 16-token echo requests (the real engine, no weights), by thread and by function.

    python ops/bench/worker_opcodes.py                  # 2,000 traced requests, top 40 functions
    python ops/bench/worker_opcodes.py --requests 4000 --top 80 --json out.json

The worker runs as ``queue_bench.py`` runs it (``python -m tokenmill.cli worker --model echo``), under a
``sys.settrace`` opcode counter in every thread, switched on for the traced requests only (SIGUSR1). The count is
the same on any machine and whatever else it is doing, where this machine's timings of one tree move by up to
1.7x between runs: it says whether a change removed work, a timing run (``queue_bench.py``) what the work costs.

NOTE: what runs in C is not counted (pydantic's validation, msgpack, hiredis, the sockets): the opcodes are the
interpreted share of a result's cost. Work done every so often rather than per request (the engine's stats, the
cancellation poll, reclaims and pending checks, heartbeats) runs far more often per result under the tracer, which
slows the worker ten- to twentyfold: it is counted apart, as ``periodic``, and left out of the per-result figures.

Redis: --redis-url, else REDIS_URL, else redis://127.0.0.1:6379/0. Every key this script writes carries a unique
prefix and is deleted at the end; nothing is flushed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

PROMPT = "Echo this short benchmark prompt back, please."
MAX_TOKENS = 16
# Functions whose calls (and everything they call) are periodic work, by qualified name.
PERIODIC = frozenset({"Engine.stats", "WorkerMetrics.observe_engine", "CancelMarks.poll", "Reader._take_reclaimed",
                      "Reader._take_back_lost", "Writer.beat", "Writer._trim", "RateCounter.flush",
                      "ThroughputLog.report_if_due"})
_OUT_ENV = "TM_WORKER_OPCODES_OUT"


# ----------------------------------------------------------------------------- the traced worker (a child process)


def run_traced_worker(worker_argv: list[str]) -> None:
    """Run ``python -m tokenmill.cli <worker_argv>`` with every thread traced; SIGUSR1 starts counting, and a second
    SIGUSR1 stops it and writes the counts (JSON) to the file ``$TM_WORKER_OPCODES_OUT`` names."""
    import runpy

    is_on = False
    # NOTE: keyed by thread id and code object (no name is made per opcode: the tracer's own cost would be counted
    # in the run's pace); named when written
    counts: collections.Counter[tuple[int, str, CodeType]] = collections.Counter()
    get_ident = threading.get_ident

    def count_in(bucket: str) -> Any:
        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                counts[(get_ident(), bucket, frame.f_code)] += 1
            return local
        return local

    per_result, periodic = count_in("per_result"), count_in("periodic")

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        if not is_on:
            return None
        frame.f_trace_opcodes = True
        parent = frame.f_back
        if frame.f_code.co_qualname in PERIODIC or (parent is not None and parent.f_trace is periodic):
            return periodic
        return per_result

    def toggle(signum: int, frame: FrameType | None) -> None:
        nonlocal is_on
        if not is_on:
            counts.clear()
            is_on = True
            return
        is_on = False
        names = {thread.ident: _thread_group(thread.name) for thread in threading.enumerate()}
        named: collections.Counter[tuple[str, str, str]] = collections.Counter()
        for (ident, bucket, code), num in list(counts.items()):
            named[(names.get(ident, "ended"), bucket, f"{_short_path(code.co_filename)}:{code.co_qualname}")] += num
        Path(os.environ[_OUT_ENV]).write_text(json.dumps([[*key, num] for key, num in named.items()]))

    signal.signal(signal.SIGUSR1, toggle)
    threading.settrace(on_call)
    sys.settrace(on_call)
    sys.argv = ["tokenmill", *worker_argv]
    runpy.run_module("tokenmill.cli", run_name="__main__", alter_sys=True)


def _thread_group(name: str) -> str:
    """A thread's name without its pool index (``tm-prepare_0`` -> ``tm-prepare``)."""
    return name.rstrip("0123456789").rstrip("_-") or name


def _short_path(filename: str) -> str:
    """A code object's file as a short name: within the repository or site-packages when it is there."""
    for marker in ("site-packages/", f"{_HERE.parents[1].name}/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return Path(filename).name


# ----------------------------------------------------------------------------- the driver


def measure(url: str, num_requests: int, speculation: str, log_dir: Path) -> dict[str, Any]:
    """Trace a worker over ``num_requests`` requests; the counts per result (JSON-able)."""
    from ops.bench.common import spawn, stop
    from tokenmill.producer.client import Producer

    prefix = f"tmops-{os.getpid()}-{secrets.token_hex(3)}"
    out_path = log_dir / "opcodes.json"
    worker_argv = ["--prefix", prefix, "--queue", "bench", "--redis-url", url, "worker", "--model", "echo",
                   "--log-text", "--log-level", "WARNING", "--max-waiting", "256"]
    proc = spawn([sys.executable, str(Path(__file__).resolve()), "--traced-worker", *worker_argv],
                 log_dir / "worker.log",
                 {_OUT_ENV: str(out_path), "TOKENMILL_ENGINE__SPECULATIVE__METHOD": speculation})
    producer = Producer(url, prefix=prefix, queue="bench")
    try:
        deadline = time.monotonic() + 120
        while producer.stats().get("num_live_workers", 0) < 1:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the traced worker did not start (log: {log_dir / 'worker.log'})")
            time.sleep(0.1)
        requests = [{"prompt": PROMPT, "max_tokens": MAX_TOKENS}] * num_requests
        _run(producer, requests[:200])  # warm: every path taken once before counting
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.2)
        statuses = _run(producer, requests)
        time.sleep(0.5)  # the writer's last acks
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not out_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        rows = json.loads(out_path.read_text())
    finally:
        stop(proc)
        for key in producer.client.scan_iter(match=f"{prefix}:*", count=1000):
            producer.client.delete(key)
        producer.close()
    if statuses != {"ok": num_requests}:
        raise RuntimeError(f"results were not all ok: {statuses}")
    return summarize(rows, num_requests, speculation)


def _run(producer: Any, requests: list[dict[str, Any]]) -> dict[str, int]:
    """Submit ``requests`` and wait for every result (MGET polling); their statuses counted."""
    from tokenmill.protocol.schema import decode_result

    keys = [producer.keys.result(request_id) for request_id in producer.submit_many(requests)]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        values = [v for offset in range(0, len(keys), 1000) for v in producer.client.mget(keys[offset:offset + 1000])]
        if all(v is not None for v in values):
            return dict(collections.Counter(decode_result(v).status for v in values))
        time.sleep(0.05)
    raise RuntimeError("results did not come within 600 s")


def summarize(rows: list[list[Any]], num_results: int, speculation: str) -> dict[str, Any]:
    """Opcodes per result by thread (per-result work and periodic apart) and by function (per-result work)."""
    threads: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"per_result": 0.0, "periodic": 0.0})
    functions: collections.Counter[tuple[str, str]] = collections.Counter()
    for thread, bucket, function, num in rows:
        threads[thread][bucket] += num / num_results
        if bucket == "per_result":
            functions[(thread, function)] += num / num_results
    return {"num_results": num_results, "speculation": speculation,
            "per_result": sum(t["per_result"] for t in threads.values()),
            "threads": dict(sorted(threads.items(), key=lambda item: -item[1]["per_result"])),
            "functions": [[thread, function, num] for (thread, function), num in functions.most_common()]}


def print_report(summary: dict[str, Any], top: int) -> None:
    from ops.bench.common import print_table

    print_table(f"Python opcodes per stored result ({summary['num_results']:,} 16-token echo requests, speculation "
                f"{summary['speculation']}; periodic work apart, not per result)",
                ["thread", "per result", "periodic (per result, inflated by the tracer)"],
                [[thread, f"{counts['per_result']:,.0f}", f"{counts['periodic']:,.0f}"]
                 for thread, counts in summary["threads"].items()]
                + [["all", f"{summary['per_result']:,.0f}", ""]])
    print_table(f"Top {top} functions (own opcodes per result)", ["thread", "function", "opcodes"],
                [[thread, function, f"{num:,.1f}"] for thread, function, num in summary["functions"][:top]])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--traced-worker"]:
        run_traced_worker(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0")
    parser.add_argument("--requests", type=int, default=2000, help="traced requests")
    parser.add_argument("--top", type=int, default=40, help="functions listed")
    parser.add_argument("--speculation", choices=("auto", "off"), default="auto",
                        help="the engine's speculative method (auto: the default; its draft sizing reads measured "
                        "step times, which the tracer slows: off counts the same whatever the machine)")
    parser.add_argument("--json", default="", help="write the counts here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tm-worker-opcodes-") as log_dir:
        summary = measure(args.redis_url, args.requests, args.speculation, Path(log_dir))
    print_report(summary, args.top)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
