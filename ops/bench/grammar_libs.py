"""Structured-output libraries compared on what the engine needs per decode step: the time to
fill the token masks of 64 rows that follow a JSON schema, on SmolLM2's 49,152-token vocabulary.

    python ops/bench/grammar_libs.py            # both libraries, ~1 min on 2 cores
    python ops/bench/grammar_libs.py --json out/grammar_libs.json

Each of the 64 rows walks its own valid JSON document (different values, so the matchers sit in
different states), one token per step; every step fills all 64 masks, once row by row and once
with the library's own parallel batch call. Also reported: the one-off tokenizer set-up, the
schema compile time, and the installed size each library pulls in.
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

from ops.bench.common import machine_info, print_table, write_json

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "mood": {"enum": ["happy", "sad", "neutral"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
_NAMES = ["Alice Smith", "Bob", "Chen Wei", "Dana O'Neil", "Émile Zola", "Frank", "Grace Hopper", "Hiro"]


def documents(num_rows: int) -> list[str]:
    """One valid document per row, of varied content."""
    return [json.dumps({"name": _NAMES[i % len(_NAMES)], "age": 17 + 3 * i, "mood": ["happy", "sad", "neutral"][i % 3],
                        "tags": ["x" * (i % 4), "tag"][: 1 + i % 2]}, ensure_ascii=False) for i in range(num_rows)]


def bench_llguidance(tokenizer: Any, token_rows: list[list[int]], num_threads: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    t0 = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in token_rows]
    t2 = time.perf_counter()
    mask = llt.allocate_token_bitmask(len(token_rows), ll_tokenizer.vocab_size)
    executor = llguidance.LLExecutor(num_threads)

    def fill_rows() -> None:
        for i, matcher in enumerate(matchers):
            llt.fill_next_token_bitmask(matcher, mask, i)

    def fill_batch() -> None:
        llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(i: int, token_id: int) -> None:
        if not matchers[i].consume_token(token_id):
            raise RuntimeError(matchers[i].get_error())

    result = {"setup_s": t1 - t0, "compile_s": (t2 - t1) / len(token_rows)}
    for key, fill in (("rows_ms", fill_rows), ("batch_ms", fill_batch)):
        matchers = [llguidance.LLMatcher(ll_tokenizer, grammar) for _ in token_rows]
        result[key] = _walk(token_rows, fill, accept)
    return result


def bench_xgrammar(tokenizer: Any, token_rows: list[list[int]], num_threads: int) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(len(token_rows), info.vocab_size)
    batch = xgr.BatchGrammarMatcher(max_threads=num_threads)

    def fill_rows() -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, i)

    def fill_batch() -> None:
        batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(i: int, token_id: int) -> None:
        if not matchers[i].accept_token(token_id):
            raise RuntimeError(f"row {i} rejected token {token_id}")

    result = {"setup_s": t1 - t0, "compile_s": t2 - t1}
    for key, fill in (("rows_ms", fill_rows), ("batch_ms", fill_batch)):
        matchers = [xgr.GrammarMatcher(compiled) for _ in token_rows]
        result[key] = _walk(token_rows, fill, accept)
    return result


def _walk(token_rows: list[list[int]], fill: Any, accept: Any) -> float:
    """Steps every row through its document, filling all masks before each step: ms per step.

    NOTE: each way of filling walks its own fresh matchers: a library may cache the mask of a
    state it has just computed, which would flatter whichever fill ran second.
    """
    num_steps = min(len(r) for r in token_rows)
    fill_s = 0.0
    for step in range(num_steps):
        t0 = time.perf_counter()
        fill()
        fill_s += time.perf_counter() - t0
        for i, row in enumerate(token_rows):
            accept(i, row[step])
    return fill_s / num_steps * 1e3


def _installed_mib(*packages: str) -> float:
    import importlib.util

    total = 0
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            root = Path(list(spec.submodule_search_locations)[0])
            total += sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    return total / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model whose tokenizer is used")
    parser.add_argument("--rows", type=int, default=64, help="sequences per decode step")
    parser.add_argument("--threads", type=int, default=2, help="threads of the parallel fill")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from ops.bench.throughput import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    token_rows = [tokenizer.encode(doc) + [tokenizer.eos_token_id] for doc in documents(args.rows)]
    report: dict[str, Any] = {"machine": machine_info(), "rows": args.rows, "vocab": len(tokenizer), "libraries": {}}
    sizes = {"llguidance": _installed_mib("llguidance"),
             "xgrammar": _installed_mib("xgrammar", "tvm_ffi", "triton")}
    for name, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        report["libraries"][name] = {**bench(tokenizer, token_rows, args.threads), "installed_mib": sizes[name]}
    print_table(
        f"token masks for {args.rows} rows, vocab {len(tokenizer):,} (per decode step)",
        ["library", "row by row ms", f"batch call ({args.threads} thr) ms", "compile ms", "set-up s", "installed MiB"],
        [[n, r["rows_ms"], r["batch_ms"], r["compile_s"] * 1e3, r["setup_s"], r["installed_mib"]]
         for n, r in report["libraries"].items()],
    )
    write_json(args.json, report)


if __name__ == "__main__":
    main()
