"""Linear layers packed in panels (``csrc/panel_linear_cpu.cpp``): float32 and bfloat16 for CPUs
without AVX-512, and bfloat16 on CPUs that multiply bfloat16 pairs natively (AVX512-BF16, AMX).

There oneDNN has no bfloat16 path (torch's bfloat16 matmul is a scalar loop, a fraction of
oneDNN's float32 rate, so a bfloat16 model ran several times slower than float32), and torch's
oneDNN float32 inner product is slower than this kernel at decode sizes on SmolLM2's shapes. The
kernel streams each panel of 2 x vector-width output features front to back, widens bfloat16
weights to float32 in registers, and adds one fused multiply-add per k in order. With AMX,
bfloat16 layers multiply on the tile unit instead (float32 sums in k order), which streams the
weights faster than torch's oneDNN inner product at decode sizes; with AVX512-BF16 but no AMX, by
VDPBF16PS dot products on AMD, while Intel's, at half the FMA rate there, lose to the widening
FMAs (see :func:`bfloat16_path`).
engine/kernels/cpu_linear.py decides where it is used. Builds on first use like the other C++ parts;
imports torch.
NOTE: measurements behind these choices: ops/bench/README.md (its per-machine sections and
"Figures behind the kernels' comments").
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.engine.kernels.cpp_build import AMX_TILES_HEADER, CppExtension

# -march=native: the cache key includes the CPU's flags. -ffp-contract=fast: a * b + c in the
# micro-kernel becomes one fused multiply-add.
_EXTENSION = CppExtension("tokenmill_panel_linear_cpu", Path(__file__).resolve().parent / "csrc" /
                          "panel_linear_cpu.cpp", ("-O3", "-march=native", "-ffp-contract=fast", "-DNDEBUG"),
                          what="panel linear kernel", fallback="linear layers use oneDNN or torch's matmul",
                          headers=(AMX_TILES_HEADER,))
is_available = _EXTENSION.is_available
build_in_background = _EXTENSION.build_in_background
# How bfloat16 layers multiply (csrc: enum Bf16Path, in this order).
BFLOAT16_PATHS = ("widen", "avx512_bf16", "amx")


def pack_weight(weight: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """``weight`` ``[out_features, in_features]`` (float32 or bfloat16) in the kernel's layout (a new
    tensor, whose shape says the layout). ``path``: one of :data:`BFLOAT16_PATHS` for a bfloat16
    weight (default: :func:`bfloat16_path`'s choice); RuntimeError where it cannot run."""
    if path is not None and path not in BFLOAT16_PATHS:
        raise ValueError(f"unknown bfloat16 path {path!r}; one of {', '.join(BFLOAT16_PATHS)}")
    index = -1 if path is None else BFLOAT16_PATHS.index(path)
    packed: torch.Tensor = torch.ops.tokenmill_panel.pack_weight(weight.detach(), index)
    return packed


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x W^T + b`` over the last axis of ``x`` (any leading shape), in the weight's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out: torch.Tensor = torch.ops.tokenmill_panel.linear(rows, packed_weight, bias, out_features)
    return out.view(*x.shape[:-1], out_features)


def bfloat16_path() -> str:
    """How bfloat16 layers whose in_features is a multiple of 32 multiply here (and are packed for
    it): ``"amx"`` on the tile unit, ``"avx512_bf16"`` by VDPBF16PS dot products (AMD), ``"widen"``
    by float32 FMAs on widened weights (Intel without a usable tile unit, CPUs without AVX512-BF16,
    every bfloat16 layer whose in_features is not a multiple of 32, and where the kernel is not
    built)."""
    if not is_available():
        return "widen"
    return BFLOAT16_PATHS[int(torch.ops.tokenmill_panel.bfloat16_path())]
