"""The cost of the fleet cache's weights fingerprint (engine/model/model_loader.py ``weights_fingerprint``): every
weight byte hashed (blake2b, pieces of 64 MiB on a thread pool) once per load, with the fleet cache on.

    python ops/bench/fingerprint.py               # 4 of Llama-2-7B's 32 layers plus its embeddings (2.1 GB), <1 min
    python ops/bench/fingerprint.py --layers 32   # the whole 7B model in bfloat16 (13.5 GB of memory)

Allocates real Llama-2-7B-shaped tensors in bfloat16 (hidden 4096, MLP 11008, 32 heads, vocabulary 32000), layer
by layer as a checkpoint's state dict names them, hashes them with the engine's function (the pool, then one
thread: the baseline, in the same run) and projects the seconds for the whole model (6.74B parameters, 13.5 GB)
from the measured rate.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import machine_info, print_table, write_json

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 4096, 11008, 32000, 32  # Llama-2-7B


def llama7b_shapes(num_layers: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors: embeddings, ``num_layers`` decoder layers, final norm, head."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{layer}.self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{layer}.mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[f"{layer}.mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[f"{layer}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def build_model(torch: Any, num_layers: int) -> Any:
    """A module holding the tensors as parameters (what ``weights_fingerprint`` walks), each written once so its
    pages are resident (a fresh, untouched allocation would read the shared zero page: faster than real weights)."""
    model = torch.nn.Module()
    for index, (name, shape) in enumerate(llama7b_shapes(num_layers).items()):
        tensor = torch.empty(shape, dtype=torch.bfloat16).fill_(0.01 * (index % 7 + 1))
        model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(tensor, requires_grad=False))
    return model


def time_it(function: Any, repeats: int) -> float:
    """Median seconds of ``repeats`` calls."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of Llama-2-7B to allocate (of 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; the median is reported")
    parser.add_argument("--threads", type=int, default=0, help="hashing threads (0: every core this process may use)")
    parser.add_argument("--quick", action="store_true", help="1 layer, 1 repeat (development)")
    parser.add_argument("--json", help="write a JSON report here")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.repeats = 1, 1

    import torch

    from tokenmill.engine.model.model_loader import weights_fingerprint

    full_bytes = sum(2 * math.prod(shape) for shape in llama7b_shapes(LAYERS).values())
    model = build_model(torch, args.layers)
    num_bytes = sum(p.nbytes for p in model.parameters())
    threads = args.threads or len(os.sched_getaffinity(0))
    rows, report = [], {"machine": machine_info(), "layers": args.layers, "bytes": num_bytes,
                        "full_model_bytes": full_bytes, "runs": {}}
    for label, workers in ((f"pool ({threads} threads)", threads), ("1 thread (baseline)", 1)):
        seconds = time_it(lambda workers=workers: weights_fingerprint(model, max_workers=workers), args.repeats)
        rate = num_bytes / seconds
        rows.append([label, num_bytes / 1e9, seconds, rate / 1e9, full_bytes / rate])
        report["runs"][label] = {"seconds": seconds, "bytes_per_s": rate, "projected_7b_seconds": full_bytes / rate}
    print_table(f"weights fingerprint: {args.layers} of {LAYERS} Llama-2-7B layers + embeddings, bfloat16 "
                f"(median of {args.repeats})", ["hashing", "GB hashed", "seconds", "GB/s",
                                                f"projected s, 7B ({full_bytes / 1e9:.1f} GB)"], rows)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
