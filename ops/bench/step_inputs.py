"""The runner's host time to build a decode step's inputs (issue 45, the persistent batch): the plain path, which
flattens every request's whole block table each step, against the persistent batch (engine/model/input_batch.py),
which changes its rows by difference and gathers them, in the same run, step by step alternating which goes first.

Two measures, each per decode step, at batch 64 / 256 and contexts of 32 / 2k / 8k tokens:

- ``prepare``: ``ModelRunner.prepare`` (the forward's inputs: the eager path, the native decoder on the CPU, tensor
  parallelism) and its upload to the CPU "device";
- ``static``: a decode step of static shape (the CUDA-graph path): ``plan_step`` and ``StaticDecode._fill``.

No model: each runner has a one-layer KV cache of one-element heads (the inputs do not depend on it). Every request
decodes one token a step; its block table grows into a new list when a block fills, as the block manager's does.
The first step of the persistent batch writes every row whole (requests joining): reported apart as ``join``.

torch runs on one intra-op thread unless ``--threads`` says otherwise: on a shared 2-core machine, every op over
32k elements (a table of 64 x 8k tokens, both paths' int32 conversion) otherwise waits for the other core, and
what is measured is that wait (tens of ms, either path), not the host work.

    python ops/bench/step_inputs.py            # the grid (~1 min on 2 cores)
    python ops/bench/step_inputs.py --quick    # fewer steps
    python ops/bench/step_inputs.py --json out/step_inputs.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

import torch

from ops.bench.common import fmt, machine_info, print_table, write_json
from tokenmill.engine.core.step_io import ScheduledChunk, SchedulerOutput
from tokenmill.engine.kernels.attention.reference import ReferenceBackend
from tokenmill.engine.model.kv_cache import KVCache, KVCacheSpec
from tokenmill.engine.model.model_loader import LoadedModel
from tokenmill.engine.model.model_runner import ModelRunner, StaticStep
from tokenmill.engine.model.static_decode import StaticDecode, decode_buckets
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.protocol.sampling import SamplingParams

BLOCK_SIZE = 16
BATCHES = [64, 256]
CONTEXTS = [32, 2048, 8192]


def runner(persistent: bool, static: bool, batch: int, max_blocks: int) -> ModelRunner:
    """A model-less runner for its inputs only."""
    device = torch.device("cpu")
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, block_size=BLOCK_SIZE, dtype=torch.float32)
    kv_cache = KVCache(spec, 4, 0, device)
    backend = ReferenceBackend()
    static_decode = StaticDecode(lambda *args: torch.zeros(0), kv_cache, backend, decode_buckets(batch),
                                 max_blocks_per_seq=max_blocks) if static else None
    loaded = cast(LoadedModel, SimpleNamespace(model=None, device=device, eos_token_ids=frozenset()))
    return ModelRunner(loaded, kv_cache, cast(Sampler, None), backend, static_decode=static_decode,
                       persistent_batch=persistent)


class Decodes:
    """``batch`` requests decoding from ``context`` tokens: each step's chunks, over tables that grow."""

    def __init__(self, batch: int, context: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.blocks_per_request = (context + 1024) // BLOCK_SIZE + 2
        ids = list(range(batch * self.blocks_per_request))
        rng.shuffle(ids)
        self.pools = [ids[i * self.blocks_per_request:(i + 1) * self.blocks_per_request] for i in range(batch)]
        # NOTE: contexts a little apart, so the requests cross block boundaries on different steps
        self.positions = [context - 1 - i % BLOCK_SIZE for i in range(batch)]
        self.tables = [pool[:p // BLOCK_SIZE + 1] for pool, p in zip(self.pools, self.positions)]
        self.params = SamplingParams()

    def step(self) -> list[ScheduledChunk]:
        chunks = []
        for i, position in enumerate(self.positions):
            if position // BLOCK_SIZE >= len(self.tables[i]):
                self.tables[i] = self.tables[i] + [self.pools[i][len(self.tables[i])]]  # a new list, as it grows
            chunks.append(ScheduledChunk(f"r{i}", [7], position, self.tables[i], True, self.params, position))
            self.positions[i] = position + 1
        return chunks


def _run(path: ModelRunner, chunks: list[ScheduledChunk], static: bool) -> None:
    planned = path.plan_step(SchedulerOutput(chunks=chunks))
    if static:
        assert isinstance(planned, StaticStep)
        planned.static._fill(chunks, planned.shape, planned.tables)


def measure(batch: int, context: int, steps: int, static: bool) -> dict[str, float]:
    """Median ms per step of each path (and the persistent batch's first step, when every row joins)."""
    decodes = Decodes(batch, context)
    max_blocks = decodes.blocks_per_request
    plain, persistent = runner(False, static, batch, max_blocks), runner(True, static, batch, max_blocks)
    chunks = decodes.step()
    _run(plain, chunks, static)
    start = time.perf_counter()
    _run(persistent, chunks, static)
    join_ms = 1000 * (time.perf_counter() - start)
    times: dict[str, list[float]] = {"plain": [], "persistent": []}
    for step in range(steps):
        chunks = decodes.step()
        order = [("plain", plain), ("persistent", persistent)]
        for name, path in order if step % 2 else order[::-1]:
            start = time.perf_counter()
            _run(path, chunks, static)
            times[name].append(1000 * (time.perf_counter() - start))
    plain_ms, persistent_ms = statistics.median(times["plain"]), statistics.median(times["persistent"])
    return {"plain_ms": plain_ms, "persistent_ms": persistent_ms, "ratio": plain_ms / persistent_ms,
            "join_ms": join_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps per point")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per point (default 60, --quick 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default 1)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps = args.steps or (15 if args.quick else 60)
    report: dict[str, Any] = {"machine": machine_info(), "block_size": BLOCK_SIZE, "steps": steps,
                              "threads": args.threads, "points": []}
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            point: dict[str, Any] = {"batch": batch, "context": context}
            for what, static in (("prepare", False), ("static", True)):
                point[what] = measure(batch, context, steps, static)
            report["points"].append(point)
            prepare, static_point = point["prepare"], point["static"]
            rows.append([batch, context, fmt(prepare["plain_ms"], 3), fmt(prepare["persistent_ms"], 3),
                         fmt(prepare["ratio"], 1) + "x", fmt(static_point["plain_ms"], 3),
                         fmt(static_point["persistent_ms"], 3), fmt(static_point["ratio"], 1) + "x",
                         fmt(prepare["join_ms"], 3)])
            print(f"batch {batch} context {context}: done", file=sys.stderr, flush=True)
    print_table(f"decode step inputs, ms per step (median of {steps}; block size {BLOCK_SIZE}; "
                f"{args.threads} torch thread(s))",
                ["batch", "context", "prepare plain", "prepare persistent", "ratio", "static plain",
                 "static persistent", "ratio", "join (persistent, first step)"], rows)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
