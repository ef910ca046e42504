"""The engine's own host time per step: what the engine spends around the forward, per running request.

The echo model (engine/echo.py) runs the real scheduler, block manager, prefix cache, output processor, stop
rules and speculator over a runner with no weights, so a step's wall time is the engine's host time alone;
with ``echo:step_delay_s=S`` the runner sleeps S per step, standing in for a device forward, and the report
gives the fraction of the device's limit reached (steps x S / wall: 1.0 means the device never waits).

Two tables, each measured in this run:

- host time: microseconds per running request per decode step, at batch 1 / 64 / 256 / 1024 and prompts of
  32 / 2k / 4k / 8k tokens, speculation off and ``auto``, the requests added as a worker adds those whose callers wait
  for the whole result (``streams=False``) and, speculation off, streamed (text every step);
- device fraction: step delays of 2 / 5 / 10 ms at batch 64 and 256, for the synchronous loop and the overlapped
  one (``[engine.execution] overlap``: the forward on a device thread while the previous step's outputs are made
  and the next step is planned, engine/core/scheduler.py ``schedule_ahead``).

Every request decodes ``--steps`` tokens past its prompt (``ignore_eos``), so the batch stays whole while it is
timed (speculation ``auto`` drafts the echo's repeated prompt: several tokens a step, fewer steps).

    python ops/bench/overhead.py               # the whole grid (a few minutes on 2 cores)
    python ops/bench/overhead.py --quick       # batch 64 and 256, 32 and 2k-token prompts
    python ops/bench/overhead.py --json out.json
    python ops/bench/overhead.py --quick --rounds 3   # each cell's fastest of three rounds of the grid (noise)
    python ops/bench/overhead.py --opcodes     # also: Python opcodes per request per step (no noise at all)

``--opcodes`` counts the Python bytecode instructions the engine runs per running request per decode step (batch
256, prompts of 32, speculation off and ``auto``), with ``sys.settrace``: not time, but the same on every machine and
every run, so a change of a few percent in the engine's own Python shows where a shared machine's timings (which
moved by up to 1.7x between runs of one tree) cannot. Work in C (builtins, the n-gram index) is not counted.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import fmt, machine_info, print_table, write_json
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.protocol.sampling import SamplingParams

WARMUP_STEPS = 3


def build(batch: int, prompt_tokens: int, spec: str, step_delay_s: float, steps: int, overlap: str = "off",
          streams: bool = False) -> Engine:
    """An echo engine holding ``batch`` requests of ``prompt_tokens``, prefilled, decoding; added as a worker adds
    a request whose caller waits for the whole result (``streams=False``), or streamed (an output every step)."""
    name = f"echo:step_delay_s={step_delay_s}" if step_delay_s else "echo"
    config = EngineConfig.model_validate({
        "model": {"name": name, "max_model_len": prompt_tokens + steps * 16 + 64},
        "scheduler": {"max_num_seqs": batch, "max_num_batched_tokens": max(8192, batch * 16),
                      "max_prefill_chunk": max(8192, prompt_tokens)},
        "speculative": {"method": spec},
        # NOTE: named only when on, so the script also runs on a tree from before the setting (a baseline)
        **({"execution": {"overlap": overlap}} if overlap != "off" else {}),
    })
    engine = Engine.from_config(config)
    params = SamplingParams(max_tokens=steps * 16 + WARMUP_STEPS * 16, ignore_eos=True)
    for i in range(batch):
        # NOTE: distinct prompts (no prefix hits), echoed as their bytes
        prompt = [97 + (i * 7 + j * 13) % 26 for j in range(prompt_tokens)]
        try:
            engine.add_request(f"r{i}", prompt, params, streams=streams)
        except TypeError:  # NOTE: a tree from before add_request(streams=...): every request streams there
            engine.add_request(f"r{i}", prompt, params)
    requests = [engine.scheduler.get_request(f"r{i}") for i in range(batch)]
    while any(r is not None and not r.output_token_ids for r in requests):  # NOTE: every prompt computed, decoding
        engine.step()
    for _ in range(WARMUP_STEPS):
        engine.step()
    return engine


def count_opcodes(spec: str, batch: int = 256, prompt_tokens: int = 32, steps: int = 20) -> float:
    """Python opcodes per running request per decode step (``sys.settrace`` opcode events; deterministic)."""
    engine = build(batch, prompt_tokens, spec, 0.0, steps)
    count = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        sys.settrace(None)
    engine.close()
    return count / steps / batch


def measure(batch: int, prompt_tokens: int, spec: str, step_delay_s: float, steps: int,
            overlap: str = "off", streams: bool = False) -> dict[str, Any]:
    """Time ``steps`` decode steps of a full batch."""
    engine = build(batch, prompt_tokens, spec, step_delay_s, steps, overlap, streams)
    gc.collect()
    generated_before = engine.scheduler.counters.num_generated_tokens
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall_s = time.perf_counter() - started
    running = engine.scheduler.num_running
    tokens = engine.scheduler.counters.num_generated_tokens - generated_before
    engine.close()
    host_s = wall_s - steps * step_delay_s
    counters = engine.scheduler.counters
    return {"batch": batch, "prompt_tokens": prompt_tokens, "spec": spec, "overlap": overlap, "streams": streams,
            "steps_planned": counters.num_steps, "steps_ahead": getattr(counters, "num_steps_ahead", 0),
            "step_delay_ms": step_delay_s * 1e3,
            "steps": steps, "running_at_end": running, "wall_s": wall_s, "tokens": tokens,
            "us_per_request_step": host_s / steps / batch * 1e6, "ms_per_step": wall_s / steps * 1e3,
            "device_fraction": steps * step_delay_s / wall_s if step_delay_s else None,
            "tokens_per_step": tokens / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 64 and 256, prompts of 32 and 2k tokens")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per cell")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--sync-only", action="store_true",
                        help="the synchronous loop only (a tree from before the overlapped loop, as a baseline)")
    parser.add_argument("--opcodes", action="store_true",
                        help="also count Python opcodes per request per step at batch 256 (deterministic)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure the whole grid this many times and keep each cell's fastest (a shared "
                             "machine's noise only ever slows a try down)")
    args = parser.parse_args()

    batches = [64, 256] if args.quick else [1, 64, 256, 1024]
    prompts = [32, 2048] if args.quick else [32, 2048, 4096, 8192]
    # Every cell's arguments, host-time cells first (None: a cell too large to run; batch 1024 x 8k would prefill 8M
    # tokens first), then the device-fraction ones.
    host_cells: dict[tuple[str, bool, int, int], tuple[Any, ...] | None] = {
        (spec, streams, batch, prompt_tokens): (None if batch * prompt_tokens > 2_200_000
                                                else (batch, prompt_tokens, spec, 0.0, args.steps, "off", streams))
        for spec, streams in (("off", False), ("off", True), ("auto", False))
        for batch in batches for prompt_tokens in prompts}
    device_cells = {(batch, delay_ms, overlap): (batch, 32, "off", delay_ms / 1e3, args.steps, overlap)
                    for batch in (64, 256) for delay_ms in (2, 5, 10)
                    for overlap in (("off",) if args.sync_only else ("off", "on"))}
    # NOTE: the rounds go round the whole grid, so a slow spell of a shared machine (or the process's own first
    # seconds: a cell measured first ran up to 1.7x slower) costs one try of each cell, never all of a cell's tries
    measure(64, 32, "off", 0.0, args.steps)  # warm-up, untimed
    fastest: dict[Any, dict[str, Any]] = {}
    for _ in range(max(1, args.rounds)):
        for key, cell_args in [*host_cells.items(), *device_cells.items()]:
            if cell_args is not None:
                cell = measure(*cell_args)
                if key not in fastest or cell["wall_s"] < fastest[key]["wall_s"]:
                    fastest[key] = cell
    cells = list(fastest.values())
    host_rows = []
    for spec, streams in (("off", False), ("off", True), ("auto", False)):
        for batch in batches:
            host_rows.append([spec, "yes" if streams else "no", batch, *[
                fmt(fastest[key]["us_per_request_step"]) if (key := (spec, streams, batch, prompt_tokens)) in fastest
                else "-" for prompt_tokens in prompts]])
    print_table("engine host time: us per running request per step (echo, no step delay, the synchronous loop); "
                "streamed: an output with text every step, else the first and the final one (a worker's request "
                "whose caller waits for the result)",
                ["spec", "streamed", "batch", *[f"prompt {p}" for p in prompts]], host_rows)
    device_rows = []
    for batch in (64, 256):
        for delay_ms in (2, 5, 10):
            row: list[Any] = [batch, delay_ms]
            for overlap in ("off",) if args.sync_only else ("off", "on"):
                cell = fastest[(batch, delay_ms, overlap)]
                row += [fmt(cell["ms_per_step"], 2), fmt(cell["device_fraction"], 3)]
                if overlap == "on":
                    row.append(f"{cell['steps_ahead']}/{cell['steps_planned']}")
            device_rows.append(row)
    headers = ["batch", "step delay ms", "sync ms/step", "sync fraction"]
    print_table("fraction of the device's limit (steps x delay / wall), prompts of 32, speculation off: the "
                "synchronous loop and the overlapped one (each step planned while the one before runs), same run",
                headers + ([] if args.sync_only else ["overlap ms/step", "overlap fraction", "steps ahead"]),
                device_rows)
    opcodes = {}
    if args.opcodes:
        opcodes = {spec: count_opcodes(spec) for spec in ("off", "auto")}
        print_table("Python opcodes per running request per decode step (batch 256, prompts of 32; deterministic, "
                    "the same on every machine)", ["spec", "opcodes", "vs off"],
                    [[spec, f"{count:,.0f}", f"{count / opcodes['off']:.2f}x"] for spec, count in opcodes.items()])
    write_json(args.json, {"machine": machine_info(), "rounds": args.rounds, "cells": cells, "opcodes": opcodes})


if __name__ == "__main__":
    main()
