"""A length.py job replayed through the scheduler alone: the real ``Scheduler``, length predictor, KV budget and
speculator, a scripted model and a modelled step time. Seconds per variant where length.py takes minutes per
mode, so scheduling ideas can be tried on the job's real lengths before a run on the model; its numbers are a
model's, not a measurement: confirm any change with length.py.

The report (``ops/bench/length.py --json``) gives the job (prompts, in order), every request's real length
(greedy: the same in every mode), the pool (device blocks) and the swap space. Each step, the scripted model
ends a request with EOS at its real length; with ``--speculation`` (the engine's default ``auto``), a row that
runs to ``max_tokens`` (greedy SmolLM2 loops there) keeps every draft token, the others none. A step costs
``--step-s`` + ``--row-s`` per row + ``--draft-token-s`` per draft token + ``--prefill-token-s`` per prefill
token: the defaults are fitted to length.py's runs on a 2-core AMX Xeon (ops/bench/README.md).

Variants of the job (``--variant``): ``all``; ``no-long`` (only the rows that end before ``max_tokens``: no
pressure on the pool); ``long-only`` (only the rows that reach it); ``no-template`` (every prompt's tokens
replaced by random ones: the predictor has only the job's history and everyone's, no template key).

    python ops/bench/length_replay.py --json out/length.json
    python ops/bench/length_replay.py --json out/length.json --modes off,on-fcfs --variant no-template --trace 30
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import print_table
from ops.bench.length import MODES
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.clock import ManualClock
from tokenmill.engine.core.length_predictor import build_length_predictor
from tokenmill.engine.core.length_state import LengthState
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.step_io import ModelOutput
from tokenmill.engine.kv.block_manager import BlockManager
from tokenmill.engine.spec.speculator import build_speculator
from tokenmill.protocol.sampling import SamplingParams

EOS = 2
OTHER = 5  # every token a scripted row generates: its n-gram drafts repeat it, so a kept draft is all OTHER
VARIANTS = ("all", "no-long", "long-only", "no-template")


def job_rows(report: dict[str, Any], variant: str, lengths: dict[str, int]) -> list[tuple[str, list[int]]]:
    """(request id, prompt token ids) of the job's rows in the variant, in the job's order."""
    max_tokens = report["args"]["max_tokens"]
    rng = random.Random(0)
    rows = []
    for job in report["workload"]["jobs"]:
        request_id = f"{job['kind']}-{job['index']}"
        is_long = lengths[request_id] >= max_tokens
        if (variant == "no-long" and is_long) or (variant == "long-only" and not is_long):
            continue
        prompt = job["prompt_token_ids"]
        if variant == "no-template":
            prompt = [rng.randrange(1000, 40000) for _ in prompt]
        rows.append((request_id, prompt))
    return rows


def replay(mode: str, rows: list[tuple[str, list[int]]], lengths: dict[str, int], report: dict[str, Any],
           args: argparse.Namespace) -> dict[str, Any]:
    """The rows through a fresh scheduler in ``mode``: simulated times, counters, per-kind completion."""
    first = next(iter(report["results"].values()))
    sections = {"model": {"name": "echo"}, "length": MODES[mode],
                "scheduler": {"max_num_seqs": report["args"]["max_num_seqs"],
                              "preemption_mode": report["args"]["preemption_mode"]},
                "cache": {"swap_space": report["args"]["swap_space"]},
                "speculative": {"method": "auto" if args.speculation else "off"}}
    config = EngineConfig.model_validate(sections)
    block_size = first["pool_tokens"] // first["num_gpu_blocks"]
    num_cpu_blocks = config.cache.swap_space_bytes // first["kv_block_bytes"]
    blocks = BlockManager(first["num_gpu_blocks"], num_cpu_blocks, block_size)
    clock = ManualClock()
    speculator = build_speculator(config.speculative)
    scheduler = Scheduler(config.scheduler, blocks, clock, frozenset({EOS}), 1 << 20, None, speculator,
                          build_length_predictor(config.length))
    max_tokens = report["args"]["max_tokens"]
    for request_id, prompt in rows:
        scheduler.add_request(Request(request_id=request_id, prompt_token_ids=prompt,
                                      sampling_params=SamplingParams(max_tokens=max_tokens), arrival_time_s=0.0,
                                      length_state=LengthState(report["args"].get("length_group") or None)))
    generated = collections.Counter[str]()
    finished: dict[str, float] = {}
    running_area = kv_area = 0.0
    next_trace = 0.0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        output = ModelOutput()
        num_prefill_tokens = 0
        for chunk in plan.chunks:
            if not chunk.needs_sample:
                num_prefill_tokens += chunk.num_tokens
                continue
            num_kept = 1
            if lengths[chunk.request_id] >= max_tokens:
                for token_id in chunk.draft_token_ids:
                    if token_id != OTHER:
                        break
                    num_kept += 1
            tokens = []
            for _ in range(num_kept):
                generated[chunk.request_id] += 1
                tokens.append(EOS if generated[chunk.request_id] >= lengths[chunk.request_id] else OTHER)
                if tokens[-1] == EOS:
                    break
            output.sampled_token_ids[chunk.request_id] = tokens
        num_draft_tokens = sum(chunk.num_draft_tokens for chunk in plan.chunks)
        step_s = (args.step_s + args.row_s * len(plan.chunks) + args.draft_token_s * num_draft_tokens
                  + args.prefill_token_s * num_prefill_tokens)
        if speculator is not None:
            speculator.observe_step(plan.num_batched_tokens, step_s, "flat", num_draft_tokens > 0)
        running_area += scheduler.num_running * step_s
        kv_area += (1 - blocks.num_free_gpu_blocks / blocks.num_gpu_blocks) * step_s
        clock.advance(step_s)
        for request in scheduler.update(plan, output):
            if request.is_finished:
                finished[request.request_id] = clock.now()
        if args.trace and clock.now() >= next_trace:
            next_trace += args.trace
            print(f"  {mode} {clock.now():7.1f} s: {len(finished)} finished, {scheduler.num_running} running, "
                  f"{scheduler.num_waiting} waiting, {scheduler.num_swapped} swapped, KV "
                  f"{1 - blocks.num_free_gpu_blocks / blocks.num_gpu_blocks:.0%}", flush=True)
    makespan = clock.now()
    by_kind = collections.defaultdict(list)
    for request_id, done_s in finished.items():
        by_kind[request_id.split("-")[0]].append(done_s)
    return {"mode": mode, "makespan_s": makespan, "num_steps": scheduler.counters.num_steps,
            "tokens_per_s": sum(lengths[r] for r, _ in rows) / makespan,
            "num_preemptions": scheduler.counters.num_preemptions,
            "completion_mean_s": statistics.fmean(finished.values()),
            "kind_mean_s": {kind: statistics.fmean(times) for kind, times in sorted(by_kind.items())},
            "mean_running": running_area / makespan, "mean_kv_used": kv_area / makespan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="a report of ops/bench/length.py --json")
    parser.add_argument("--modes", default="off,on-fcfs,on-shortest,on-longest",
                        help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--variant", choices=VARIANTS, default="all")
    parser.add_argument("--speculation", action=argparse.BooleanOptionalAction, default=True,
                        help="the engine's default speculation (auto); a row at max_tokens keeps every draft")
    parser.add_argument("--step-s", type=float, default=0.0194, help="modelled seconds per step")
    parser.add_argument("--row-s", type=float, default=0.00159, help="modelled seconds per row of a step")
    parser.add_argument("--draft-token-s", type=float, default=0.0012, help="modelled seconds per draft token")
    parser.add_argument("--prefill-token-s", type=float, default=0.00005, help="modelled seconds per prefill token")
    parser.add_argument("--trace", type=float, default=0.0, help="print the queues every this many simulated s")
    args = parser.parse_args()

    report = json.loads(Path(args.json).read_text())
    lengths = {rid: r["length"] for rid, r in next(iter(report["results"].values()))["requests"].items()}
    rows = job_rows(report, args.variant, lengths)
    results = [replay(mode, rows, lengths, report, args) for mode in args.modes.split(",")]
    base = next((r for r in results if r["mode"] == "off"), results[0])
    kinds = sorted({kind for r in results for kind in r["kind_mean_s"]})
    print_table(
        f"replay of {args.json}: {len(rows)} requests ({args.variant}), speculation "
        f"{'on' if args.speculation else 'off'}; simulated seconds",
        ["mode", "makespan s", "steps", "tok/s", f"vs {base['mode']}", "preemptions", "mean completion s",
         *(f"{kind} mean s" for kind in kinds), "mean running", "KV used"],
        [[r["mode"], f"{r['makespan_s']:.1f}", r["num_steps"], f"{r['tokens_per_s']:.1f}",
          f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x", r["num_preemptions"], f"{r['completion_mean_s']:.1f}",
          *(f"{r['kind_mean_s'].get(kind, float('nan')):.1f}" for kind in kinds), f"{r['mean_running']:.1f}",
          f"{r['mean_kv_used']:.0%}"] for r in results])


if __name__ == "__main__":
    main()
