"""Linear-layer microbenchmark: the kernels engine/kernels/cpu_linear.py can pack for, per call, measured in
the same run: torch's plain ``F.linear``, oneDNN with a packed weight, and the engine's panel kernel
(engine/kernels/panel_linear); for bfloat16 also each of the kernel's other paths that runs here
(panel_linear.BFLOAT16_PATHS: "panels" is the one this CPU gets).

    python ops/bench/linear.py                    # float32 and bfloat16 (~2 min on 2 cores)
    python ops/bench/linear.py --quick            # fewer shapes and repeats

Shapes: SmolLM2-135M's layers (hidden 576, MLP 1536, q/k/v fused 576+2x192, gate/up fused 2x1536,
LM head 49,152) at 1, 4, 16, 64 and 256 rows. Each layer's calls rotate over 30 copies of its
weight (one per decoder layer) so the weights come from memory as in a real forward, not from a
warm cache; the LM head is one weight (56-113 MB). Timing alternates the kernels in rounds and
reports the median per call. Kernels that cannot pack a dtype on this CPU are left out (oneDNN's
bfloat16 needs AVX-512), torch's plain bfloat16 is timed at up to 16 rows only (a scalar loop
without AVX-512: seconds per shape beyond).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# NOTE: run as a script, this folder comes first on sys.path: take it off and import the helpers as
# ops.bench.* from the repository root.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from ops.bench.common import fmt, machine_info, print_table, write_json

LAYERS = {"qkv 576->960": (576, 960), "o 576->576": (576, 576), "gate_up 576->3072": (576, 3072),
          "down 1536->576": (1536, 576), "lm_head 576->49152": (576, 49152)}
ROWS = (1, 4, 16, 64, 256)
COPIES = 30  # weights per layer shape, cycled through (one per decoder layer)
PLAIN_BF16_MAX_ROWS = 16


def time_calls(calls: dict[str, Callable[[int], Any]], copies: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each kernel; each round calls every kernel once per weight copy."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm-up: first-call allocations and dispatch
        call(0)
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for i in range(copies):
                call(i)
            samples[name].append((time.perf_counter() - start) / copies)
    return {name: statistics.median(values) for name, values in samples.items()}


def _other_bfloat16_paths() -> dict[str, Any]:
    """The panel kernel on each bfloat16 path other than this CPU's that runs here, by path name."""
    import torch

    from tokenmill.engine.kernels import panel_linear
    from tokenmill.engine.kernels.cpu_linear import LinearKernel, packing_works

    kernels = {path: LinearKernel(path, lambda w, path=path: panel_linear.pack_weight(w, path), panel_linear.linear)
               for path in panel_linear.BFLOAT16_PATHS if path != panel_linear.bfloat16_path()}
    return {path: kernel for path, kernel in kernels.items() if packing_works(torch.bfloat16, kernel)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and rounds")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    import torch
    from torch.nn import functional

    from tokenmill.engine.kernels import cpu_linear, panel_linear

    torch.set_num_threads(args.threads)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    layers = dict(list(LAYERS.items())[1::2]) if args.quick else LAYERS
    rows_list = (1, 16, 64) if args.quick else ROWS
    rounds = 3 if args.quick else 7
    kernels = {"onednn": cpu_linear.ONEDNN, "panels": cpu_linear.PANELS}
    paths = _other_bfloat16_paths() if "bfloat16" in dtypes else {}
    print(f"{machine_info()}; ATen capability {torch.backends.cpu.get_cpu_capability()}; "
          f"engine's choice: " + ", ".join(f"{d} {getattr(cpu_linear.kernel_for(getattr(torch, d)), 'name', 'plain')}"
                                            for d in dtypes)
          + f"; the panel kernel's bfloat16 path here: {panel_linear.bfloat16_path()}")
    results = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        usable = {name: k for name, k in kernels.items() if cpu_linear.packing_works(dtype, k)}
        if dtype == torch.bfloat16:
            usable.update(paths)
        for layer, (k_in, n_out) in layers.items():
            copies = 1 if n_out > 10_000 else COPIES
            gen = torch.Generator().manual_seed(0)
            weights = [(torch.randn(n_out, k_in, generator=gen) * 0.05).to(dtype) for _ in range(copies)]
            packed = {name: [k.pack(w) for w in weights] for name, k in usable.items()}
            for rows in rows_list:
                x = torch.randn(rows, k_in, generator=gen).to(dtype)
                calls: dict[str, Callable[[int], Any]] = {
                    name: (lambda i, k=k, p=packed[name], x=x, n_out=n_out: k.run(x, p[i], None, n_out))
                    for name, k in usable.items()}
                if dtype == torch.float32 or rows <= PLAIN_BF16_MAX_ROWS:
                    calls["plain"] = lambda i, x=x, w=weights: functional.linear(x, w[i])
                seconds = time_calls(calls, copies, rounds)
                row: dict[str, Any] = {"dtype": dtype_name, "layer": layer, "rows": rows,
                                       **{f"{name}_ms": 1e3 * s for name, s in seconds.items()}}
                if "onednn" in seconds and "panels" in seconds:
                    row["onednn_over_panels"] = seconds["onednn"] / seconds["panels"]
                results.append(row)
            del weights, packed
    columns = ["dtype", "layer", "rows", "plain_ms", "onednn_ms", "panels_ms", *(f"{p}_ms" for p in paths),
               "onednn_over_panels"]
    print_table("Per call (median; lower is better)",
                ["dtype", "layer", "rows", "plain ms", "oneDNN ms", "panels ms", *(f"{p} ms" for p in paths),
                 "oneDNN / panels"],
                [[fmt(r.get(c), 3) if c.endswith("_ms") else fmt(r.get(c), 2) for c in columns] for r in results])
    write_json(str(args.json) if args.json else None, {"machine": machine_info(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
