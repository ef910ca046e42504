"""bfloat16 linear layers for CPUs where oneDNN has no bfloat16 path (``csrc/bf16_linear_cpu.cpp``).

oneDNN packs and multiplies bfloat16 only with AVX-512 (or AVX-NE-CONVERT); elsewhere (AMD Zen 2/3,
older Intel) torch's bfloat16 matmul is a scalar loop: measured ~14 GFLOPS on 2 Zen 3 cores, a
seventh of oneDNN's float32, so a bfloat16 model ran several times slower than float32. This
kernel widens bfloat16 weights to float32 in registers and multiplies at float32's speed while
reading half the bytes. engine/cpu_linear.py uses it for bfloat16 layers when oneDNN cannot pack
them. Builds on first use like the other C++ parts; imports torch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.cpp_build import CppExtension

# -march=native: the cache key includes the CPU's flags. -ffp-contract=fast: a * b + c in the
# micro-kernel becomes one fused multiply-add.
_EXTENSION = CppExtension("tokenmill_bf16_linear_cpu", Path(__file__).resolve().parent / "csrc" /
                          "bf16_linear_cpu.cpp", ("-O3", "-march=native", "-ffp-contract=fast", "-DNDEBUG"),
                          what="bfloat16 linear kernel", fallback="bfloat16 linear layers use torch's matmul")
is_available = _EXTENSION.is_available
build_in_background = _EXTENSION.build_in_background


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out_features, in_features]`` in the kernel's panel layout (a new tensor)."""
    packed: torch.Tensor = torch.ops.tokenmill_bf16.pack_weight(weight.detach())
    return packed


def linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x W^T + b`` over the last axis of ``x`` (any leading shape), bfloat16 in and out."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out: torch.Tensor = torch.ops.tokenmill_bf16.linear(rows, packed_weight, bias, out_features)
    return out.view(*x.shape[:-1], out_features)
