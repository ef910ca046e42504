"""The cost of structured output in a decode step: 64 sequences decoding on SmolLM2, once with no
response_format and once with a JSON schema on half the rows; prints the step times and the
overhead (target <= 15% of the step).

    python ops/bench/structured.py            # ~1 min on 2 idle cores
    python ops/bench/structured.py --json out/structured.json

Two engines (same model, same settings) each admit 64 requests, one with no response_format
("plain"), the other with a JSON schema on every other row ("half structured"), and step until
every request has its first token (prefill done). Then their decode steps are timed in turns, one
step of one engine, then one of the other (which goes first alternates), so that drift and other
load on a shared machine hit both alike; this repeats for ``--rounds`` rounds of fresh requests,
the engines swapping kinds every round. The overhead compares the median step times (wall and
process CPU time). Also timed: the logits processing inside the sampler (the grammar masks:
bringing each matcher up to date, filling its bitmask, applying it), whose extra cost over the
plain engine's is the mask work per step. On a busy machine the step times swing by 2-10x and
the overhead with them; the mask work and the CPU-time overhead are steadier.
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

from ops.bench.common import machine_info, print_table, write_json

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
    from tokenmill.protocol.sampling import SamplingParams

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return [SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, response_format=fmt)
            if structured and i % 2 == 0 else
            SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=i, ignore_eos=True)
            for i in range(num_rows)]


class Timed:
    """One engine whose sampler's logits processing is timed (seconds spent in ``processors.apply``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.processing_s = 0.0
        processors = engine.runner.sampler.processors
        apply = processors.apply

        def timed_apply(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return apply(*args)
            finally:
                self.processing_s += time.perf_counter() - t0

        processors.apply = timed_apply

    def admit(self, prompt_ids: list[list[int]], params: list[Any], tag: str) -> list[str]:
        """Add one request per prompt and step until each has its first token (prefill done)."""
        ids = [f"{tag}-{i}" for i in range(len(prompt_ids))]
        for request_id, prompt, row_params in zip(ids, prompt_ids, params):
            self.engine.add_request(request_id, prompt, row_params)
        started: set[str] = set()
        while len(started) < len(ids):
            started |= {o.request_id for o in self.engine.step() if o.token_ids}
        return ids

    def step(self) -> tuple[float, float, float]:
        """One decode step: its wall time, the CPU time this process spent in it (all threads) and
        the logits processing time inside it (s)."""
        before = self.processing_s
        c0, t0 = time.process_time(), time.perf_counter()
        outputs = self.engine.step()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        if any(o.finished for o in outputs):
            raise RuntimeError("a row finished while timing: raise --max-tokens or lower --steps")
        return elapsed, cpu, self.processing_s - before

    def release(self, ids: list[str]) -> None:
        for request_id in ids:
            self.engine.abort(request_id)
        while self.engine.has_unfinished():
            self.engine.step()


def build_engine(model: str, rows: int, threads: int) -> Any:
    from tokenmill.engine import Engine, EngineConfig

    return Engine.from_config(EngineConfig.model_validate({
        "model": {"name": model, "device": "cpu", "num_threads": threads},
        "cache": {"kv_cache_memory": "512MiB"},
        "scheduler": {"max_num_seqs": rows, "max_num_batched_tokens": 4096, "max_prefill_chunk": 4096}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=64, help="sequences per decode step")
    parser.add_argument("--steps", type=int, default=10, help="decode steps timed per round and engine")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of fresh requests (even: each engine "
                        "serves each kind equally often)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    from tokenmill.engine import ChatPrompt

    engines = [Timed(build_engine(args.model, args.rows, args.threads)) for _ in range(2)]
    prompt_ids = [engines[0].engine.tokenize(
        ChatPrompt([{"role": "user", "content": f"Describe person number {i} in JSON."}])) for i in range(args.rows)]
    max_tokens = args.steps + 40
    params = {"plain": build_params(args.rows, False, max_tokens),
              "half structured": build_params(args.rows, True, max_tokens)}
    for timed in engines:  # compile the schema, build the tokenizer info
        timed.release(timed.admit(prompt_ids[:4], params["half structured"][:4], "warm-up"))
    results: dict[str, dict[str, list[float]]] = {k: {"step_s": [], "cpu_s": [], "processing_s": []} for k in params}
    for r in range(args.rounds):
        # NOTE: the engines swap kinds every round: two engines of one process step at different
        # speeds (memory placement), which must not count for or against structured output.
        kinds = dict(zip(params, engines if r % 2 == 0 else engines[::-1]))
        ids = {kind: timed.admit(prompt_ids, params[kind], f"r{r}") for kind, timed in kinds.items()}
        order = list(kinds)
        for s in range(args.steps):
            for kind in order if s % 2 == 0 else reversed(order):
                step_s, cpu_s, processing_s = kinds[kind].step()
                results[kind]["step_s"].append(step_s)
                results[kind]["cpu_s"].append(cpu_s)
                results[kind]["processing_s"].append(processing_s)
        for kind, timed in kinds.items():
            timed.release(ids[kind])
    report = summarize(results, args)
    write_json(args.json, report)


def summarize(results: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> dict[str, Any]:
    medians = {kind: {name: statistics.median(values) for name, values in r.items()} for kind, r in results.items()}
    plain, structured = medians["plain"], medians["half structured"]
    overhead = structured["step_s"] / plain["step_s"] - 1
    cpu_overhead = structured["cpu_s"] / plain["cpu_s"] - 1
    mask_share = (structured["processing_s"] - plain["processing_s"]) / plain["step_s"]
    print_table(f"{args.rows}-sequence decode steps on {args.model}, half the rows structured "
                f"(medians of {args.rounds} x {args.steps} interleaved steps)",
                ["kind", "step ms", "step CPU ms", "logits processing ms"],
                [[kind, m["step_s"] * 1e3, m["cpu_s"] * 1e3, m["processing_s"] * 1e3] for kind, m in medians.items()])
    print(f"\nstructured-output overhead: {overhead:+.1%} of the step (target <= 15%); in CPU time "
          f"{cpu_overhead:+.1%}; the mask work alone: {mask_share:.1%} of the plain step")
    return {"machine": machine_info(), "rows": args.rows, "steps": args.steps, "rounds": args.rounds,
            "step_ms": {k: m["step_s"] * 1e3 for k, m in medians.items()},
            "step_cpu_ms": {k: m["cpu_s"] * 1e3 for k, m in medians.items()},
            "processing_ms": {k: m["processing_s"] * 1e3 for k, m in medians.items()}, "overhead": overhead,
            "cpu_overhead": cpu_overhead, "mask_share": mask_share}


if __name__ == "__main__":
    main()
