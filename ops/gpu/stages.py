"""The measuring stages of the GPU check (ops/gpu/check.py runs each in a process of its own):

    python -m ops.gpu.stages smollm2-step --model DIR --result FILE [--dry]
    python -m ops.gpu.stages llama8b --result FILE [--dry]

``smollm2-step``: SmolLM2's shape (random weights, bfloat16) decoding 64 sequences with speculation off (one
token per sequence per step, as the step-time goal and Hugging Face mean it): the wall clock of ``Engine.step``
and its CUDA-event time; then the same with ``[engine.speculative] method = "auto"``, reported apart (tokens per
step, and per second). ``llama8b``: an 8B-shaped random Llama, speculation off: decode tok/s at batch 1 / 64 /
256 over 512-token contexts, prefill tok/s of one 4k-token step, the fraction of the device's specified HBM
bandwidth (:data:`HBM_BANDWIDTH`, by device name) and of a device-to-device copy measured in the same run that a
decode step reaches (weights + KV read per step), and the peak of ``torch.cuda.max_memory_allocated``.

A timed decode step counts only when every timed request was running through it (none finished, waiting or
swapped): the requests ask for more tokens than the steps can give them even at a full draft per step, and are
aborted after the timed steps. ``--dry``: the same code on the CPU at tiny shapes (as many batches), in seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ops.gpu.models import LLAMA_8B, TINY_LLAMA, llama_config

# Bytes per second of each device's HBM as NVIDIA specifies it, by a part of its CUDA name (the first match counts:
# an H100 SXM reads "NVIDIA H100 80GB HBM3"); a decode step's bandwidth row is judged against it, and an unknown
# device against the copy measured in the same run.
HBM_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12))
# The stages' shapes on a GPU, and in the dry run (the same number of rows: the table's layout is the same).
@dataclass(frozen=True)
class Plan:
    """What a stage times: decode batches over contexts of ``context`` tokens, ``steps`` steps each, and (the 8B
    model) one prefill step of ``prefill_tokens``."""

    batches: tuple[int, ...]
    context: int
    steps: int
    prefill_tokens: int = 0


SMOLLM2_PLAN, SMOLLM2_DRY = Plan((64,), 128, 30), Plan((4,), 16, 3)
LLAMA_PLAN, LLAMA_DRY = Plan((1, 64, 256), 512, 20, 4096), Plan((1, 2, 4), 32, 3, 64)
SPECULATIVE_TOKENS = 10  # [engine.speculative] num_speculative_tokens: the most a request can gain in one step, - 1


@dataclass(frozen=True)
class DecodeTiming:
    """Decode-only steps of one batch: medians over the timed steps that ran the whole batch."""

    batch: int
    context: int  # prompt tokens of each sequence (contexts grow by one per step, or more with speculation)
    steps: int  # steps timed
    full_steps: int  # of them, those that ran every one of the batch's requests (only these are counted)
    step_wall_ms: float  # Engine.step, perf_counter
    step_event_ms: float | None  # the same interval between two CUDA events (None on the CPU)
    graph_steps: int  # full steps that ran a static decode bucket (a CUDA graph replay on CUDA)
    kv_tokens: int  # context tokens attended per step, all sequences (at the middle of the full steps)
    tokens_per_step: float  # tokens each sequence gained per full step: 1 without speculation
    speculative: str  # "off" or "on" (the engine has a speculator)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.batch * self.tokens_per_step / self.step_wall_ms


def engine_for(name: str, device: str, dtype: str, scheduler: dict[str, Any], speculative: str = "off",
               cache: dict[str, Any] | None = None, **model: Any) -> Any:
    """A random-weight engine of ``name`` (a config folder), its KV pool sized from free memory unless ``cache``
    says otherwise; speculation ``off`` unless asked for (one token per sequence per step: what a step time and
    the comparisons with Hugging Face, which never speculates, mean)."""
    from tokenmill.engine import Engine, EngineConfig

    return Engine.from_config(EngineConfig.model_validate({
        "model": {"name": name, "random_init": True, "device": device, "dtype": dtype, **model},
        "scheduler": scheduler, "cache": cache or {},
        "speculative": {"method": speculative, "num_speculative_tokens": SPECULATIVE_TOKENS},
    }))


def time_decode(engine: Any, batch: int, context: int, steps: int, seed: int = 0) -> DecodeTiming:
    """Start ``batch`` random prompts of ``context`` tokens, run until every one has its first token
    (the prefills), then time ``steps`` decode steps one by one, counting those that ran the whole batch; the
    requests are aborted after them.

    Raises:
        RuntimeError: no timed step ran the whole batch.
    """
    import torch

    from tokenmill.protocol.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.limits.vocab_size
    # NOTE: more tokens than the steps can give, even with a full draft kept every step: no request finishes
    # while it is timed (a finished one would leave the steps after it short of the batch).
    wanted = (steps + 4) * (1 + SPECULATIVE_TOKENS)
    params = SamplingParams(max_tokens=max(1, min(wanted, engine.limits.max_request_tokens - context)),
                            ignore_eos=True)
    ids = [f"decode-{batch}-{seed}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(vocab) for _ in range(context)], params)
    scheduler, counters = engine.scheduler, engine.scheduler.counters
    generated_at_start = counters.num_generated_tokens
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step())
    runner = engine.runner
    static = runner.static_decode
    cuda = runner.device.type == "cuda"
    walls, events = [], []
    graph_steps = tokens = 0
    generated_before_timing = counters.num_generated_tokens
    for _ in range(steps):
        full = scheduler.num_running == batch and not scheduler.num_waiting and not scheduler.num_swapped
        runs_before = sum(static.num_runs.values()) if static is not None else 0
        generated_before = counters.num_generated_tokens
        start_event = torch.cuda.Event(enable_timing=True) if cuda else None
        end_event = torch.cuda.Event(enable_timing=True) if cuda else None
        begin = time.perf_counter()
        if start_event is not None:
            start_event.record()
        engine.step()
        if start_event is not None and end_event is not None:
            end_event.record()
            end_event.synchronize()
        wall_ms = 1000.0 * (time.perf_counter() - begin)
        if not full:
            continue
        walls.append(wall_ms)
        if start_event is not None and end_event is not None:
            events.append(start_event.elapsed_time(end_event))
        graph_steps += (sum(static.num_runs.values()) if static is not None else 0) > runs_before
        tokens += counters.num_generated_tokens - generated_before
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    if not walls:
        raise RuntimeError(f"no timed decode step ran the whole batch of {batch}")
    return DecodeTiming(batch=batch, context=context, steps=steps, full_steps=len(walls),
                        step_wall_ms=statistics.median(walls),
                        step_event_ms=statistics.median(events) if events else None, graph_steps=graph_steps,
                        kv_tokens=batch * context + generated_before_timing - generated_at_start + tokens // 2,
                        tokens_per_step=tokens / (batch * len(walls)), speculative=engine_speculation(engine))


def engine_speculation(engine: Any) -> str:
    """Whether the engine speculates: "off" (no speculator) or "on"."""
    return "off" if engine.scheduler.speculator is None else "on"


def time_prefill(engine: Any, num_tokens: int, seed: int = 1) -> float:
    """Seconds of one step that prefills a single ``num_tokens``-token prompt (after one such step untimed)."""
    from tokenmill.protocol.sampling import SamplingParams

    rng = random.Random(seed)
    seconds = []
    for attempt in range(2):
        engine.add_request(f"prefill-{num_tokens}-{attempt}", [rng.randrange(engine.limits.vocab_size)
                                                               for _ in range(num_tokens)],
                           SamplingParams(max_tokens=1, ignore_eos=True))
        begin = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - begin)
        while engine.has_unfinished():
            engine.step()
    return seconds[-1]


def copy_bandwidth(num_bytes: int) -> float | None:
    """Bytes per second of a device-to-device copy of ``num_bytes``, counting bytes read and written
    (KINDS.md: about 4.3 TB/s on an H200), the ceiling a decode step's reads are compared with; None off CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    source = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000.0
    del source, target
    torch.cuda.empty_cache()
    return 2 * num_bytes * 10 / seconds


def weights_bytes(model: Any) -> int:
    """Bytes of the model's parameters, each tensor once (tied embeddings)."""
    seen: dict[int, int] = {}
    for parameter in model.parameters():
        seen[parameter.data_ptr()] = parameter.numel() * parameter.element_size()
    return sum(seen.values())


def gpu_peak_bytes() -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


def spec_bandwidth(device_name: str) -> float | None:
    """The device's specified HBM bandwidth in bytes per second (:data:`HBM_BANDWIDTH`); None: not in the table."""
    name = device_name.upper()
    return next((bandwidth for part, bandwidth in HBM_BANDWIDTH if part.upper() in name), None)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _release(engine: Any) -> None:
    """Let go of an engine and its device memory (its pool, its captured graphs) before the next one is made."""
    import torch

    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def smollm2_step(model: str, dry: bool) -> dict[str, Any]:
    """SmolLM2's decode step at batch 64 (bfloat16, CUDA graphs), speculation off; then with speculation on
    (``auto``), apart; dry: a tiny shape, batch 4, CPU."""
    from ops.gpu.models import TINY_SMOLLM2, shrunk

    if dry:
        model = str(shrunk(Path(model), Path(tempfile.mkdtemp(prefix="tm-smollm2-")), TINY_SMOLLM2))
    plan = SMOLLM2_DRY if dry else SMOLLM2_PLAN
    device, dtype = ("cpu", "float32") if dry else ("cuda", "bfloat16")
    (batch,), context, steps = plan.batches, plan.context, plan.steps
    engine = engine_for(model, device, dtype, {"max_num_seqs": batch})
    time_decode(engine, batch, context, 3, seed=9)  # warm-up: the first steps of a shape compile and allocate
    timing = time_decode(engine, batch, context, steps)
    peak = gpu_peak_bytes()
    _release(engine)
    try:  # NOTE: a row of its own: a failure here loses only it
        # a pool of its own size, not a share of what the first engine may have left behind
        engine = engine_for(model, device, dtype, {"max_num_seqs": batch}, speculative="auto",
                            cache={"kv_cache_memory": "64MiB" if dry else "8GiB"})
        time_decode(engine, batch, context, 3, seed=9)
        on = time_decode(engine, batch, context, steps)
        _release(engine)
        speculation: dict[str, Any] = {**asdict(on), "tokens_per_s": on.tokens_per_s}
    except Exception as exc:  # noqa: BLE001 - reported in the row
        speculation = {"error": f"{type(exc).__name__}: {exc}"}
    return {"model": model, "device": device, "dtype": dtype, **asdict(timing), "tokens_per_s": timing.tokens_per_s,
            "gpu_peak_bytes": peak, "speculation": speculation}


def llama8b(dry: bool) -> dict[str, Any]:
    """The 8B-shaped Llama's decode, prefill, bandwidth and memory, speculation off; dry: a tiny Llama on the
    CPU, as many batches."""
    shape, device, dtype = (TINY_LLAMA, "cpu", "float32") if dry else (LLAMA_8B, "cuda", "bfloat16")
    plan = LLAMA_DRY if dry else LLAMA_PLAN
    batches, context, steps, prefill_tokens = plan.batches, plan.context, plan.steps, plan.prefill_tokens
    model = str(llama_config(Path(tempfile.mkdtemp(prefix="tm-llama-")), shape))
    bandwidth = copy_bandwidth(1 << 31)  # before the KV pool takes the free memory
    name = device_name()
    specified = spec_bandwidth(name) if device == "cuda" else None
    engine = engine_for(model, device, dtype, {"max_num_seqs": max(batches), "max_num_batched_tokens": prefill_tokens,
                                               "max_prefill_chunk": prefill_tokens}, max_model_len=2 * prefill_tokens)
    weights = weights_bytes(engine.runner.model)
    spec = engine.runner.kv_cache.spec
    kv_bytes_per_token = spec.bytes_per_block // spec.block_size
    time_decode(engine, 2, 16, 2, seed=100)  # warm-up: the first prefill and decode steps compile and allocate
    decode = []
    for batch in batches:
        timing = time_decode(engine, batch, context, steps, seed=batch)
        bytes_read = weights + timing.kv_tokens * kv_bytes_per_token
        achieved = bytes_read / (timing.step_wall_ms / 1000.0)
        decode.append({**asdict(timing), "tokens_per_s": timing.tokens_per_s, "bytes_read_per_step": bytes_read,
                       "read_bytes_per_s": achieved,
                       "fraction_of_spec_bandwidth": achieved / specified if specified else None,
                       "fraction_of_copy_bandwidth": achieved / bandwidth if bandwidth else None})
    prefill_s = time_prefill(engine, prefill_tokens)
    return {"shape": shape, "device": device, "device_name": name, "dtype": dtype, "weights_bytes": weights,
            "kv_bytes_per_token": kv_bytes_per_token, "copy_bandwidth_bytes_per_s": bandwidth,
            "spec_bandwidth_bytes_per_s": specified, "decode": decode,
            "prefill": {"tokens": prefill_tokens, "step_s": prefill_s, "tokens_per_s": prefill_tokens / prefill_s},
            "num_gpu_blocks": engine.stats().num_gpu_blocks, "gpu_peak_bytes": gpu_peak_bytes()}


STAGES = {"smollm2-step": lambda args: smollm2_step(args.model, args.dry), "llama8b": lambda args: llama8b(args.dry)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--model", default="", help="SmolLM2's config and tokenizer folder")
    parser.add_argument("--result", required=True, help="write the stage's JSON here")
    parser.add_argument("--dry", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args(argv)
    result = STAGES[args.stage](args)
    Path(args.result).write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
