"""Tensor parallelism on the CPU: the same greedy workload through one engine of two ranks
(``tensor_parallel_size = 2``, one thread per rank) and one of one rank with two threads, in the same run:
output tokens per second and their ratio.

    python ops/bench/tensor_parallel.py                     # 16 prompts x 128 output tokens, float32
    python ops/bench/tensor_parallel.py --quick --json out.json

SmolLM2-135M has 9 attention heads (3 KV heads), which do not split over 2 ranks (the split rules,
engine/model/tensor_parallel.py). So by default every engine here runs a model of SmolLM2-135M's exact
shapes but 12 heads of 48 dimensions (4 KV heads): the same q/k/v/o, MLP and LM-head matrices, the same
attention FLOPs, random weights (``random_init``), token-id prompts. ``--keep-heads`` runs the checkpoint as it
is (only where its heads divide by the ranks). Each engine is timed with its default fast path (the native C++
decoder stack, on every rank) and eager (``decode_fast_path = "off"``); the two-rank engine with its all-reduces through
shared memory (the default) and through gloo (the reference path, ``tensor_parallel_cpu_all_reduce = "gloo"``).

Each engine's host memory is printed per rank (ops/bench/rank_memory.py): the peak RSS of the rank's process
(``VmHWM``) above its baseline, beside the bytes of its part of the model and of its resident KV. Each rank loads
only its part (issue 48), so a rank of two peaks near half the model plus its KV, where one rank peaks near the
whole model plus its KV.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

import torch

from ops.bench.common import machine_info, print_table, write_json
from ops.bench.rank_memory import follower_baseline, model_bytes, rank_memory, reset_peak
from ops.bench.throughput import resolve_model_dir

RUNS = (  # (name, tensor_parallel_size, threads per rank, decode_fast_path, CPU all-reduce)
    (NATIVE := "1 rank x 2 threads, native stack", 1, 2, "auto", "shared_memory"),
    (EAGER := "1 rank x 2 threads, eager", 1, 2, "off", "shared_memory"),
    (TP_NATIVE := "2 ranks x 1 thread, native stack, shared memory", 2, 1, "auto", "shared_memory"),
    (TP_EAGER := "2 ranks x 1 thread, eager, shared memory", 2, 1, "off", "shared_memory"),
    (TP_GLOO := "2 ranks x 1 thread, native stack, gloo", 2, 1, "auto", "gloo"),
)


def divisible_shape(config: dict[str, Any], ranks: int) -> dict[str, Any]:
    """``config`` with the fewest attention heads, at least its own, that split over ``ranks`` while every
    projection keeps its shape (hidden size and KV width unchanged; head_dim and KV heads follow)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_width = config.get("num_key_value_heads", heads) * (hidden // heads)
    for new_heads in range(heads, 4 * heads + 1):
        head_dim, kv_heads = hidden // new_heads, kv_width // (hidden // new_heads)
        if (hidden % new_heads == 0 and kv_width % head_dim == 0 and new_heads % ranks == 0
                and new_heads % kv_heads == 0 and (kv_heads % ranks == 0 or ranks % kv_heads == 0)):
            return {**config, "num_attention_heads": new_heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}
    raise SystemExit(f"no head count near {heads} splits {hidden} over {ranks} ranks")


def run_engine(model: str, random_init: bool, ranks: int, threads: int, compile_mode: str, all_reduce: str,
               prompts: list[list[int]], max_tokens: int, follower_base: int) -> dict[str, Any]:
    """One engine over the workload; its output tokens per second (after a warm-up request), and each rank's
    memory at the end (``follower_base``: a follower's baseline RSS)."""
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.protocol.sampling import SamplingParams

    config = EngineConfig.model_validate({
        "model": {"name": model, "device": "cpu", "dtype": "float32", "num_threads": threads,
                  "random_init": random_init, "tensor_parallel_size": ranks,
                  "tensor_parallel_cpu_all_reduce": all_reduce},
        "execution": {"decode_fast_path": compile_mode},
        "speculative": {"method": "off"},
    })
    baseline = reset_peak()
    engine = Engine.from_config(config)
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True), progress=False)
        start = time.perf_counter()
        outputs = engine.generate(prompts, params, progress=False)
        elapsed = time.perf_counter() - start
        memory = rank_memory(engine, model, torch.float32, ranks, baseline, follower_base)
    finally:
        engine.close()
    tokens = sum(len(out.token_ids) for out in outputs)
    return {"ranks": ranks, "threads_per_rank": threads, "decode_fast_path": compile_mode, "all_reduce": all_reduce,
            "output_tokens": tokens,
            "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed, "token_ids": [out.token_ids for out in outputs],
            "memory": memory}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = Path(resolve_model_dir(args.model))
    config = json.loads((model_dir / "config.json").read_text())
    model, random_init = str(model_dir), False
    with tempfile.TemporaryDirectory() as scratch:
        if not args.keep_heads and config["num_attention_heads"] % 2:
            reshaped = divisible_shape(config, 2)
            model, random_init = str(Path(scratch) / "config.json"), True
            Path(model).write_text(json.dumps(reshaped))
            print(f"{args.model}: {config['num_attention_heads']} heads do not split over 2 ranks; running its "
                  f"shapes with {reshaped['num_attention_heads']} heads x {reshaped['head_dim']} "
                  f"({reshaped['num_key_value_heads']} KV heads), random weights")
        rng = random.Random(0)
        prompts = [[rng.randrange(100, config["vocab_size"]) for _ in range(rng.randint(64, 256))]
                   for _ in range(args.prompts)]
        results = {}
        follower_base = follower_baseline()
        for name, ranks, threads, compile_mode, all_reduce in RUNS:
            results[name] = run_engine(model, random_init, ranks, threads, compile_mode, all_reduce, prompts,
                                       args.max_tokens, follower_base)
            print(f"{name}: {results[name]['tokens_per_s']:.1f} tokens/s", flush=True)
        whole, half = model_bytes(model, torch.float32, 0, 1), model_bytes(model, torch.float32, 0, 2)
    baseline, eager = results[NATIVE]["tokens_per_s"], results[EAGER]["tokens_per_s"]
    tp, gloo = results[TP_NATIVE], results[TP_GLOO]
    print_table(f"{args.prompts} prompts x {args.max_tokens} output tokens, greedy, float32 "
                f"({'random weights, reshaped heads' if random_init else args.model})",
                ["engine", "tokens/s", "seconds", "x vs native", "x vs eager"],
                [[name, r["tokens_per_s"], r["elapsed_s"], r["tokens_per_s"] / baseline, r["tokens_per_s"] / eager]
                 for name, r in results.items()])

    print_memory(results, whole, half)

    def same(a: str, b: str) -> int:
        return sum(x == y for x, y in zip(results[a]["token_ids"], results[b]["token_ids"]))

    # NOTE: in float32 the all-reduce adds two partial products where one rank adds them all in one order:
    # a near-tie can go either way, so 2 ranks against 1 is counted, not asserted (the tests compare float64).
    # The native stack is bitwise its eager forward and both transports sum in rank order: those must agree.
    print(f"\nprompts whose greedy tokens are the same on 2 ranks as on 1 eager rank: {same(TP_NATIVE, EAGER)} of "
          f"{len(prompts)}")
    print(f"... the same through the 2 ranks' native stacks as through their eager forwards: "
          f"{same(TP_NATIVE, TP_EAGER)} of {len(prompts)}")
    print(f"... the same through shared memory as through gloo: {same(TP_NATIVE, TP_GLOO)} of {len(prompts)}")
    counts = {"tp2_prompts_equal_eager": same(TP_NATIVE, EAGER),
              "tp2_native_equal_tp2_eager": same(TP_NATIVE, TP_EAGER),
              "tp2_prompts_equal_over_both_transports": same(TP_NATIVE, TP_GLOO)}
    for result in results.values():
        del result["token_ids"]
    write_json(args.json, {"machine": machine_info(), "model": args.model, "reshaped_heads": random_init,
                           "prompts": args.prompts, "max_tokens": args.max_tokens, "runs": results,
                           "tp2_vs_native": tp["tokens_per_s"] / baseline, "tp2_vs_eager": tp["tokens_per_s"] / eager,
                           "tp2_native_vs_tp2_eager": tp["tokens_per_s"] / results[TP_EAGER]["tokens_per_s"],
                           "tp2_shared_memory_vs_gloo": tp["tokens_per_s"] / gloo["tokens_per_s"],
                           "model_bytes": whole, "rank_model_bytes_of_2": half, **counts})
    return 0


def print_memory(results: dict[str, dict[str, Any]], whole: int, half: int) -> None:
    """Each engine's ranks: peak RSS above the baseline beside the rank's model bytes (as loaded; held, once its
    linear layers are packed) plus its resident KV."""
    rows = []
    for name, result in results.items():
        for rank in result["memory"]:
            grown, holds = rank["peak_rss"] - rank["baseline"], rank["held_bytes"] + rank["kv_bytes"]
            rows.append([name if rank["rank"] == 0 else "", rank["rank"], *(round(b / 2**20) for b in (
                rank["peak_rss"], rank["baseline"], grown, rank["model_bytes"], rank["held_bytes"], rank["kv_bytes"],
                holds)), grown / holds])
    print_table("host memory per rank, MiB: peak RSS (VmHWM) and its baseline (rank 0: its RSS as the engine "
                "started; a follower: a fresh interpreter after its imports)",
                ["engine", "rank", "peak RSS", "baseline", "peak - base", "model loaded", "model held", "KV resident",
                 "held + KV", "(peak - base) / (held + KV)"], rows)
    print(f"the whole model: {whole / 2**20:.0f} MiB; one rank's part of it with 2 ranks: {half / 2**20:.0f} MiB "
          f"({half / whole:.2f} of it: the embeddings and norms are whole on every rank)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="alias, directory or hub id (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt")
    parser.add_argument("--quick", action="store_true", help="4 prompts x 32 tokens, for development")
    parser.add_argument("--keep-heads", action="store_true", help="run the checkpoint itself (its heads must "
                        "divide by 2)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens = 4, 32
    return args


if __name__ == "__main__":
    raise SystemExit(main())
