"""Bulk throughput: `tokenmill bulk` end to end (JSONL -> Producer -> Redis -> worker -> JSONL)
against the same engine run offline, on the throughput workload, in one run.

    python ops/bench/bulk.py                 # 64 requests, SmolLM2, float32, 2 threads
    python ops/bench/bulk.py --quick         # 16 short requests, for development
    python ops/bench/bulk.py --copy-heavy    # a copy-heavy job: speculative decoding off vs on, end to end

The offline engine is measured before and after the bulk run (the machine is noisy) and the
bulk run is compared against their mean. Target: bulk >= 0.9x offline tokens/s.

``--copy-heavy``: a JSONL job of spec.py's copy-heavy tasks (repeat, rewrite, json, rename, spelling;
natural EOS) through the queue with the worker's ``[engine.speculative] method`` off, auto, then off
again; auto is compared against the mean of both off runs, and the answers' texts against each other.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
REPO_ROOT = _HERE.parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(REPO_ROOT))

from ops.bench.common import fmt, machine_info, print_table, write_json
from ops.bench.workload import SYSTEM_PROMPT, WorkItem, build_workload, describe


def engine_config(args: argparse.Namespace, method: str = "auto") -> dict[str, dict[str, Any]]:
    """The engine's sections (``EngineConfig``), shared by the offline run and the worker."""
    return {"model": {"name": args.model, "device": "cpu", "dtype": "float32", "num_threads": args.threads},
            "cache": {"kv_cache_memory": args.kv_cache_memory},
            "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
            "speculative": {"method": method}}


def run_offline(items: list[WorkItem], config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Engine.generate over the workload's token ids; returns tokens/s and wall time."""
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.protocol.sampling import SamplingParams

    engine = Engine.from_config(EngineConfig.model_validate(config))
    params = [SamplingParams(max_tokens=item.max_tokens, ignore_eos=True) for item in items]
    start = time.perf_counter()
    outputs = engine.generate([item.prompt_token_ids for item in items], params, progress=False)
    wall_s = time.perf_counter() - start
    num_tokens = sum(len(out.token_ids) for out in outputs)
    del engine
    gc.collect()
    return {"wall_s": wall_s, "output_tokens": num_tokens, "tokens_per_s": num_tokens / wall_s}


def workload_rows(items: list[WorkItem]) -> list[dict[str, Any]]:
    """Plain bulk JSONL rows: chat messages (the worker applies the same template) and exact lengths."""
    return [{"id": f"item-{item.index}", "max_tokens": item.max_tokens, "ignore_eos": True,
             "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": item.text}]}
            for item in items]


def copy_heavy_rows(tokenizer: Any, num: int, seed: int) -> list[dict[str, Any]]:
    """Rows of spec.py's copy-heavy tasks in turn, each text its own, ending at EOS (256 tokens at most)."""
    from ops.bench.spec import COPY_TASKS, task_requests

    per_task = -(-num // len(COPY_TASKS))
    by_task = [task_requests(task, tokenizer, per_task, seed, 256, False) for task in COPY_TASKS]
    mixed = [requests[i] for i in range(per_task) for requests in by_task][:num]
    return [{"id": f"copy-{i}", "max_tokens": r["max_tokens"],
             "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["text"]}]}
            for i, r in enumerate(mixed)]


def start_worker(args: argparse.Namespace, redis_url: str, prefix: str, queue: str,
                 method: str = "auto") -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.update({f"TOKENMILL_ENGINE__{section.upper()}__{key.upper()}": str(value)
                for section, values in engine_config(args, method).items() for key, value in values.items()})
    env["TOKENMILL_WORKER__MAX_WAITING"] = str(args.max_num_seqs)
    cmd = [sys.executable, "-m", "tokenmill.cli", "--redis-url", redis_url, "--prefix", prefix, "--queue", queue,
           "worker", "--log-json"]
    return subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_worker(producer: Any, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if producer.stats()["num_live_workers"] >= 1:
            return
        time.sleep(0.5)
    raise RuntimeError("the worker did not start (no heartbeat)")


def run_bulk(rows: list[dict[str, Any]], args: argparse.Namespace, redis_url: str,
             method: str = "auto") -> dict[str, Any]:
    """Start a worker, wait until it heartbeats (model loaded), then time the bulk job."""
    from tokenmill.producer import Producer, bulk

    prefix, queue = f"bench-{uuid.uuid4().hex[:8]}", "bulk"
    worker = start_worker(args, redis_url, prefix, queue, method)
    workdir = Path(tempfile.mkdtemp(prefix="tm-bulk-"))
    try:
        with Producer(redis_url, prefix=prefix, queue=queue) as client:
            wait_for_worker(client)
            (workdir / "input.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            start = time.perf_counter()
            summary = bulk.run(workdir / "input.jsonl", workdir / "output.jsonl", producer=client,
                                        max_in_flight=args.max_in_flight, priority="low")
            wall_s = time.perf_counter() - start
            for key in client.client.scan_iter(match=f"{prefix}:*", count=1000):
                client.client.delete(key)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    lines = [json.loads(line) for line in (workdir / "output.jsonl").read_text().splitlines()]
    num_tokens = sum(line["usage"]["completion_tokens"] for line in lines if line["status"] == "ok")
    return {"wall_s": wall_s, "output_tokens": num_tokens, "tokens_per_s": num_tokens / wall_s,
            "num_ok": sum(1 for line in lines if line["status"] == "ok"), "summary": str(summary),
            "texts": {line["id"]: line.get("text") for line in lines}}


def compare_speculation(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The copy-heavy job through the queue: speculation off, auto, off; auto against the mean of the offs."""
    runs = [(method, run_bulk(rows, args, args.redis_url, method)) for method in ("off", "auto", "off")]
    off_tps = (runs[0][1]["tokens_per_s"] + runs[2][1]["tokens_per_s"]) / 2
    on = runs[1][1]
    table = [[f"bulk, speculative {method}", fmt(run["output_tokens"], 0), fmt(run["wall_s"]),
              fmt(run["tokens_per_s"]), f"{run['tokens_per_s'] / off_tps:.2f}x", f"{run['num_ok']}/{len(rows)}"]
             for method, run in runs]
    print_table("copy-heavy bulk job end to end: speculative decoding on vs off (ratio against the mean of the offs)",
                ["system", "output tokens", "wall s", "tokens/s", "vs off", "ok"], table)
    same = sum(1 for key, text in on["texts"].items() if text == runs[0][1]["texts"].get(key))
    print(f"same text as spec off: {same}/{len(rows)}  result: {on['tokens_per_s'] / off_tps:.2f}x")
    write_json(args.json, {"machine": machine_info(), "rows": len(rows), "same_text": same,
                           "runs": [{"method": m, **{k: v for k, v in r.items() if k != "texts"}} for m, r in runs],
                           "ratio": on["tokens_per_s"] / off_tps})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-in-flight", type=int, default=256)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--quick", action="store_true", help="16 requests of at most 64 tokens")
    parser.add_argument("--copy-heavy", action="store_true",
                        help="a copy-heavy job (spec.py's tasks): speculative decoding off vs on through the queue")
    parser.add_argument("--json", default="", help="write the JSON report here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from ops.bench.throughput import resolve_model_dir

    path = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.copy_heavy:
        compare_speculation(copy_heavy_rows(tokenizer, 16 if args.quick else args.num_requests, args.seed), args)
        return
    num, max_out = (16, 64) if args.quick else (args.num_requests, 512)
    items = build_workload(tokenizer, num_requests=num, seed=args.seed, max_output_tokens=max_out,
                           mean_output_tokens=40.0 if args.quick else 100.0)
    print("workload:", json.dumps(describe(items)))

    config = engine_config(args)
    before = run_offline(items, config)
    bulk = run_bulk(workload_rows(items), args, args.redis_url)
    after = run_offline(items, config)
    offline_tps = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    rows = [
        ["engine offline (before)", fmt(before["output_tokens"], 0), fmt(before["wall_s"]),
         fmt(before["tokens_per_s"]), ""],
        ["tokenmill bulk (end to end)", fmt(bulk["output_tokens"], 0), fmt(bulk["wall_s"]), fmt(bulk["tokens_per_s"]),
         f"{bulk['tokens_per_s'] / offline_tps:.2f}x"],
        ["engine offline (after)", fmt(after["output_tokens"], 0), fmt(after["wall_s"]),
         fmt(after["tokens_per_s"]), ""],
    ]
    print_table("bulk vs offline engine (ratio against the mean of both offline runs)",
                ["system", "output tokens", "wall s", "tokens/s", "vs offline"], rows)
    print(f"bulk items ok: {bulk['num_ok']}/{len(items)}  target: >= 0.90x  "
          f"result: {bulk['tokens_per_s'] / offline_tps:.2f}x")
    bulk = {key: value for key, value in bulk.items() if key != "texts"}
    write_json(args.json, {"machine": machine_info(), "workload": describe(items), "offline_before": before,
                           "bulk": bulk, "offline_after": after, "ratio": bulk["tokens_per_s"] / offline_tps})


if __name__ == "__main__":
    main()
