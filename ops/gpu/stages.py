"""The measuring stages of the GPU check (ops/gpu/check.py runs each in a process of its own):

    python -m ops.gpu.stages smollm2-step --model DIR --result FILE [--dry]
    python -m ops.gpu.stages llama8b --result FILE [--dry]

``smollm2-step``: SmolLM2's shape (random weights, bfloat16) decoding 64 sequences: the wall clock
of ``Engine.step`` and its CUDA-event time. ``llama8b``: an 8B-shaped random Llama: decode tok/s at
batch 1 / 64 / 256 over 512-token contexts, prefill tok/s of one 4k-token step, the fraction of the
copy bandwidth a decode step reaches (weights + KV read per step, against a device-to-device copy
measured in the same run) and the peak of ``torch.cuda.max_memory_allocated``. ``--dry``: the same
code on the CPU at tiny shapes, in seconds.
"""

from __future__ import annotations

import argparse
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


@dataclass(frozen=True)
class DecodeTiming:
    """Decode-only steps of one batch: medians over the timed steps."""

    batch: int
    context: int  # prompt tokens of each sequence (contexts grow by one per step)
    steps: int
    step_wall_ms: float  # Engine.step, perf_counter
    step_event_ms: float | None  # the same interval between two CUDA events (None on the CPU)
    graph_steps: int  # timed steps that ran a static decode bucket (a CUDA graph replay on CUDA)
    kv_tokens: int  # context tokens attended per step, all sequences (the median step's)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.batch / self.step_wall_ms


def engine_for(name: str, device: str, dtype: str, scheduler: dict[str, Any], **model: Any) -> Any:
    """A random-weight engine of ``name`` (a config folder), its KV pool sized from free memory."""
    from tokenmill.engine import Engine, EngineConfig

    return Engine.from_config(EngineConfig.model_validate({
        "model": {"name": name, "random_init": True, "device": device, "dtype": dtype, **model},
        "scheduler": scheduler,
    }))


def time_decode(engine: Any, batch: int, context: int, steps: int, seed: int = 0) -> DecodeTiming:
    """Start ``batch`` random prompts of ``context`` tokens, run until every one has its first token
    (the prefills), then time ``steps`` decode steps one by one; the requests finish after them."""
    import torch

    from tokenmill.engine import SamplingParams

    rng = random.Random(seed)
    vocab = engine.limits.vocab_size
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    ids = [f"decode-{batch}-{seed}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(vocab) for _ in range(context)], params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step())
    runner = engine.runner
    static = runner.static_decode
    runs_before = sum(static.num_runs.values()) if static is not None else 0
    cuda = runner.device.type == "cuda"
    walls, events = [], []
    for _ in range(steps):
        start_event = torch.cuda.Event(enable_timing=True) if cuda else None
        end_event = torch.cuda.Event(enable_timing=True) if cuda else None
        begin = time.perf_counter()
        if start_event is not None:
            start_event.record()
        engine.step()
        if start_event is not None and end_event is not None:
            end_event.record()
            end_event.synchronize()
            events.append(start_event.elapsed_time(end_event))
        walls.append(1000.0 * (time.perf_counter() - begin))
    graph_steps = (sum(static.num_runs.values()) if static is not None else 0) - runs_before
    while engine.has_unfinished():
        engine.step()
    return DecodeTiming(batch=batch, context=context, steps=steps, step_wall_ms=statistics.median(walls),
                        step_event_ms=statistics.median(events) if events else None, graph_steps=graph_steps,
                        kv_tokens=batch * (context + steps // 2))


def time_prefill(engine: Any, num_tokens: int, seed: int = 1) -> float:
    """Seconds of one step that prefills a single ``num_tokens``-token prompt (after one such step untimed)."""
    from tokenmill.engine import SamplingParams

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


def smollm2_step(model: str, dry: bool) -> dict[str, Any]:
    """SmolLM2's decode step at batch 64 (bfloat16, CUDA graphs); dry: a tiny shape, batch 4, CPU."""
    from ops.gpu.models import TINY_SMOLLM2, shrunk

    if dry:
        model = str(shrunk(Path(model), Path(tempfile.mkdtemp(prefix="tm-smollm2-")), TINY_SMOLLM2))
    device, dtype, batch, context, steps = ("cpu", "float32", 4, 16, 3) if dry else ("cuda", "bfloat16", 64, 128, 30)
    engine = engine_for(model, device, dtype, {"max_num_seqs": batch})
    time_decode(engine, batch, context, 3, seed=9)  # warm-up: the first steps of a shape compile and allocate
    timing = time_decode(engine, batch, context, steps)
    return {"model": model, "device": device, "dtype": dtype, **asdict(timing), "gpu_peak_bytes": gpu_peak_bytes()}


def llama8b(dry: bool) -> dict[str, Any]:
    """The 8B-shaped Llama's decode, prefill, bandwidth and memory; dry: a tiny Llama on the CPU."""
    shape, device, dtype = (TINY_LLAMA, "cpu", "float32") if dry else (LLAMA_8B, "cuda", "bfloat16")
    batches, context, steps, prefill_tokens = ([1, 4], 32, 3, 64) if dry else ([1, 64, 256], 512, 20, 4096)
    model = str(llama_config(Path(tempfile.mkdtemp(prefix="tm-llama-")), shape))
    bandwidth = copy_bandwidth(1 << 31)  # before the KV pool takes the free memory
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
                       "fraction_of_copy_bandwidth": achieved / bandwidth if bandwidth else None})
    prefill_s = time_prefill(engine, prefill_tokens)
    return {"shape": shape, "device": device, "dtype": dtype, "weights_bytes": weights,
            "kv_bytes_per_token": kv_bytes_per_token, "copy_bandwidth_bytes_per_s": bandwidth, "decode": decode,
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
