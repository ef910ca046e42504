"""Output-length prediction on a backlog: one bulk job of heavy-tailed requests on a KV pool that holds
about a quarter of the running set's max-length reservations, with prediction off and on
(engine/core/length_predictor.py, engine/core/kv_budget.py).

The job: ``--num-requests`` chat prompts (short answers, lists and long essays from a few templates over
~80 topics, mixed 40/35/25% and shuffled with the seed), greedy, natural EOS, each ``max_tokens``
``--max-tokens``, all added at t=0 with one ``length_group``. The KV pool is ``--kv-fraction`` of
``max_num_seqs x (mean prompt + max_tokens)`` tokens at the model's KV bytes per token. Each mode runs
the same job on a fresh engine in this process:

- ``off``: ``[engine.length] estimate = false`` (admit while the next chunk fits; preempt when the pool runs out);
- ``on-fcfs``: prediction + ``budget_kv`` (admit while the predicted peak KV fits), arrival order;
- ``on-shortest`` / ``on-longest``: the same, shortest / longest predicted output first;
- ``on-auto`` (not in the default list): ordering ``auto`` (one length group: longest first).
- ``order-shortest`` / ``order-longest`` (not in the default list): prediction and ordering without the KV
  budget (admission as ``off``: preemption absorbs what does not fit), shortest / longest predicted first.

Reported: makespan, output tokens/s, preemptions, completion times, deferred admissions; the prediction
error (median |log predicted - log actual|) against planning with ``max_tokens``; the error of a bulk ETA
(predicted backlog tokens / tokens per second) at 25/50/75% of the job.

    python ops/bench/length.py --json out/length.json     # 200 requests x 2,048 tokens, four modes (long)
    python ops/bench/length.py --quick                    # 24 requests x 256 tokens, for development
    python ops/bench/length.py --quick --modes off,on-fcfs
"""

from __future__ import annotations

import argparse
import collections
import gc
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import fmt, machine_info, percentile, print_table, write_json
from ops.bench.workload import _template
from tokenmill.producer.eta import RATE_WINDOW_S

# Templates by kind: the template comes first in the user message (the predictor's prompt-prefix keys see it),
# the topic last. Greedy SmolLM2-135M-Instruct answers the short ones in ~4-45 tokens, the lists in ~75-140,
# and runs the essays to max_tokens (it loops; a fine heavy tail).
TEMPLATES: dict[str, list[str]] = {
    "short": [
        "Answer in one word: what color is {topic}?",
        "Answer with a single word only. Is {topic} important?",
        "In one word, how would you describe {topic}?",
    ],
    "list": [
        "List 5 facts about {topic}.",
        "Give me a numbered list of 8 tips about {topic}.",
        "List 5 questions people often ask about {topic}.",
    ],
    "essay": [
        "Write a long, detailed essay about {topic}.",
        "Write a long, detailed essay about {topic}, with an introduction, several sections and a conclusion.",
    ],
}
KINDS = ("short", "list", "essay")

TOPICS = [
    "the ocean", "volcanoes", "chess", "honeybees", "the Moon", "rainforests", "bicycles", "coffee",
    "the Roman Empire", "glaciers", "electric cars", "jazz music", "the human heart", "deserts", "photosynthesis",
    "the printing press", "octopuses", "solar energy", "bread baking", "lighthouses", "the internet",
    "earthquakes", "origami", "the Great Wall of China", "penguins", "vaccines", "trains", "the Amazon river",
    "meditation", "tea", "dinosaurs", "recycling", "the violin", "thunderstorms", "gardening", "mountains",
    "the stock market", "elephants", "public libraries", "snow", "the Olympic Games", "mushrooms", "airplanes",
    "coral reefs", "the piano", "city parks", "wolves", "clocks", "chocolate", "the Sahara", "rivers",
    "robots", "the periodic table", "whales", "football", "bridges", "the solar system", "tomatoes",
    "castles", "rain", "the alphabet", "pyramids", "owls", "windmills", "cheese", "the Arctic", "maps",
    "sharks", "forests", "the telephone", "painting", "the immune system", "islands", "ants", "oranges",
    "the moon landing", "museums", "sleep", "bamboo", "comets",
]

MODES: dict[str, dict[str, Any]] = {
    "off": {"estimate": False},
    "on-fcfs": {"estimate": True, "budget_kv": True, "ordering": "fcfs"},
    "on-shortest": {"estimate": True, "budget_kv": True, "ordering": "shortest"},
    "on-longest": {"estimate": True, "budget_kv": True, "ordering": "longest"},
    "on-auto": {"estimate": True, "budget_kv": True, "ordering": "auto"},
    "order-shortest": {"estimate": True, "budget_kv": False, "ordering": "shortest"},
    "order-longest": {"estimate": True, "budget_kv": False, "ordering": "longest"},
}
DEFAULT_MODES = "off,on-fcfs,on-shortest,on-longest"
ERROR_POINTS = (20, 100, 200)  # finished requests
ETA_POINTS = (25, 50, 75)  # percent of the job finished
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass
class Job:
    """One request of the bulk job."""

    index: int
    kind: str  # short | list | essay
    text: str
    prompt_token_ids: list[int]

    @property
    def request_id(self) -> str:
        return f"{self.kind}-{self.index}"


def build_jobs(tokenizer: Any, num: int, seed: int, mix: tuple[float, float, float]) -> list[Job]:
    """``num`` requests, ``mix`` of short / list / essay (rounded), shuffled with ``seed``; no two texts alike
    while the templates x topics last."""
    rng = random.Random(seed)
    counts = [round(num * share / sum(mix)) for share in mix[:2]]
    counts.append(num - sum(counts))
    kinds = [kind for kind, count in zip(KINDS, counts) for _ in range(count)]
    rng.shuffle(kinds)
    combos = {kind: [(t, topic) for t in TEMPLATES[kind] for topic in TOPICS] for kind in KINDS}
    for pairs in combos.values():
        rng.shuffle(pairs)
    used = collections.Counter[str]()
    jobs = []
    for index, kind in enumerate(kinds):
        template, topic = combos[kind][used[kind] % len(combos[kind])]
        used[kind] += 1
        text = template.format(topic=topic)
        jobs.append(Job(index, kind, text, _template(tokenizer, text)))
    return jobs


def kv_bytes_per_token(model_path: Any, dtype: str) -> int:
    """KV bytes one token takes in every layer: layers x 2 (K, V) x KV heads x head dim x dtype bytes, from
    the model's config (SmolLM2-135M float32: 30 x 2 x 3 x 64 x 4 = 46,080)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return int(cfg.num_hidden_layers * 2 * num_kv_heads * head_dim * _DTYPE_BYTES[dtype])


def engine_sections(args: argparse.Namespace, mode: str, kv_cache_bytes: int) -> dict[str, Any]:
    return {
        "model": {"name": args.model, "device": "cpu", "dtype": args.dtype, "num_threads": args.threads},
        "cache": {"kv_cache_memory": kv_cache_bytes, "swap_space": args.swap_space},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "preemption_mode": args.preemption_mode},
        "length": {**MODES[mode], **({"min_samples": args.min_samples} if args.min_samples and mode != "off" else {})},
    }


def warm_up(engine: Any, prompt: list[int]) -> None:
    """A few untimed steps, then abort: an aborted request teaches the length predictor nothing."""
    from tokenmill.protocol.sampling import SamplingParams

    engine.add_request("warm-up", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    num_steps = 0
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
        if num_steps == 4:
            engine.abort("warm-up")


def log_error(predicted: float, actual: int) -> float:
    return abs(math.log(max(1.0, predicted)) - math.log(max(1, actual)))


def run_mode(mode: str, jobs: list[Job], args: argparse.Namespace, kv_cache_bytes: int) -> dict[str, Any]:
    """The whole job on a fresh engine in ``mode``; per-request lengths and times, counters, ETA checkpoints."""
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.protocol.sampling import SamplingParams

    config = EngineConfig.model_validate(engine_sections(args, mode, kv_cache_bytes))
    engine = Engine.from_config(config)
    warm_up(engine, jobs[0].prompt_token_ids)
    scheduler = engine.scheduler
    blocks = scheduler.block_manager
    base = engine.stats()
    params = SamplingParams(max_tokens=args.max_tokens)  # greedy, natural EOS
    by_id = {job.request_id: job for job in jobs}
    group = args.length_group or None

    t0 = engine.clock.now()
    for job in jobs:
        engine.add_request(job.request_id, job.prompt_token_ids, params, arrival_time=t0, length_group=group)
    generated: dict[str, int] = {}  # output tokens so far
    admission: dict[str, dict[str, Any] | None] = {}  # the estimate in force when it got its first token
    finished: dict[str, dict[str, Any]] = {}
    finish_order: list[str] = []
    num_tokens = 0
    window: collections.deque[tuple[float, int]] = collections.deque([(0.0, 0)])
    eta_marks = {p: math.ceil(p / 100 * len(jobs)) for p in ETA_POINTS}
    checkpoints: list[dict[str, Any]] = []
    running_area = kv_area = 0.0
    prev = next_report = 0.0
    while engine.has_unfinished():
        outputs = engine.step()
        now = engine.clock.now() - t0
        running_area += scheduler.num_running * (now - prev)
        kv_area += (1 - blocks.num_free_gpu_blocks / blocks.num_gpu_blocks) * (now - prev)
        prev = now
        for out in outputs:
            rid = out.request_id
            num_tokens += len(out.new_token_ids)
            generated[rid] = len(out.token_ids)
            if rid not in admission and out.token_ids:
                request = scheduler.get_request(rid)
                est = request.length_state.estimate if request is not None else None
                admission[rid] = None if est is None else {
                    "median": est.median_total, "mean": est.mean_total, "high": est.high_total,
                    "num_samples": est.num_samples, "source": est.source}
            if out.finished:
                finish_order.append(rid)
                reason = getattr(out.finish_reason, "value", out.finish_reason)
                finished[rid] = {"length": len(out.token_ids), "completion_s": out.metrics.total_s,
                                 "ttft_s": out.metrics.ttft_s, "finish_reason": str(reason),
                                 "num_preemptions": out.metrics.num_preemptions}
        if args.progress_s and now >= next_report:
            next_report = now + args.progress_s
            print(f"    {now:6.1f} s: {len(finished)}/{len(jobs)} finished, {num_tokens} tokens, "
                  f"{scheduler.num_running} running, {scheduler.num_swapped} swapped, "
                  f"{scheduler.counters.num_preemptions - base.counters.num_preemptions} preemptions", flush=True)
        window.append((now, num_tokens))
        while len(window) > 2 and window[1][0] <= now - args.eta_window_s:
            window.popleft()
        for point, mark in eta_marks.items():
            if len(finished) >= mark and all(c["percent"] != point for c in checkpoints):
                stats = engine.stats()
                t_w, tokens_w = window[0]
                remaining_max = sum(args.max_tokens - generated.get(rid, 0) for rid in by_id if rid not in finished)
                checkpoints.append({
                    "percent": point, "num_finished": len(finished), "t_s": now,
                    "backlog_tokens": stats.length.backlog_tokens, "max_tokens_backlog": remaining_max,
                    "rate_run": num_tokens / now if now > 0 else math.nan,
                    "rate_window": (num_tokens - tokens_w) / (now - t_w) if now > t_w else math.nan,
                })
    makespan = engine.clock.now() - t0
    stats = engine.stats()
    predictor = scheduler.length_predictor
    records = [r._asdict() for r in predictor.records] if predictor is not None else []
    counters, before = stats.counters, base.counters
    completions = [f["completion_s"] for f in finished.values()]
    for c in checkpoints:
        c["actual_remaining_s"] = makespan - c["t_s"]
    result = {
        "mode": mode, "length_config": MODES[mode], "makespan_s": makespan, "output_tokens": num_tokens,
        "tokens_per_s": num_tokens / makespan, "num_finished": len(finished),
        "num_preemptions": counters.num_preemptions - before.num_preemptions,
        "preemptions_by_cause": {c.value: n - before.cause_to_num_preemptions[c]
                                 for c, n in counters.cause_to_num_preemptions.items()},
        "num_swap_outs": counters.num_swap_outs - before.num_swap_outs,
        "num_recompute_preemptions": counters.num_recompute_preemptions - before.num_recompute_preemptions,
        "num_recomputed_tokens": counters.num_recomputed_tokens - before.num_recomputed_tokens,
        "num_deferred_admissions": counters.num_deferred_admissions - before.num_deferred_admissions,
        "num_steps": counters.num_steps - before.num_steps,
        "completion_mean_s": statistics.fmean(completions) if completions else math.nan,
        "completion_p50_s": percentile(completions, 50), "completion_p90_s": percentile(completions, 90),
        "mean_running": running_area / makespan, "mean_kv_used": kv_area / makespan,
        "num_gpu_blocks": blocks.num_gpu_blocks, "pool_tokens": blocks.num_gpu_blocks * config.cache.block_size,
        "kv_block_bytes": engine.limits.kv_block_bytes,
        "checkpoints": checkpoints, "finish_order": finish_order, "requests": finished, "admission": admission,
        "records": records,
        "predictor_errors": list(predictor.errors()) if predictor is not None else None,
    }
    del engine, scheduler, blocks, predictor
    gc.collect()
    return result


# ----------------------------------------------------------------------------- the report


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def error_rows(result: dict[str, Any], max_tokens: int, num_requests: int) -> list[dict[str, Any]]:
    """Median |log predicted - log actual| over the first N finished requests (0..N) and over the window since
    the previous point, for the engine's records (the estimate a request was admitted with), the one in force
    at its first token, and ``max_tokens``."""
    order = result["finish_order"]
    lengths = {rid: result["requests"][rid]["length"] for rid in order}
    records = result["records"]
    points = sorted({min(p, num_requests) for p in ERROR_POINTS})

    def admitted(ids: list[str]) -> list[float]:
        return [log_error(result["admission"][rid]["median"], lengths[rid]) for rid in ids
                if result["admission"].get(rid) is not None]

    rows = []
    start = 0
    for n in points:
        rows.append({
            "after": n,
            "arrival_cum": _median([log_error(r["predicted"], r["actual"]) for r in records[:n]]),
            "admission_cum": _median(admitted(order[:n])),
            "admission_window": _median(admitted(order[start:n])),
            "max_tokens_cum": _median([log_error(max_tokens, lengths[rid]) for rid in order[:n]]),
            "max_tokens_window": _median([log_error(max_tokens, lengths[rid]) for rid in order[start:n]]),
            "window": f"{start}..{n}",
        })
        start = n
    return rows


def _div(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _rel_error(eta: float, actual: float) -> float:
    """|ETA - actual| / actual (NaN when either is unknown)."""
    return abs(eta - actual) / actual if actual > 0 and not math.isnan(eta) else math.nan


def eta_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c in result["checkpoints"]:
        actual = c["actual_remaining_s"]
        eta_run = _div(c["backlog_tokens"], c["rate_run"])
        eta_window = _div(c["backlog_tokens"], c["rate_window"])
        eta_max = _div(c["max_tokens_backlog"], c["rate_window"])
        rows.append({"percent": c["percent"], "t_s": c["t_s"], "actual_remaining_s": actual,
                     "eta_run_s": eta_run, "error_run": _rel_error(eta_run, actual), "eta_window_s": eta_window,
                     "error_window": _rel_error(eta_window, actual), "eta_max_tokens_s": eta_max,
                     "error_max_tokens": _rel_error(eta_max, actual)})
    return rows


def length_distribution(jobs: list[Job], result: dict[str, Any], max_tokens: int) -> list[list[str]]:
    rows = []
    for kind in (*KINDS, "all"):
        lengths = [result["requests"][j.request_id]["length"] for j in jobs
                   if (kind == "all" or j.kind == kind) and j.request_id in result["requests"]]
        if not lengths:
            continue
        at_max = sum(n >= max_tokens for n in lengths) / len(lengths)
        rows.append([kind, str(len(lengths)), fmt(statistics.fmean(lengths), 0), fmt(percentile(lengths, 50), 0),
                     fmt(percentile(lengths, 90), 0), str(max(lengths)), f"{100 * at_max:.0f}%",
                     str(sum(lengths))])
    return rows


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.0f}%"


def _ratio(num: float, den: float) -> float:
    if den == 0:
        return math.inf if num > 0 else math.nan
    return num / den


def print_report(jobs: list[Job], results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    first = next(iter(results.values()))
    print_table(f"Output lengths ({first['mode']} run; max_tokens {args.max_tokens})",
                ["kind", "requests", "mean", "p50", "p90", "max", "at max_tokens", "tokens"],
                length_distribution(jobs, first, args.max_tokens))
    for mode, r in results.items():
        if mode != first["mode"]:
            differ = sum(r["requests"][rid]["length"] != f["length"] for rid, f in first["requests"].items()
                         if rid in r["requests"])
            if differ:
                print(f"  {mode}: {differ} requests' lengths differ from the {first['mode']} run "
                      "(batch composition changes float32 rounding)")

    off = results.get("off")
    rows = []
    for mode, r in results.items():
        rows.append([mode, fmt(r["makespan_s"], 1), str(r["output_tokens"]), fmt(r["tokens_per_s"], 1),
                     f"{r['tokens_per_s'] / off['tokens_per_s']:.2f}x" if off else "-",
                     str(r["num_preemptions"]), str(r["num_swap_outs"]), str(r["num_recompute_preemptions"]),
                     fmt(r["completion_mean_s"], 1), fmt(r["completion_p50_s"], 1), fmt(r["completion_p90_s"], 1),
                     str(r["num_deferred_admissions"]), fmt(r["mean_running"], 1), _pct(r["mean_kv_used"])])
    print_table("Modes (wall = makespan; completion = from t=0, when all requests were added)",
                ["mode", "wall s", "out tokens", "tok/s", "vs off", "preempt", "swaps out", "recomp",
                 "mean compl s", "p50", "p90", "deferred", "mean running", "KV used"], rows)

    err_rows = []
    for mode, r in results.items():
        if r["length_config"].get("estimate"):
            for e in error_rows(r, args.max_tokens, len(jobs)):
                err_rows.append([mode, str(e["after"]), fmt(e["arrival_cum"], 2), fmt(e["admission_cum"], 2),
                                 f"{fmt(e['admission_window'], 2)} ({e['window']})", fmt(e["max_tokens_cum"], 2),
                                 fmt(e["max_tokens_window"], 2)])
    if err_rows:
        print_table("Prediction error: median |log predicted - log actual| over finished requests in finishing "
                    "order (cum: the first N; window: since the previous point)",
                    ["mode", "after N", "engine records cum", "at admission cum", "at admission window",
                     "max_tokens cum", "max_tokens window"], err_rows)

    eta_table = []
    for mode, r in results.items():
        has_backlog = r["length_config"].get("estimate")
        for e in eta_rows(r):
            eta_table.append([mode, f"{e['percent']}%", fmt(e["t_s"], 1), fmt(e["actual_remaining_s"], 1),
                              fmt(e["eta_window_s"], 1) if has_backlog else "-",
                              _pct(e["error_window"]) if has_backlog else "-",
                              fmt(e["eta_run_s"], 1) if has_backlog else "-",
                              _pct(e["error_run"]) if has_backlog else "-",
                              fmt(e["eta_max_tokens_s"], 1), _pct(e["error_max_tokens"])])
    window = f"{args.eta_window_s:.0f} s"
    print_table(f"Bulk ETA when 25/50/75% of the requests have finished: the predicted backlog tokens (stats.length."
                f"backlog_tokens) / output tok/s over the last {window} (producer/eta.py's rate), or over the run so "
                "far; error = |ETA - actual| / actual, actual = the run's remaining time; max_tokens: the unfinished "
                f"requests' max_tokens minus what they generated, at the {window} rate (the baseline)",
                ["mode", "done", "at s", "actual s", f"ETA s ({window})", "error", "ETA s (run)", "error",
                 "max_tokens ETA s", "error"], eta_table)
    return print_targets(results, len(jobs), args.max_tokens)


def print_targets(results: dict[str, dict[str, Any]], num_requests: int, max_tokens: int) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    rows = []
    off, fcfs = results.get("off"), results.get("on-fcfs")
    shortest, longest = results.get("on-shortest"), results.get("on-longest")
    if off and fcfs:
        ratio = _ratio(off["num_preemptions"], fcfs["num_preemptions"])
        summary["preemption_ratio_off_vs_on"] = ratio if math.isfinite(ratio) else None  # None: on-fcfs had none
        summary["preemptions_off_on"] = [off["num_preemptions"], fcfs["num_preemptions"]]
        rows.append(["preemptions, off / on-fcfs", f"{off['num_preemptions']} / {fcfs['num_preemptions']}",
                     ">= 5x", "PASS" if ratio >= 5 else "FAIL"])
        tput = fcfs["tokens_per_s"] / off["tokens_per_s"]
        summary["throughput_ratio_on_vs_off"] = tput
        rows.append(["output tok/s, on-fcfs / off", f"{tput:.2f}x", ">= 1.00x", "PASS" if tput >= 1.0 else "FAIL"])
    if off and shortest:  # NOTE: the issue's comparison: prediction off (fcfs, no budget) against on, ordered shortest
        ratio = off["completion_mean_s"] / shortest["completion_mean_s"]
        summary["mean_completion_ratio_off_vs_shortest"] = ratio
        rows.append(["mean completion, off / on-shortest", f"{ratio:.2f}x", ">= 1.5x",
                     "PASS" if ratio >= 1.5 else "FAIL"])
    if fcfs and shortest:  # the share of it that the order alone gives, the budget on in both
        ratio = fcfs["completion_mean_s"] / shortest["completion_mean_s"]
        summary["mean_completion_ratio_fcfs_vs_shortest"] = ratio
        rows.append(["mean completion, on-fcfs / on-shortest", f"{ratio:.2f}x", "(info)", ""])
    if fcfs and longest:
        ratio = longest["makespan_s"] / fcfs["makespan_s"]
        summary["makespan_ratio_longest_vs_fcfs"] = ratio
        rows.append(["makespan, on-longest / on-fcfs", f"{ratio:.2f}x", "<= 1.00x", "PASS" if ratio <= 1.0 else "FAIL"])
    order_shortest, order_longest = results.get("order-shortest"), results.get("order-longest")
    if off and order_shortest:
        ratio = off["completion_mean_s"] / order_shortest["completion_mean_s"]
        summary["mean_completion_ratio_off_vs_order_shortest"] = ratio
        rows.append(["mean completion, off / order-shortest (no budget)", f"{ratio:.2f}x", ">= 1.5x",
                     "PASS" if ratio >= 1.5 else "FAIL"])
        tput = order_shortest["tokens_per_s"] / off["tokens_per_s"]
        rows.append(["output tok/s, order-shortest / off", f"{tput:.2f}x", "(info)", ""])
    if off and order_longest:
        ratio = order_longest["makespan_s"] / off["makespan_s"]
        summary["makespan_ratio_order_longest_vs_off"] = ratio
        rows.append(["makespan, order-longest / off (no budget)", f"{ratio:.2f}x", "<= 1.00x",
                     "PASS" if ratio <= 1.0 else "FAIL"])
    predicted = [r for r in results.values() if r["length_config"].get("estimate")]
    if predicted:
        last = error_rows(predicted[0], max_tokens, num_requests)[-1]
        summary["log_error_at_admission"] = last["admission_cum"]
        summary["log_error_max_tokens"] = last["max_tokens_cum"]
        rows.append([f"log-length error after {last['after']}, {predicted[0]['mode']} at admission / max_tokens",
                     f"{fmt(last['admission_cum'], 2)} / {fmt(last['max_tokens_cum'], 2)}", "lower",
                     "PASS" if last["admission_cum"] < last["max_tokens_cum"] else "FAIL"])
    if rows:
        print_table("Targets", ["check", "measured", "target", "result"], rows)
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="engine model alias, directory or GGUF")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPE_BYTES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--num-requests", type=int, default=None, help="default 200 (--quick: 24)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 2048 (--quick: 256)")
    parser.add_argument("--mix", default="0.40,0.35,0.25", help="shares of short, list and essay requests")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="seats, default 32 (--quick: 16); the KV pool is sized from them and binds first")
    parser.add_argument("--kv-fraction", type=float, default=0.25,
                        help="KV pool = this x max_num_seqs x (mean prompt + max_tokens) tokens")
    parser.add_argument("--swap-space", default="1GiB", help="host KV pool for swapped-out requests")
    parser.add_argument("--min-samples", type=int, default=None,
                        help="[engine.length] min_samples for the modes that predict (default: the engine's)")
    parser.add_argument("--preemption-mode", choices=("swap", "recompute"), default="swap")
    parser.add_argument("--length-group", default="bulk-job",
                        help="every request's length_group (one bulk job); '' for None")
    parser.add_argument("--eta-window-s", type=float, default=RATE_WINDOW_S,
                        help="the recent window of the ETA's token rate (default: producer/eta.py's)")
    parser.add_argument("--progress-s", type=float, default=None,
                        help="a progress line every this many seconds, default 60 (--quick: 10); 0: none")
    parser.add_argument("--quick", action="store_true",
                        help="24 requests x 256 tokens, 16 seats, for development (explicit flags still win)")
    parser.add_argument("--json", default="", help="write the JSON report here")
    args = parser.parse_args(argv)
    for name, full, quick in (("num_requests", 200, 24), ("max_tokens", 2048, 256), ("max_num_seqs", 32, 16),
                              ("progress_s", 60.0, 10.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    mix = tuple(float(x) for x in args.mix.split(","))
    if len(mix) != 3 or min(mix) < 0 or sum(mix) <= 0:
        parser.error("--mix takes three non-negative shares: short,list,essay")
    args.mix = mix
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from ops.bench.throughput import resolve_model_dir

    path = resolve_model_dir(args.model)
    jobs = build_jobs(AutoTokenizer.from_pretrained(path), args.num_requests, args.seed, args.mix)
    bytes_per_token = kv_bytes_per_token(path, args.dtype)
    mean_prompt = statistics.fmean(len(j.prompt_token_ids) for j in jobs)
    pool_tokens = math.ceil(args.kv_fraction * args.max_num_seqs * (mean_prompt + args.max_tokens))
    kv_cache_bytes = pool_tokens * bytes_per_token
    kinds = collections.Counter(j.kind for j in jobs)
    print(f"job: {len(jobs)} requests ({', '.join(f'{kinds[k]} {k}' for k in KINDS)}), mean prompt "
          f"{mean_prompt:.1f} tokens, max_tokens {args.max_tokens}, greedy, natural EOS, length_group "
          f"{args.length_group or None!r}; model {args.model} {args.dtype}, {args.threads} threads")
    print(f"KV pool: {args.kv_fraction:g} x {args.max_num_seqs} seats x ({mean_prompt:.1f} + {args.max_tokens}) = "
          f"{pool_tokens:,} tokens x {bytes_per_token:,} B/token = {kv_cache_bytes / 2**20:,.1f} MiB "
          f"(~{pool_tokens / (mean_prompt + args.max_tokens):.1f} max-length requests); swap {args.swap_space}, "
          f"preemption {args.preemption_mode}")
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        print(f"running {mode} ...", flush=True)
        r = run_mode(mode, jobs, args, kv_cache_bytes)
        if r["kv_block_bytes"] * r["num_gpu_blocks"] > kv_cache_bytes or r["pool_tokens"] < 0.9 * pool_tokens:
            print(f"  NOTE: the engine's pool is {r['pool_tokens']:,} tokens ({r['kv_block_bytes']:,} B/block)")
        results[mode] = r
        print(f"  {mode}: {r['makespan_s']:.1f} s, {r['tokens_per_s']:.1f} tok/s, {r['num_preemptions']} preemptions, "
              f"mean completion {r['completion_mean_s']:.1f} s, pool {r['pool_tokens']:,} tokens", flush=True)
    summary = print_report(jobs, results, args)
    write_json(args.json, {
        "benchmark": "length", "args": vars(args), "machine": machine_info(),
        "workload": {"num_requests": len(jobs), "kinds": dict(kinds), "mean_prompt_tokens": mean_prompt,
                     "kv_bytes_per_token": bytes_per_token, "pool_tokens": pool_tokens,
                     "kv_cache_bytes": kv_cache_bytes, "jobs": [asdict(j) for j in jobs]},
        "results": results,
        "errors": {m: error_rows(r, args.max_tokens, len(jobs)) for m, r in results.items()
                   if r["length_config"].get("estimate")},
        "eta": {m: eta_rows(r) for m, r in results.items()},
        "summary": summary,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
