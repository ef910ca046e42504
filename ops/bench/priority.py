"""Priority scheduling under load: the engine is kept full of low-priority long-output requests
while short high-priority requests arrive (about 20% of the requests). The same arrival schedule
runs twice on the same engine configuration: once with priorities (high = 0, low = 1, priority
preemption with CPU swap) and once in FIFO order (every request priority 0). Arrivals are
injected between engine steps at their scheduled times; TTFT counts from the scheduled time.

    python ops/bench/priority.py             # full run (two rounds, A B B A; ~6-8 min on 2 cores)
    python ops/bench/priority.py --quick     # small, for development
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import fmt, machine_info, mib, percentile, print_table, write_json
from ops.bench.workload import build_workload
from tokenmill.engine.core.request import PreemptionCause
from tokenmill.engine.core.stats import EngineStats

HIGH, LOW = 0, 1


@dataclass
class Arrival:
    """One scheduled request."""

    request_id: str
    at_s: float  # offset from the start of the run
    prompt_token_ids: list[int]
    max_tokens: int
    is_high: bool


def build_schedule(tokenizer: Any, args: argparse.Namespace) -> list[Arrival]:
    """Half the low-priority requests at t=0 (the engine starts full), the rest spread over the
    window; high-priority requests as a Poisson stream over the window."""
    rng = random.Random(args.seed)
    prompts = build_workload(tokenizer, args.num_low + args.num_high, seed=args.seed, max_prompt_tokens=200)
    arrivals: list[Arrival] = []
    num_upfront = args.num_low // 2
    for i in range(args.num_low):
        at = 0.0 if i < num_upfront else rng.uniform(0.0, args.window_s)
        arrivals.append(Arrival(f"low-{i}", at, prompts[i].prompt_token_ids,
                                rng.randint(args.low_tokens_min, args.low_tokens_max), False))
    rate = args.num_high / args.window_s
    at = args.high_start_s
    for i in range(args.num_high):
        at += rng.expovariate(rate) * (args.window_s - args.high_start_s) / args.window_s
        arrivals.append(Arrival(f"high-{i}", at, prompts[args.num_low + i].prompt_token_ids,
                                rng.randint(args.high_tokens_min, args.high_tokens_max), True))
    return sorted(arrivals, key=lambda a: (a.at_s, a.request_id))


def run_mode(mode: str, schedule: list[Arrival], args: argparse.Namespace) -> dict[str, Any]:
    """Run the schedule on a fresh engine; ``mode`` is ``priority`` or ``fifo``."""
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.protocol.sampling import SamplingParams

    config = EngineConfig.model_validate({
        "model": {"name": args.model, "device": "cpu", "dtype": "float32", "num_threads": args.threads},
        "cache": {"kv_cache_memory": args.kv_cache_memory, "swap_space": args.swap_space},
        "scheduler": {
            "max_num_seqs": args.max_num_seqs, "preemption_mode": args.preemption_mode,
            "enable_priority_preemption": mode == "priority",
            "demote_after_decode_steps": args.demote_after_decode_steps if mode == "priority" else 0,
            "aging_interval_s": args.aging_interval_s if mode == "priority" else 0.0,
        },
    })
    engine = Engine.from_config(config)
    engine.generate([schedule[0].prompt_token_ids], SamplingParams(max_tokens=4, ignore_eos=True), progress=False)
    by_id = {a.request_id: a for a in schedule}
    pending = list(schedule)
    finished: dict[str, Any] = {}
    base_stats = engine.stats()
    t0 = engine.clock.now()
    wall0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = engine.clock.now() - t0
        while pending and pending[0].at_s <= now:
            arrival = pending.pop(0)
            priority = (HIGH if arrival.is_high else LOW) if mode == "priority" else 0
            engine.add_request(arrival.request_id, arrival.prompt_token_ids,
                               SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True),
                               priority=priority, arrival_time=t0 + arrival.at_s)
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.05, pending[0].at_s - now)))
            continue
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    makespan_s = time.perf_counter() - wall0
    return _mode_result(mode, by_id, finished, makespan_s, engine.stats(), base_stats, config)


def _mode_result(mode: str, by_id: dict[str, Arrival], finished: dict[str, Any], makespan_s: float,
                 stats: EngineStats, base: EngineStats, config: Any) -> dict[str, Any]:
    def ttfts(is_high: bool) -> list[float]:
        return [o.metrics.ttft_s for rid, o in finished.items() if by_id[rid].is_high == is_high
                and o.metrics.ttft_s is not None]

    wrong = [rid for rid, o in finished.items() if len(o.token_ids) != by_id[rid].max_tokens]
    num_tokens = sum(len(o.token_ids) for o in finished.values())
    high, low = ttfts(True), ttfts(False)
    counters = {
        "num_steps": lambda s: s.counters.num_steps,
        "num_preemptions": lambda s: s.counters.num_preemptions,
        **{f"num_preemptions_{cause.value}": (lambda s, c=cause: s.counters.cause_to_num_preemptions[c])
           for cause in PreemptionCause},
        "num_swap_outs": lambda s: s.counters.num_swap_outs, "num_swap_ins": lambda s: s.counters.num_swap_ins,
        "swap_out_bytes": lambda s: s.swap_out_bytes, "swap_in_bytes": lambda s: s.swap_in_bytes,
        "num_recompute_preemptions": lambda s: s.counters.num_recompute_preemptions,
        "num_recomputed_tokens": lambda s: s.counters.num_recomputed_tokens,
    }
    return {
        "mode": mode, "high_ttfts_s": high, "low_ttfts_s": low,
        "high_totals_s": [o.metrics.total_s for rid, o in finished.items() if by_id[rid].is_high],
        "num_finished": len(finished), "num_wrong_length": len(wrong), "output_tokens": num_tokens,
        "makespan_s": makespan_s, "tokens_per_s": num_tokens / makespan_s,
        "high_ttft_p50_s": percentile(high, 50), "high_ttft_p99_s": percentile(high, 99),
        "high_ttft_max_s": max(high, default=None), "low_ttft_p50_s": percentile(low, 50),
        "low_ttft_p99_s": percentile(low, 99),
        "high_total_p50_s": percentile([o.metrics.total_s for rid, o in finished.items() if by_id[rid].is_high], 50),
        "stats": {k: value(stats) - value(base) for k, value in counters.items()},
        "config": config.model_dump(),
    }


def pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine repeated runs of one mode: percentiles over all samples, throughput over all time."""
    if len(runs) == 1:
        return runs[0]
    high = [x for r in runs for x in r["high_ttfts_s"]]
    low = [x for r in runs for x in r["low_ttfts_s"]]
    totals = [x for r in runs for x in r["high_totals_s"]]
    tokens = sum(r["output_tokens"] for r in runs)
    makespan = sum(r["makespan_s"] for r in runs)
    return {
        "mode": runs[0]["mode"], "num_runs": len(runs), "output_tokens": tokens, "makespan_s": makespan,
        "tokens_per_s": tokens / makespan, "num_wrong_length": sum(r["num_wrong_length"] for r in runs),
        "high_ttft_p50_s": percentile(high, 50), "high_ttft_p99_s": percentile(high, 99),
        "high_ttft_max_s": max(high, default=None), "low_ttft_p50_s": percentile(low, 50),
        "low_ttft_p99_s": percentile(low, 99), "high_total_p50_s": percentile(totals, 50),
        "stats": {k: sum(r["stats"][k] for r in runs) for k in runs[0]["stats"]},
        "per_run_tokens_per_s": [r["tokens_per_s"] for r in runs],
    }


def print_report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    prio, fifo = results["priority"], results["fifo"]
    rows = []
    for label, key, digits in (("high-priority TTFT p50 (s)", "high_ttft_p50_s", 2),
                               ("high-priority TTFT p99 (s)", "high_ttft_p99_s", 2),
                               ("high-priority TTFT max (s)", "high_ttft_max_s", 2),
                               ("high-priority total latency p50 (s)", "high_total_p50_s", 2),
                               ("low-priority TTFT p50 (s)", "low_ttft_p50_s", 2),
                               ("low-priority TTFT p99 (s)", "low_ttft_p99_s", 2),
                               ("output tokens", "output_tokens", 0),
                               ("makespan (s)", "makespan_s", 1),
                               ("throughput (tok/s)", "tokens_per_s", 1)):
        p, f = prio[key], fifo[key]
        ratio = p / f if isinstance(p, (int, float)) and isinstance(f, (int, float)) and f else None
        rows.append([label, fmt(p, digits), fmt(f, digits), f"{ratio:.2f}x" if ratio is not None else "-"])
    print_table("High-priority latency and total throughput", ["metric", "priority", "FIFO", "priority/FIFO"], rows)
    stat_rows = []
    for key in prio["stats"]:
        p, f = prio["stats"][key], fifo["stats"][key]
        is_bytes = key.endswith("bytes")
        stat_rows.append([key, mib(p) if is_bytes else str(p), mib(f) if is_bytes else str(f)])
    print_table("Engine counters during the run", ["counter", "priority", "FIFO"], stat_rows)
    ttft_ratio = prio["high_ttft_p99_s"] / fifo["high_ttft_p99_s"]
    tput_ratio = prio["tokens_per_s"] / fifo["tokens_per_s"]
    print_table("Targets", ["check", "measured", "target", "result"], [
        ["high-priority p99 TTFT, priority / FIFO", f"{ttft_ratio:.3f}x", "<= 0.25x",
         "PASS" if ttft_ratio <= 0.25 else "FAIL"],
        ["total throughput, priority / FIFO", f"{tput_ratio:.3f}x", ">= 0.9x", "PASS" if tput_ratio >= 0.9 else "FAIL"],
        ["every request got exactly its tokens", str(prio["num_wrong_length"] + fifo["num_wrong_length"] == 0), "True",
         "PASS" if prio["num_wrong_length"] + fifo["num_wrong_length"] == 0 else "FAIL"],
    ])
    return {"high_p99_ttft_ratio": ttft_ratio, "throughput_ratio": tput_ratio}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="engine model alias, directory or GGUF")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-low", type=int, default=40, help="low-priority long-output requests")
    parser.add_argument("--num-high", type=int, default=10, help="high-priority short requests (~20%% of all)")
    parser.add_argument("--low-tokens-min", type=int, default=160)
    parser.add_argument("--low-tokens-max", type=int, default=320)
    parser.add_argument("--high-tokens-min", type=int, default=16)
    parser.add_argument("--high-tokens-max", type=int, default=48)
    parser.add_argument("--window-s", type=float, default=60.0, help="arrivals are spread over this many seconds")
    parser.add_argument("--high-start-s", type=float, default=3.0, help="first high-priority arrivals after this")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="small, so the engine is full")
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--swap-space", default="512MiB")
    parser.add_argument("--preemption-mode", choices=("swap", "recompute"), default="swap")
    parser.add_argument("--max-consecutive-decode-steps", type=int, default=0,
                        help="long-output starvation limit in priority mode (0 = off)")
    parser.add_argument("--aging-interval-s", type=float, default=0.0, help="priority aging in priority mode")
    parser.add_argument("--order", default="fifo,priority", help="which mode runs first (comma list)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds; the order alternates (A B B A ...) so drift on a shared machine cancels")
    parser.add_argument("--quick", action="store_true", help="a small schedule for development")
    parser.add_argument("--json", default="", help="write the JSON report here")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_low, args.num_high, args.max_num_seqs = 10, 3, 4
        args.low_tokens_min, args.low_tokens_max = 48, 96
        args.high_tokens_min, args.high_tokens_max = 8, 16
        args.window_s, args.high_start_s = 12.0, 2.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from ops.bench.throughput import resolve_model_dir

    path = resolve_model_dir(args.model)
    schedule = build_schedule(AutoTokenizer.from_pretrained(path), args)
    num_high = sum(a.is_high for a in schedule)
    print(f"schedule: {len(schedule) - num_high} low-priority ({args.low_tokens_min}-{args.low_tokens_max} tokens), "
          f"{num_high} high-priority ({args.high_tokens_min}-{args.high_tokens_max} tokens) "
          f"over {args.window_s:.0f} s; "
          f"max_num_seqs={args.max_num_seqs}, preemption={args.preemption_mode}, model {args.model}")
    order = args.order.split(",")
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in order}
    for round_no in range(args.repeats):
        for mode in (order if round_no % 2 == 0 else order[::-1]):
            print(f"running {mode} (round {round_no + 1}/{args.repeats}) ...", flush=True)
            r = run_mode(mode, schedule, args)
            runs[mode].append(r)
            print(f"  {mode}: {r['tokens_per_s']:.1f} tok/s over {r['makespan_s']:.1f} s, "
                  f"high TTFT p99 {r['high_ttft_p99_s']:.2f} s", flush=True)
    results = {mode: pool(mode_runs) for mode, mode_runs in runs.items()}
    summary = print_report(results)
    write_json(args.json, {"benchmark": "priority", "args": vars(args), "machine": machine_info(),
                           "results": results, "runs": runs, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
