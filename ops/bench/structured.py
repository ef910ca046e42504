"""The cost of structured output in a decode step: 64 sequences decoding on SmolLM2, once with no
response_format and once with a JSON schema on half the rows; prints the step times and the
overhead (target <= 15% of the step).

    python ops/bench/structured.py            # ~2-3 min on 2 cores
    python ops/bench/structured.py --json out/structured.json

Each round admits the 64 requests, steps until every one has its first token (prefill done),
then times ``--steps`` decode steps while all 64 still run, then aborts them. The two kinds of
rounds alternate (``--rounds`` each) so that drift on a shared machine hits both alike; the
medians are compared. Also timed: the logits processing inside the sampler (grammar masks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import machine_info, print_table, write_json  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                   "mood": {"enum": ["happy", "sad", "neutral"]},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}


def build_params(num_rows: int, structured: bool, max_tokens: int) -> list[Any]:
    """Sampled rows (seeded); with ``structured``, every other row follows SCHEMA."""
    from engine import SamplingParams

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return [SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, response_format=fmt)
            if structured and i % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, ignore_eos=True)
            for i in range(num_rows)]


def timed_round(engine: Any, prompt_ids: list[list[int]], params: list[Any], num_steps: int,
                round_index: int) -> tuple[list[float], float]:
    """Decode step times (s) with every row running, and the sampler's processing time (s) in them."""
    ids = [f"r{round_index}-{i}" for i in range(len(prompt_ids))]
    for request_id, prompt, row_params in zip(ids, prompt_ids, params):
        engine.add_request(request_id, prompt, row_params)
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {o.request_id for o in engine.step() if o.token_ids}
    processors = engine.runner.sampler.processors
    apply = processors.apply
    spent = [0.0]

    def timed_apply(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return apply(*args)
        finally:
            spent[0] += time.perf_counter() - t0

    processors.apply = timed_apply
    step_times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        step_times.append(time.perf_counter() - t0)
        if any(o.finished for o in outputs):
            raise RuntimeError("a row finished while timing: raise --max-tokens or lower --steps")
    processors.apply = apply
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return step_times, spent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=64, help="sequences per decode step")
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each kind, alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    from engine import ChatPrompt, Engine, EngineConfig

    engine = Engine.from_config(EngineConfig.model_validate({
        "model": {"name": args.model, "device": "cpu", "num_threads": args.threads},
        "cache": {"kv_cache_memory": "512MiB"},
        "scheduler": {"max_num_seqs": args.rows, "max_num_batched_tokens": 4096, "max_prefill_chunk": 4096}}))
    prompt_ids = [engine.tokenize(ChatPrompt([{"role": "user", "content": f"Describe person number {i} in JSON."}]))
                  for i in range(args.rows)]
    max_tokens = args.steps + 40
    kinds = {"plain": build_params(args.rows, False, max_tokens), "half structured": build_params(args.rows, True,
                                                                                                 max_tokens)}
    timed_round(engine, prompt_ids[:4], kinds["half structured"][:4], 1, -1)  # warm-up: compile the schema
    results: dict[str, dict[str, list[float]]] = {k: {"step_s": [], "processing_s": []} for k in kinds}
    for r in range(args.rounds):
        for kind, params in kinds.items():
            steps, processing = timed_round(engine, prompt_ids, params, args.steps, r * len(kinds) + len(results[kind]))
            results[kind]["step_s"] += steps
            results[kind]["processing_s"].append(processing / len(steps))
    report = summarize(results, args)
    write_json(args.json, report)


def summarize(results: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> dict[str, Any]:
    medians = {kind: statistics.median(r["step_s"]) for kind, r in results.items()}
    processing = {kind: statistics.median(r["processing_s"]) for kind, r in results.items()}
    overhead = medians["half structured"] / medians["plain"] - 1
    print_table(f"{args.rows}-sequence decode steps on {args.model} (medians of {args.rounds} x {args.steps} steps)",
                ["kind", "step ms", "logits processing ms"],
                [[kind, medians[kind] * 1e3, processing[kind] * 1e3] for kind in results])
    print(f"\nstructured-output overhead: {overhead:+.1%} of the step (target <= 15%)")
    return {"machine": machine_info(), "rows": args.rows, "steps": args.steps, "rounds": args.rounds,
            "step_ms": {k: v * 1e3 for k, v in medians.items()},
            "processing_ms": {k: v * 1e3 for k, v in processing.items()}, "overhead": overhead}


if __name__ == "__main__":
    main()
