"""Speculative decoding replayed without the model: greedy outputs, made once with speculation off, fed through
the engine's real speculator (``build_speculator``: the proposers, per-proposer acceptance, the goodput rule and
its fitted step cost) under several ``[engine.speculative]`` settings, with a modelled step time. Seconds per
setting where spec.py takes minutes per run, so draft policies can be ranked before a run on the model; its
numbers are a model's, not a measurement: confirm a change with ``spec.py --baseline-spec``.

Greedy verification keeps a draft up to the first token that differs from the known output (the bonus token
after it is the output's next token), exactly what the engine keeps. Requests run as in spec.py: rounds of
``batch`` requests added at once and stepped until all are done, tasks and rounds in order, one speculator
(and suffix pool) per setting and batch size (the same rows replay at each size). A step costs ``--step-s``
+ ``--row-s`` per row (a row is a decoding request's token, a draft token or a prompt token of the round's
prefill, which both pay); spec off is the same requests with one row each per step. The defaults are fitted
to spec.py on a 2-core Zen 4 (ops/bench/README.md), where the replay reproduced the measured tokens per step
(2.09 vs 2.08 on ``json`` at batch 1) of the former defaults, and with the prefill rows the measured batch-4
speedups (1.6-1.8x against 1.4-1.9x; without them it put batch 4 at 2.0-2.4x).

    python ops/bench/spec_replay.py --make-outputs out/spec_outputs.json      # greedy outputs, spec off (~2 min)
    python ops/bench/spec_replay.py --outputs out/spec_outputs.json --batches 1,4,16 \\
        --setting former='{"ngram_min": 2, "num_speculative_tokens": 6, "min_acceptance": 0.3}' --setting default={}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import print_table, write_json
from ops.bench.spec import COPY_TASKS, TASKS, task_requests
from tokenmill.engine.config import SpeculativeConfig
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.speculation import DraftRoom
from tokenmill.engine.spec.speculator import DraftSpeculator, build_speculator
from tokenmill.protocol.sampling import SamplingParams


def make_outputs(args: argparse.Namespace) -> None:
    """Greedy outputs of ``--num-requests`` requests per task from SmolLM2 with speculation off."""
    import torch

    torch.set_num_threads(args.threads)
    from tokenmill.engine import Engine, EngineConfig

    engine = Engine.from_config(EngineConfig.model_validate({
        "model": {"name": args.model, "dtype": "float32", "num_threads": args.threads},
        "scheduler": {"max_num_seqs": 16}, "speculative": {"method": "off"}}))
    report: dict[str, Any] = {"model": args.model, "tasks": {}}
    for task in args.tasks:
        started = time.perf_counter()
        requests = task_requests(task, engine.tokenizer, args.num_requests, args.seed, args.max_tokens, False)
        outputs = engine.generate([r["prompt"] for r in requests], [
            SamplingParams(max_tokens=r["max_tokens"], temperature=0.0) for r in requests], progress=False)
        report["tasks"][task] = [{"prompt": r["prompt"], "max_tokens": r["max_tokens"], "output": list(o.token_ids)}
                                 for r, o in zip(requests, outputs)]
        print(f"{task}: {sum(len(o.token_ids) for o in outputs)} tokens in {time.perf_counter() - started:.0f} s",
              flush=True)
    write_json(args.make_outputs, report)


def replay(rows: list[dict[str, Any]], batch: int, speculator: DraftSpeculator, args: argparse.Namespace,
           ) -> dict[str, float]:
    """Seconds and steps of spec off and on for ``rows`` in rounds of ``batch``."""
    off_s = on_s = 0.0
    off_steps = on_steps = tokens = 0
    for start in range(0, len(rows), batch):
        round_rows = rows[start:start + batch]
        lengths = sorted(len(row["output"]) for row in round_rows)
        for index, length in enumerate(lengths):  # NOTE: spec off: every live request one row per step
            steps = length - (lengths[index - 1] if index else 0)
            off_s += steps * (args.step_s + args.row_s * (len(lengths) - index))
            off_steps += steps
        tokens += sum(lengths)
        # Both start with the round's prefill: every prompt token a row, in chunks of the step's token budget.
        prompt_tokens = sum(len(row["prompt"]) for row in round_rows)
        num_chunks = -(-prompt_tokens // args.max_num_batched_tokens)
        prefill_s = num_chunks * args.step_s + args.row_s * prompt_tokens
        off_s += prefill_s
        on_s += prefill_s
        live = [(Request(request_id=f"r{start + i}", prompt_token_ids=list(row["prompt"]),
                         sampling_params=SamplingParams(max_tokens=row["max_tokens"], temperature=0.0),
                         arrival_time_s=0.0), row["output"]) for i, row in enumerate(round_rows)]
        while live:
            candidates = [(request, request.max_tokens - request.num_output_tokens - 1) for request, _ in live]
            room = DraftRoom(num_tokens_left=args.max_num_batched_tokens - len(live),
                             num_scheduled_tokens=len(live), num_decodes=len(live))
            drafts = speculator.draft([(r, bound) for r, bound in candidates if bound > 0], room)
            num_rows = len(live) + sum(len(d) for d in drafts.values())
            seconds = args.step_s + args.row_s * num_rows
            speculator.observe_step(num_rows, seconds, "flat", bool(drafts))
            on_s += seconds
            on_steps += 1
            still = []
            for request, output in live:
                draft = drafts.get(request.request_id, [])
                done = request.num_output_tokens
                kept = 0
                while kept < len(draft) and done + kept < len(output) and draft[kept] == output[done + kept]:
                    kept += 1
                if draft:
                    speculator.observe([(request, len(draft), kept)])
                request.output_token_ids.extend(output[done:done + kept + 1])
                if request.num_output_tokens < len(output):
                    still.append((request, output))
                else:
                    speculator.finished(request)
            live = still
    return {"off_s": off_s, "on_s": on_s, "off_steps": off_steps, "on_steps": on_steps, "tokens": tokens}


def parse_setting(text: str) -> tuple[str, dict[str, Any]]:
    name, _, settings = text.partition("=")
    return name, json.loads(settings or "{}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make-outputs", default="", help="write greedy outputs (spec off, SmolLM2) here and stop")
    parser.add_argument("--outputs", default="", help="a --make-outputs file to replay")
    parser.add_argument("--setting", action="append", default=[],
                        help="NAME=JSON of [engine.speculative] settings (repeatable; default: former and default)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma list (the outputs file's tasks)")
    parser.add_argument("--batches", default="1,4,16", help="requests at once, comma list")
    parser.add_argument("--step-s", type=float, default=0.018, help="modelled seconds per step")
    parser.add_argument("--row-s", type=float, default=0.0015, help="modelled seconds per row of a step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-requests", type=int, default=32, help="--make-outputs: requests per task")
    parser.add_argument("--max-tokens", type=int, default=256, help="--make-outputs: max_tokens of copy-heavy tasks")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="write the JSON report here")
    args = parser.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    if args.make_outputs:
        make_outputs(args)
        return 0
    if not args.outputs:
        parser.error("--outputs (or --make-outputs) is required")
    data = json.loads(Path(args.outputs).read_text())["tasks"]
    settings = [parse_setting(s) for s in args.setting] or [
        ("former", {"ngram_min": 2, "num_speculative_tokens": 6, "min_acceptance": 0.3}), ("default", {})]
    batches = [int(b) for b in args.batches.split(",") if b]
    tasks = [t for t in args.tasks if t in data]
    results: dict[str, dict[str, Any]] = {}
    for name, overrides in settings:
        for batch in batches:  # NOTE: a fresh pool per batch size: the rows repeat across batch sizes
            speculator = build_speculator(SpeculativeConfig(**{"method": "auto", **overrides}))
            assert isinstance(speculator, DraftSpeculator)
            for task in tasks:
                results[f"{name} {task} {batch}"] = replay(data[task], batch, speculator, args)
    headers = ["task", "batch"] + [f"{name}: on/off, tokens/step" for name, _ in settings]
    table = []
    for task in tasks:
        for batch in batches:
            row = [task, str(batch)]
            for name, _ in settings:
                r = results[f"{name} {task} {batch}"]
                row.append(f"{r['off_s'] / r['on_s']:.2f}x, {r['tokens'] / r['on_steps']:.2f}")
            table.append(row)
    print_table(f"Speculation replayed (modelled step {args.step_s * 1e3:.1f} ms + {args.row_s * 1e3:.2f} ms per row; "
                f"copy-heavy: {','.join(t for t in tasks if t in COPY_TASKS)})", headers, table)
    write_json(args.json, {"benchmark": "spec_replay", "args": vars(args), "settings": dict(settings),
                           "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
