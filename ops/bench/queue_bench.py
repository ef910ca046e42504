"""Queue overhead: requests/s and added latency through Producer -> Redis Streams -> worker ->
result with the echo model (the real engine, no weights), against Celery running an equivalent echo task, on the
same Redis server in the same run.

    python ops/bench/queue_bench.py            # full run (~1-2 min)
    python ops/bench/queue_bench.py --quick    # small, for development
    python ops/bench/queue_bench.py --cluster  # one queue over 3 shards of a local Redis Cluster vs one instance

With --cluster the script starts its own servers from the redis-server binary (tests/cluster_helpers.py):
a cluster of 3 primaries (no replicas) and one plain instance, the same echo worker processes on each, in
the same run; it reports requests/s, p50 added latency and the Redis servers' CPU seconds over the
throughput phase (INFO CPU), i.e. requests per Redis core-second: where one instance saturates.

Redis: --redis-url, else REDIS_URL, else redis://127.0.0.1:6379/0. Every key this script writes
carries a unique prefix and is deleted at the end; nothing is flushed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import fmt, machine_info, percentile, print_table, spawn, stop, write_json

PROMPT = "Echo this short benchmark prompt back, please."
MAX_TOKENS = 16

# ----------------------------------------------------------------------------- Celery side
# The Celery worker imports this module (``celery -A ops.bench.queue_bench``): the app reads its broker
# and key prefix from the environment the driver sets.
try:
    from celery import Celery

    celery_app = Celery(
        "tmbench",
        broker=os.environ.get("TM_BENCH_CELERY_URL", "redis://127.0.0.1:6379/0"),
        backend=os.environ.get("TM_BENCH_CELERY_URL", "redis://127.0.0.1:6379/0"),
    )
    _celery_prefix = os.environ.get("TM_BENCH_CELERY_PREFIX", "tmbench-celery:")
    celery_app.conf.update(
        broker_transport_options={"global_keyprefix": _celery_prefix},
        result_backend_transport_options={"global_keyprefix": _celery_prefix},
        task_default_queue=os.environ.get("TM_BENCH_CELERY_QUEUE", "tmbench"),
        task_serializer="json", result_serializer="json", accept_content=["json"],
        result_expires=600, worker_hijack_root_logger=False, broker_connection_retry_on_startup=True,
    )

    @celery_app.task(name="tmbench.echo")
    def echo(prompt: str, max_tokens: int) -> dict[str, Any]:
        """What the echo model answers: the prompt's UTF-8 bytes back, max_tokens at most."""
        token_ids = list(prompt.encode())[:max_tokens]
        return {"status": "ok", "text": bytes(token_ids).decode(errors="replace"), "token_ids": token_ids,
                "finish_reason": "length" if len(token_ids) == max_tokens else "stop"}
except ImportError:  # pragma: no cover - celery is an optional extra
    celery_app = None


# ----------------------------------------------------------------------------- helpers






def _delete_prefix(client: Any, pattern: str) -> int:
    num = 0
    for key in client.scan_iter(match=pattern, count=1000):
        num += client.delete(key)
    return num


def _latency_stats(samples_s: list[float]) -> dict[str, float]:
    return {"p50_ms": 1000 * percentile(samples_s, 50), "p99_ms": 1000 * percentile(samples_s, 99),
            "mean_ms": 1000 * sum(samples_s) / len(samples_s), "num": len(samples_s)}


# ----------------------------------------------------------------------------- tokenmill side


def bench_tokenmill(url: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from tokenmill.producer.client import Producer

    prefix, queue_name = f"tmbench-{os.getpid()}-{secrets.token_hex(3)}", "bench"
    # NOTE: the echo model's steps run no forward pass, so the worker's intake (backpressure
    # high-water mark) is sized like a GPU worker's (configs/gpu.toml), not the CPU default of 32. The engine keeps
    # its defaults (64 running, speculation auto), as a deployment runs it: 128 or 256 running cost the engine 15-45%
    # more CPU per result (ops/bench/README.md, queue_bench.py, 2026-12-06).
    cmd = [sys.executable, "-m", "tokenmill.cli", "--prefix", prefix, "--queue", queue_name, "--redis-url", url,
           "worker", "--model", "echo", "--log-text", "--log-level", "WARNING", "--max-waiting", str(args.max_waiting)]
    proc = spawn(cmd, log_dir / "tokenmill-worker.log")
    producer = Producer(url, prefix=prefix, queue=queue_name)
    try:
        _wait_tokenmill_ready(producer, proc)
        requests = [{"prompt": PROMPT, "max_tokens": MAX_TOKENS} for _ in range(args.warmup)]
        list(producer.as_completed(producer.submit_many(requests), timeout=60))
        throughput = _tokenmill_throughput(producer, args.num_requests)
        drain = _tokenmill_drain(producer, args.num_requests, proc.pid)
        latencies = []
        for _ in range(args.num_latency):
            start = time.perf_counter()
            result = producer.result(producer.submit(prompt=PROMPT, max_tokens=MAX_TOKENS), timeout=30)
            latencies.append(time.perf_counter() - start)
            assert result.status == "ok", result
        return {"system": "tokenmill", "worker": "1 process: python -m tokenmill.cli worker --model echo",
                **throughput, **drain, "latency": _latency_stats(latencies)}
    finally:
        stop(proc)
        _delete_prefix(producer.client, f"{prefix}:*")
        producer.close()


def _wait_tokenmill_ready(producer: Any, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenmill worker exited with code {proc.returncode}")
        if producer.stats().get("num_live_workers", 0) >= 1:
            return
        time.sleep(0.1)
    raise RuntimeError("tokenmill worker did not start")


def _tokenmill_throughput(producer: Any, num: int) -> dict[str, Any]:
    requests = [{"prompt": PROMPT, "max_tokens": MAX_TOKENS} for _ in range(num)]
    start = time.perf_counter()
    ids = producer.submit_many(requests)
    submitted = time.perf_counter()
    results = list(producer.as_completed(ids, timeout=600))
    elapsed = time.perf_counter() - start
    num_ok = sum(r.status == "ok" for r in results)
    return {"num_requests": num, "num_ok": num_ok, "elapsed_s": elapsed, "submit_s": submitted - start,
            "requests_per_s": num / elapsed}


def _tokenmill_drain(producer: Any, num: int, worker_pid: int) -> dict[str, Any]:
    """Diagnostic: how fast the worker alone turns requests into stored results. Results are
    found by MGET polling every 10 ms instead of ``as_completed`` (one BLPOP per result).

    NOTE: also the CPU the worker process and the Redis server spent per result meanwhile: on a busy machine
    results/s move with the load, CPU per result much less (what one worker does with a core of its own).
    """
    requests = [{"prompt": PROMPT, "max_tokens": MAX_TOKENS} for _ in range(num)]
    worker_cpu_s, redis_cpu_s = _process_cpu_s(worker_pid), _redis_cpu_s([producer.client])
    start = time.perf_counter()  # as for as_completed: from the first submit to the last result
    ids = producer.submit_many(requests)
    keys = [producer.keys.result(i) for i in ids]
    remaining = keys
    while remaining:
        landed = []
        for offset in range(0, len(remaining), 1000):
            chunk = remaining[offset:offset + 1000]
            landed += [k for k, v in zip(chunk, producer.client.mget(chunk)) if v is not None]
        done = set(landed)
        remaining = [k for k in remaining if k not in done]
        if remaining:
            time.sleep(0.01)
    elapsed = time.perf_counter() - start
    worker_cpu_s = _process_cpu_s(worker_pid) - worker_cpu_s
    redis_cpu_s = _redis_cpu_s([producer.client]) - redis_cpu_s
    return {"drain_elapsed_s": elapsed, "drain_requests_per_s": num / elapsed,
            "drain_worker_cpu_us": 1e6 * worker_cpu_s / num, "drain_redis_cpu_us": 1e6 * redis_cpu_s / num}


def _process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` used so far (Linux /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- sharded (--cluster)


def _redis_cpu_s(clients: list[Any]) -> float:
    """CPU seconds (user + sys, main thread and children) the servers behind ``clients`` used so far."""
    return sum(float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
               for info in (client.info("cpu") for client in clients))


def bench_sharded(setup: str, args: argparse.Namespace, log_dir: Path, workdir: Path) -> dict[str, Any]:
    """Echo workers on one plain Redis instance (``setup = "single"``, 1 shard) or over 3 shards of a local
    cluster of 3 primaries (``"cluster"``): throughput, p50 round trip and the servers' CPU seconds."""
    from tests.cluster_helpers import start_cluster, start_server
    from tokenmill.producer.client import Producer
    from tokenmill.producer.config import ProducerConfig
    from tokenmill.protocol.config import QueueConfig, RedisConfig

    if setup == "cluster":
        cluster = start_cluster(workdir, num_primaries=3, replicas_per_primary=0)
        nodes, url, shards = cluster.nodes, cluster.url, 3
    else:
        node = start_server(workdir)
        nodes, url, shards = [node], f"redis://127.0.0.1:{node.port}", 1
    prefix = f"tmbench-{os.getpid()}-{secrets.token_hex(3)}"
    env = {"TOKENMILL_QUEUE__SHARDS": str(shards)}
    procs = [spawn([sys.executable, "-m", "tokenmill.cli", "--prefix", prefix, "--redis-url", url, "worker",
                    "--model", "echo", "--log-text", "--log-level", "WARNING", "--max-waiting",
                    str(args.max_waiting)], log_dir / f"{setup}-worker-{i}.log", env)
             for i in range(args.cluster_workers)]
    config = ProducerConfig(redis=RedisConfig(url=url), queue=QueueConfig(prefix=prefix, shards=shards))
    producer = Producer.from_config(config)
    try:
        deadline = time.monotonic() + 60
        while producer.stats()["num_live_workers"] < len(procs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"{setup}: workers did not start")
            time.sleep(0.1)
        list(producer.as_completed(producer.submit_many(
            [{"prompt": f"{PROMPT} {i}", "max_tokens": MAX_TOKENS} for i in range(args.warmup)]), timeout=60))
        cpu_before = _redis_cpu_s([n.client for n in nodes])
        start = time.perf_counter()
        ids = producer.submit_many([{"prompt": f"{PROMPT} {i}", "max_tokens": MAX_TOKENS}
                                    for i in range(args.num_requests)])
        num_ok = sum(r.status == "ok" for r in producer.as_completed(ids, timeout=600))
        elapsed = time.perf_counter() - start
        cpu_s = _redis_cpu_s([n.client for n in nodes]) - cpu_before
        latencies = []
        for i in range(args.num_latency):
            t = time.perf_counter()
            assert producer.result(producer.submit(prompt=f"{PROMPT} {i}", max_tokens=MAX_TOKENS), timeout=30).ok
            latencies.append(time.perf_counter() - t)
        return {"system": f"tokenmill_{setup}", "worker": f"{len(procs)} echo worker processes, {shards} shard(s), "
                f"{len(nodes)} redis-server(s)", "num_requests": args.num_requests, "num_ok": num_ok,
                "elapsed_s": elapsed, "requests_per_s": args.num_requests / elapsed, "redis_cpu_s": cpu_s,
                "requests_per_redis_cpu_s": args.num_requests / cpu_s if cpu_s else None,
                "latency": _latency_stats(latencies)}
    finally:
        for proc in procs:
            stop(proc)
        producer.close()
        if setup == "cluster":
            cluster.stop()
        else:
            node.client.close()
            node.process.terminate()
            node.process.wait(timeout=10)


def print_sharded_report(results: dict[str, dict[str, Any]]) -> None:
    rows = []
    for result in results.values():
        if "error" in result:
            rows.append([result["system"], "FAILED", "-", "-", "-", "-", result["error"][:60]])
            continue
        per_core = result["requests_per_redis_cpu_s"]
        rows.append([result["system"], f"{result['requests_per_s']:,.0f}",
                     f"{result['num_ok']}/{result['num_requests']}", fmt(result["latency"]["p50_ms"], 2),
                     f"{result['redis_cpu_s']:.2f}",
                     "-" if per_core is None else f"{per_core:,.0f}", result["worker"]])
    print_table("One queue on one Redis instance vs over 3 shards of a local Redis Cluster (same machine, same run)",
                ["system", "requests/s", "ok", "p50 ms", "redis cpu s", "req per redis cpu-s", "setup"], rows)


# ----------------------------------------------------------------------------- Celery side


def bench_celery(url: str, pool: str, concurrency: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    # NOTE: one tag (queue + key prefix) per driver process: the app's connection pools keep the
    # options of their first use, so every pool run shares them; workers run one after another.
    tag, env = _celery_tag(url)
    celery_bin = str(Path(sys.executable).with_name("celery"))
    cmd = [celery_bin, "-A", "ops.bench.queue_bench:celery_app", "worker", f"--pool={pool}", "--loglevel=WARNING",
           "-Q", tag, "--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"{tag}@%h"]
    if pool != "solo":
        cmd.append(f"--concurrency={concurrency}")
    proc = spawn(cmd, log_dir / f"celery-{pool}.log", env)
    try:
        echo.apply_async((PROMPT, MAX_TOKENS)).get(timeout=60)  # ready
        [r.get(timeout=60) for r in [echo.apply_async((PROMPT, MAX_TOKENS)) for _ in range(args.warmup)]]
        start = time.perf_counter()
        pending = [echo.apply_async((PROMPT, MAX_TOKENS)) for _ in range(args.num_requests)]
        submitted = time.perf_counter()
        outputs = [r.get(timeout=600) for r in pending]
        elapsed = time.perf_counter() - start
        latencies = []
        for _ in range(args.num_latency):
            t = time.perf_counter()
            echo.delay(PROMPT, MAX_TOKENS).get(timeout=30)
            latencies.append(time.perf_counter() - t)
        label = "solo pool, 1 process" if pool == "solo" else f"{pool} pool, {concurrency} processes"
        return {"system": f"celery_{pool}", "worker": label, "num_requests": args.num_requests,
                "num_ok": sum(o.get("status") == "ok" for o in outputs), "elapsed_s": elapsed,
                "submit_s": submitted - start, "requests_per_s": args.num_requests / elapsed,
                "latency": _latency_stats(latencies)}
    finally:
        stop(proc)


_CELERY_TAG: list[tuple[str, dict[str, str]]] = []


def _celery_tag(url: str) -> tuple[str, dict[str, str]]:
    if not _CELERY_TAG:
        tag = f"tmbench-celery-{os.getpid()}-{secrets.token_hex(3)}"
        env = {"TM_BENCH_CELERY_URL": url, "TM_BENCH_CELERY_PREFIX": f"{tag}:", "TM_BENCH_CELERY_QUEUE": tag}
        os.environ.update(env)  # the producer side (this process) must match the worker's
        celery_app.conf.update(broker_url=url, result_backend=url, task_default_queue=tag,
                               broker_transport_options={"global_keyprefix": f"{tag}:"},
                               result_backend_transport_options={"global_keyprefix": f"{tag}:"})
        _CELERY_TAG.append((tag, env))
    return _CELERY_TAG[0]


def cleanup_celery(url: str) -> int:
    """Delete every key of this run's Celery tag (queue, results, kombu bindings)."""
    import gc

    import redis

    if not _CELERY_TAG:
        return 0
    gc.collect()  # drop AsyncResults while the interpreter can still unsubscribe them
    tag = _CELERY_TAG[0][0]
    client = redis.Redis.from_url(url)
    num = _delete_prefix(client, f"{tag}*") + _delete_prefix(client, f"*{tag}*")
    client.close()
    return num


# ----------------------------------------------------------------------------- driver


def print_report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for result in results.values():
        if "error" in result:
            rows.append([result["system"], "FAILED", "-", "-", "-", result["error"][:60]])
            continue
        lat = result["latency"]
        rows.append([result["system"], f"{result['requests_per_s']:,.0f}",
                     f"{result['num_ok']}/{result['num_requests']}",
                     fmt(lat["p50_ms"], 2), fmt(lat["p99_ms"], 2), result["worker"]])
    print_table("Queue throughput (submit all, collect all) and light-load round trip (one at a time)",
                ["system", "requests/s", "ok", "p50 ms", "p99 ms", "worker"], rows)
    tm = results.get("tokenmill", {})
    if "drain_requests_per_s" in tm:
        print(f"\ndiagnostic: the tokenmill worker alone stores {tm['drain_requests_per_s']:,.0f} results/s "
              f"(submit_many, results found by MGET polling; as_completed above: {tm['requests_per_s']:,.0f}/s); "
              f"CPU per result: worker {tm['drain_worker_cpu_us']:.0f} us, "
              f"redis-server {tm['drain_redis_cpu_us']:.0f} us")
    celery_runs = [r for k, r in results.items() if k.startswith("celery") and "error" not in r]
    summary: dict[str, Any] = {}
    if not tm or "error" in tm or not celery_runs:
        return summary
    best = max(celery_runs, key=lambda r: r["requests_per_s"])
    checks = []
    for run in celery_runs:
        ratio = tm["requests_per_s"] / run["requests_per_s"]
        summary[f"throughput_vs_{run['system']}"] = ratio
        checks.append([f"throughput vs {run['system']}" + (" (the faster Celery)" if run is best else ""),
                       f"{ratio:.1f}x", ">= 10x", "PASS" if ratio >= 10 else "FAIL"])
        summary[f"p50_latency_vs_{run['system']}"] = tm["latency"]["p50_ms"] / run["latency"]["p50_ms"]
    p50 = tm["latency"]["p50_ms"]
    checks.append(["tokenmill p50 added latency, light load", f"{p50:.2f} ms", "< 5 ms", "PASS" if p50 < 5 else "FAIL"])
    summary["tokenmill_p50_ms"] = p50
    print_table("Targets", ["check", "measured", "target", "result"], checks)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0")
    parser.add_argument("--num-requests", type=int, default=5000, help="requests in the throughput phase")
    parser.add_argument("--num-latency", type=int, default=300, help="sequential round trips (light load)")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--max-waiting", type=int, default=256, help="tokenmill worker intake high-water mark")
    parser.add_argument("--celery-pools", default="solo,prefork",
                        help="Celery worker pools to run (solo = 1 process like the tokenmill worker; prefork "
                        "with --celery-concurrency processes)")
    parser.add_argument("--celery-concurrency", type=int, default=2)
    parser.add_argument("--systems", default="tokenmill,celery", help="comma list of tokenmill, celery")
    parser.add_argument("--log-dir", default="", help="worker logs (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="500 requests, 50 round trips")
    parser.add_argument("--json", default="", help="write the JSON report here")
    parser.add_argument("--cluster", action="store_true", help="instead: one queue over 3 shards of a local Redis "
                        "Cluster vs one plain instance (servers started here), same echo workers")
    parser.add_argument("--cluster-workers", type=int, default=3, help="echo worker processes with --cluster")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.num_latency, args.warmup = 500, 50, 20
    return args


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    if args.cluster:
        return main_sharded(args)
    systems = args.systems.split(",")
    print(f"redis {args.redis_url}; {args.num_requests} requests for throughput, {args.num_latency} sequential "
          f"round trips; prompt {len(PROMPT)} bytes, max_tokens {MAX_TOKENS}")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tm-queue-bench-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        runs: list[tuple[str, Any]] = []
        if "tokenmill" in systems:
            runs.append(("tokenmill", lambda: bench_tokenmill(args.redis_url, args, log_dir)))
        if "celery" in systems:
            if celery_app is None:
                results["celery"] = {"system": "celery", "error": "celery is not installed"}
            for pool in [p for p in args.celery_pools.split(",") if p] if celery_app is not None else []:
                runs.append((f"celery_{pool}", lambda pool=pool: bench_celery(
                    args.redis_url, pool, args.celery_concurrency, args, log_dir)))
        for name, run in runs:
            print(f"running {name} ...", flush=True)
            try:
                results[name] = run()
            except Exception as exc:  # noqa: BLE001 - report and go on to the next system
                tail = _log_tail(log_dir)
                results[name] = {"system": name, "error": f"{type(exc).__name__}: {exc}", "log_tail": tail}
                print(f"  {name} FAILED: {exc}\n{tail}")
                continue
            r = results[name]
            print(f"  {name}: {r['requests_per_s']:,.0f} req/s, p50 {r['latency']['p50_ms']:.2f} ms", flush=True)
    if celery_app is not None:
        cleanup_celery(args.redis_url)
    summary = print_report(results)
    write_json(args.json, {"benchmark": "queue", "args": vars(args), "machine": machine_info(), "results": results,
                           "summary": summary})
    return 0


def main_sharded(args: argparse.Namespace) -> int:
    import tempfile

    print(f"{args.num_requests} requests for throughput, {args.num_latency} sequential round trips; "
          f"{args.cluster_workers} echo workers; prompt ~{len(PROMPT) + 4} bytes, max_tokens {MAX_TOKENS}")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tm-queue-bench-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        for setup in ("single", "cluster"):
            print(f"running {setup} ...", flush=True)
            workdir = Path(tmp) / setup
            workdir.mkdir()
            try:
                results[setup] = bench_sharded(setup, args, log_dir, workdir)
            except Exception as exc:  # noqa: BLE001 - report and go on
                results[setup] = {"system": f"tokenmill_{setup}", "error": f"{type(exc).__name__}: {exc}",
                                  "log_tail": _log_tail(log_dir)}
                print(f"  {setup} FAILED: {exc}\n{results[setup]['log_tail']}")
    print_sharded_report(results)
    write_json(args.json, {"benchmark": "queue_cluster", "args": vars(args), "machine": machine_info(),
                           "results": results})
    return 0


def _log_tail(log_dir: Path) -> str:
    lines = []
    for path in sorted(log_dir.glob("*.log")):
        lines += [f"--- {path.name}"] + path.read_text(errors="replace").splitlines()[-10:]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
