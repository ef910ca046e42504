"""The fleet cache and the prefill / decode pools, measured through real workers on one Redis (SmolLM2, CPU).

    python ops/bench/fleet.py                  # both parts, ~10 minutes on 2 cores
    python ops/bench/fleet.py --part cache     # fleet cache vs local prefix caching only
    python ops/bench/fleet.py --part split     # 1 prefill + 1 decode worker vs 2 `both` workers

Part ``cache`` (each mode on a fresh key prefix, local = ``[engine.fleet_cache] enabled = false``):
  1. worker A starts and answers 2 warm-up requests (it computes the ~1,000-token shared prefix);
  2. worker B starts cold; 64 requests sharing the prefix go to both, ``--in-flight`` at a time, so they spread
     over the two workers; per request: TTFT, the worker that answered, and (per worker) the prompt tokens it
     computed and the KV bytes it fetched / published;
  3. both stop; worker C starts cold (a restarted worker) and answers one request alone.
  Targets: B's first requests' TTFT and C's >= 5x lower with the fleet cache.

Part ``split``: 32 requests of unique ~1,000-token prompts and 16 output tokens (long prompt, short output), all
at once, through 2 ``both`` workers (fleet cache off), 1 prefill + 1 decode worker, and 2 ``both`` workers with the
fleet cache on (every prompt published, none shared: the cache's cost where it cannot help): makespan, output
tokens/s, TTFT p50; and the hand-off's cost: one request alone through each setup (median of 3), TTFT split - both.

Each worker computes on one thread (two workers share the two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
REPO_ROOT = _HERE.parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(REPO_ROOT))

from ops.bench.common import fmt, machine_info, percentile, print_table, spawn, stop, write_json

QUESTIONS = ["What does the guide say about retries?", "Summarize the section on priorities.",
             "Which setting bounds memory?", "How are results delivered?", "What happens on shutdown?",
             "Name two metrics an operator watches.", "What is a lane?", "How does a worker find dead peers?"]
PARAGRAPH = ("Section {i}. Workers read requests from Redis streams in priority lanes, run them on a continuous-"
             "batching engine with a paged KV cache, and write each result back exactly once. A request that "
             "fails is answered with an error that says why; one that kills its worker is run alone by the next "
             "reclaimer and dead-lettered after too many deliveries. Operators watch lane depth, token rates and "
             "the predicted backlog, and scale the fleet on them. ")
COUNTERS = ("tokenmill_prefix_query_tokens_total", "tokenmill_prefix_hit_tokens_total",
            "tokenmill_fleet_cache_fetched_bytes_total", "tokenmill_fleet_cache_published_bytes_total",
            "tokenmill_fleet_cache_hit_blocks_total", "tokenmill_fleet_cache_fallback_blocks_total",
            "tokenmill_fleet_cache_handoffs_total", "tokenmill_fleet_cache_handoff_recomputed_blocks_total")


def shared_prefix(tokenizer: Any, num_tokens: int) -> str:
    """Deterministic operator-guide text of about ``num_tokens`` tokens."""
    text, i = "", 0
    while len(tokenizer(text)["input_ids"]) < num_tokens:
        text += PARAGRAPH.format(i=i)
        i += 1
    return text


def unique_prompt(tokenizer: Any, index: int, num_tokens: int) -> str:
    """A ~``num_tokens``-token document no other request shares (numbers woven through every sentence)."""
    words = [f"item{index}-{j}" for j in range(num_tokens)]
    text = ""
    for start in range(0, len(words), 12):
        text += " ".join(words[start:start + 12]) + ". "
        if len(tokenizer(text)["input_ids"]) >= num_tokens:
            break
    return "Count the items in this list: " + text


class Fleet:
    """Worker processes of one run, on one key prefix, each with a metrics endpoint."""

    def __init__(self, args: argparse.Namespace, redis_url: str) -> None:
        self.args, self.redis_url = args, redis_url
        self.prefix = f"bench-fleet-{uuid.uuid4().hex[:8]}"
        self.logs = Path(tempfile.mkdtemp(prefix="tm-fleet-"))
        self.workers: dict[str, tuple[Any, int]] = {}

    def start(self, name: str, *, fleet_cache: bool, role: str = "both") -> None:
        port = _free_port()
        env = {"TOKENMILL_ENGINE__MODEL__DTYPE": self.args.dtype, "TOKENMILL_ENGINE__MODEL__DEVICE": "cpu",
               "TOKENMILL_ENGINE__MODEL__NUM_THREADS": "1", "TOKENMILL_ENGINE__CACHE__KV_CACHE_MEMORY": "3GiB",
               "TOKENMILL_ENGINE__FLEET_CACHE__MAX_BYTES": self.args.store_bytes,
               "TOKENMILL_ENGINE__FLEET_CACHE__TTL_S": "900",
               "TOKENMILL_WORKER__MAX_WAITING": str(self.args.max_waiting)}
        cmd = [sys.executable, "-m", "tokenmill.cli", "--redis-url", self.redis_url, "--prefix", self.prefix,
               "worker", "--model", self.args.model, "--name", name, "--metrics-port", str(port),
               "--role", role, "--fleet-cache" if fleet_cache else "--no-fleet-cache", "--log-json"]
        self.workers[name] = (spawn(cmd, self.logs / f"{name}.log", env), port)

    def wait_live(self, producer: Any, count: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while producer.stats()["num_live_workers"] < count:
            for name, (proc, _) in self.workers.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"worker {name} exited: see {self.logs / (name + '.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not start")
            time.sleep(0.3)

    def counters(self, name: str) -> dict[str, float]:
        port = self.workers[name][1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        values = {}
        for line in text.splitlines():
            metric, _, value = line.partition(" ")
            if metric in COUNTERS:
                values[metric] = float(value)
        return values

    def stop(self, name: str) -> None:
        stop(self.workers.pop(name)[0], timeout_s=60)

    def close(self, client: Any) -> None:
        for name in list(self.workers):
            self.stop(name)
        for key in client.scan_iter(match=f"{self.prefix}:*", count=1000):
            client.delete(key)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _computed(counters: dict[str, float]) -> float:
    return counters.get("tokenmill_prefix_query_tokens_total", 0) - counters.get("tokenmill_prefix_hit_tokens_total", 0)


def _submit_closed_loop(producer: Any, requests: list[dict[str, Any]], in_flight: int) -> list[Any]:
    """Submit with ``in_flight`` outstanding at most; results in submission order."""
    ids: list[str] = []
    results: dict[str, Any] = {}
    pending: list[str] = []
    for request in requests:
        while len(pending) >= in_flight:
            done = producer.result(pending.pop(0), timeout=600)
            results[done.id] = done
        rid = producer.submit(**request)
        ids.append(rid)
        pending.append(rid)
    for rid in pending:
        results[rid] = producer.result(rid, timeout=600)
    return [results[rid] for rid in ids]


def run_cache_mode(args: argparse.Namespace, prefix_text: str, is_fleet: bool) -> dict[str, Any]:
    from tokenmill.producer import Producer

    fleet = Fleet(args, args.redis_url)
    def request(i: int) -> dict[str, Any]:
        return {"messages": [{"role": "system", "content": prefix_text},
                             {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}],
                "max_tokens": args.max_tokens, "ignore_eos": True}

    with Producer(args.redis_url, prefix=fleet.prefix) as producer:
        try:
            fleet.start("A", fleet_cache=is_fleet)
            fleet.wait_live(producer, 1)
            warm = _submit_closed_loop(producer, [request(1000 + i) for i in range(2)], 1)
            time.sleep(1.0)  # NOTE: the warm-up's blocks are published off the engine thread
            fleet.start("B", fleet_cache=is_fleet)
            fleet.wait_live(producer, 2)
            before = {name: fleet.counters(name) for name in ("A", "B")}
            started = time.perf_counter()
            results = _submit_closed_loop(producer, [request(i) for i in range(args.num_requests)], args.in_flight)
            wall_s = time.perf_counter() - started
            after = {name: fleet.counters(name) for name in ("A", "B")}
            fleet.stop("A")
            fleet.stop("B")
            fleet.start("C", fleet_cache=is_fleet)
            fleet.wait_live(producer, 1)
            restarted = _submit_closed_loop(producer, [request(5000)], 1)[0]
            after_c = fleet.counters("C")
        finally:
            fleet.close(producer.client)
    assert all(r.status == "ok" for r in [*warm, *results, restarted]), [r.error for r in results if r.error]
    by_worker = {"A": [r for r in results if r.worker == "A"], "B": [r for r in results if r.worker == "B"]}
    computed = {name: _computed(after[name]) - _computed(before[name]) for name in after}
    fetched = sum(after[n].get("tokenmill_fleet_cache_fetched_bytes_total", 0)
                  - before[n].get("tokenmill_fleet_cache_fetched_bytes_total", 0) for n in after)
    published = sum(after[n].get("tokenmill_fleet_cache_published_bytes_total", 0)
                    - before[n].get("tokenmill_fleet_cache_published_bytes_total", 0) for n in after)
    first_b = [r.timings.ttft for r in by_worker["B"][:args.first]]
    return {
        "mode": "fleet" if is_fleet else "local", "wall_s": wall_s,
        "ttft_p50_s": percentile([r.timings.ttft for r in results], 50),
        "ttft_p90_s": percentile([r.timings.ttft for r in results], 90),
        "b_first_ttft_s": first_b[0], "b_first_ttfts_s": first_b, "b_first_ttft_mean_s": statistics.mean(first_b),
        "num_by_worker": {name: len(rs) for name, rs in by_worker.items()},
        "prompt_tokens_per_request": sum(r.usage.prompt_tokens for r in results) / len(results),
        "computed_prompt_tokens_per_request": sum(computed.values()) / len(results),
        "fetched_bytes_per_request": fetched / len(results), "published_bytes_per_request": published / len(results),
        "restart_ttft_s": restarted.timings.ttft, "restart_computed_tokens": _computed(after_c),
        "restart_fetched_bytes": after_c.get("tokenmill_fleet_cache_fetched_bytes_total", 0),
        "texts": [r.text for r in results],
    }


def part_cache(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    prefix_text = shared_prefix(tokenizer, args.prefix_tokens)
    modes = [run_cache_mode(args, prefix_text, is_fleet) for is_fleet in (False, True)]
    local, fleet = modes
    same = sum(a == b for a, b in zip(local["texts"], fleet["texts"]))
    rows = [[m["mode"], fmt(m["b_first_ttft_s"], 3), fmt(m["b_first_ttft_mean_s"], 3), fmt(m["ttft_p50_s"], 3),
             fmt(m["ttft_p90_s"], 3),
             fmt(m["restart_ttft_s"], 3), fmt(m["computed_prompt_tokens_per_request"], 0),
             fmt(m["fetched_bytes_per_request"] / 2**20, 2), fmt(m["published_bytes_per_request"] / 2**20, 2),
             f"{m['num_by_worker']['A']}/{m['num_by_worker']['B']}"] for m in modes]
    print_table(f"fleet cache vs local prefix caching: {args.num_requests} requests sharing a "
                f"{args.prefix_tokens}-token prefix, {args.in_flight} in flight, over 2 workers",
                ["mode", "B's first TTFT s", f"B's first {args.first} TTFT mean s", "TTFT p50 s", "TTFT p90 s",
                 "restarted TTFT s",
                 "prompt tok computed/req", "MiB fetched/req", "MiB published/req", "answered A/B"], rows)
    # NOTE: with local caching only B's first request computes the prefix (the next ones hit B's own cache):
    # the first request is the one the fleet cache is for; the mean of the first few shows how soon it stops mattering.
    first_ratio = local["b_first_ttft_s"] / fleet["b_first_ttft_s"]
    first_n_ratio = local["b_first_ttft_mean_s"] / fleet["b_first_ttft_mean_s"]
    restart_ratio = local["restart_ttft_s"] / fleet["restart_ttft_s"]
    print(f"second worker's first request: {first_ratio:.1f}x lower TTFT (target >= 5x), its first {args.first}: "
          f"{first_n_ratio:.1f}x; restarted worker's first "
          f"request: {restart_ratio:.1f}x; prompt tokens per request {fleet['prompt_tokens_per_request']:.0f}; "
          f"identical texts {same}/{len(local['texts'])}")
    for mode in modes:
        del mode["texts"]
    return {"local": local, "fleet": fleet, "first_ttft_ratio": first_ratio, "first_n_ttft_ratio": first_n_ratio,
            "restart_ttft_ratio": restart_ratio,
            "identical_texts": same}


def run_split_mode(args: argparse.Namespace, prompts: list[str], roles: tuple[str, str],
                   fleet_cache: bool) -> dict[str, Any]:
    from tokenmill.producer import Producer

    fleet = Fleet(args, args.redis_url)
    def request(text: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": args.split_max_tokens,
                "ignore_eos": True}

    with Producer(args.redis_url, prefix=fleet.prefix) as producer:
        try:
            for name, role in zip(("P", "D"), roles):
                fleet.start(name, fleet_cache=fleet_cache, role=role)
            fleet.wait_live(producer, 2)
            alone = [_submit_closed_loop(producer, [request(f"Say one word about item {i}.")], 1)[0].timings.ttft
                     for i in range(3)]
            started = time.perf_counter()
            results = _submit_closed_loop(producer, [request(p) for p in prompts], len(prompts))
            wall_s = time.perf_counter() - started
            counters = {name: fleet.counters(name) for name in ("P", "D")}
        finally:
            fleet.close(producer.client)
    assert all(r.status == "ok" for r in results), [r.error for r in results if r.error]
    num_out = sum(r.usage.completion_tokens for r in results)
    num_prompt = sum(r.usage.prompt_tokens for r in results)
    label = "+".join(roles) + (" (fleet cache on)" if fleet_cache and roles == ("both", "both") else "")
    return {"roles": label, "wall_s": wall_s, "output_tokens_per_s": num_out / wall_s,
            "prompt_tokens_per_s": num_prompt / wall_s, "requests_per_s": len(results) / wall_s,
            "ttft_p50_s": percentile([r.timings.ttft for r in results], 50),
            "alone_ttft_s": statistics.median(alone), "counters": counters,
            "texts": [r.text for r in results]}


def part_split(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    prompts = [unique_prompt(tokenizer, i, args.split_prompt_tokens) for i in range(args.split_requests)]
    both = run_split_mode(args, prompts, ("both", "both"), fleet_cache=False)
    split = run_split_mode(args, prompts, ("prefill", "decode"), fleet_cache=True)
    # NOTE: the fleet cache's own cost where nothing is shared (every prompt published, none fetched): what
    # turning it on by default would cost such a workload.
    publishing = run_split_mode(args, prompts, ("both", "both"), fleet_cache=True)
    same = sum(a == b for a, b in zip(both["texts"], split["texts"]))
    rows = [[m["roles"], fmt(m["wall_s"], 1), fmt(m["requests_per_s"], 2), fmt(m["prompt_tokens_per_s"], 0),
             fmt(m["output_tokens_per_s"], 1), fmt(m["ttft_p50_s"], 2), fmt(m["alone_ttft_s"], 3)]
            for m in (both, split, publishing)]
    print_table(f"prefill/decode split: {args.split_requests} requests of ~{args.split_prompt_tokens} prompt tokens, "
                f"{args.split_max_tokens} output tokens, all at once",
                ["workers", "wall s", "req/s", "prompt tok/s", "output tok/s", "TTFT p50 s", "alone TTFT s"], rows)
    decode = split["counters"]["D"]
    print(f"split vs 2 both: {both['wall_s'] / split['wall_s']:.2f}x throughput; hand-off cost (one request alone, "
          f"TTFT split - both): {split['alone_ttft_s'] - both['alone_ttft_s']:+.3f} s; decode worker: "
          f"{decode.get('tokenmill_fleet_cache_handoffs_total', 0):.0f} hand-offs, "
          f"{decode.get('tokenmill_fleet_cache_handoff_recomputed_blocks_total', 0):.0f} blocks recomputed; "
          f"identical texts {same}/{len(prompts)}")
    print(f"fleet cache on, nothing shared (2 both workers): {both['wall_s'] / publishing['wall_s']:.2f}x throughput "
          "vs off")
    for mode in (both, split, publishing):
        del mode["texts"]
    return {"both": both, "split": split, "both_fleet_cache": publishing,
            "publish_only_ratio": both["wall_s"] / publishing["wall_s"],
            "throughput_ratio": both["wall_s"] / split["wall_s"],
            "handoff_cost_s": split["alone_ttft_s"] - both["alone_ttft_s"], "identical_texts": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["cache", "split", "all"], default="all")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=2, help="requests outstanding at once (part cache)")
    parser.add_argument("--first", type=int, default=4, help="the second worker's first this many requests")
    parser.add_argument("--split-requests", type=int, default=32)
    parser.add_argument("--split-prompt-tokens", type=int, default=1000)
    parser.add_argument("--split-max-tokens", type=int, default=16)
    parser.add_argument("--max-waiting", type=int, default=8,
                        help="each worker's admission window: small, so a burst spreads over both workers (with 64, "
                             "the first worker to read claims a 32-request burst whole and the other idles)")
    parser.add_argument("--store-bytes", default="3GiB", help="the fleet store's byte cap")
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--json", default="", help="write the JSON report here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from ops.bench.throughput import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    report: dict[str, Any] = {"machine": machine_info(), "args": vars(args)}
    if args.part in ("cache", "all"):
        report["cache"] = part_cache(args, tokenizer)
    if args.part in ("split", "all"):
        report["split"] = part_split(args, tokenizer)
    write_json(args.json, report)
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "machine"}, default=str)[:2000])


if __name__ == "__main__":
    main()
