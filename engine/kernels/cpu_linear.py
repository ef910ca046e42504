"""Faster linear layers on CPU: weights packed once into the layout their kernel multiplies in.

A loading helper (may import torch). oneDNN multiplies in a blocked weight layout (AMX tiles for
bfloat16, AVX-512 panels for float32); handed a plain weight it re-lays it out on every call,
which triples the memory traffic of a decode step, where every weight is read once: so weights
are packed once, at load time. On CPUs without AVX-512 layers use the engine's own panel kernel
(engine/kernels/panel_linear) instead: oneDNN has no bfloat16 path there (torch falls back to a
scalar loop, several times slower than float32) and its float32 is slower than the panels at
decode sizes. So do bfloat16 layers on CPUs that multiply bfloat16 pairs natively: with AMX the
panel kernel multiplies on the tile unit and streams the weights faster than oneDNN at decode
sizes; with AVX512-BF16 alone it multiplies by VDPBF16PS dot products on AMD and by widening FMAs
on Intel (whose VDPBF16PS issues at half the FMA rate). And float32 on AMD's AVX-512 CPUs, where
oneDNN's inner product is slower at decode sizes.
NOTE: where oneDNN packs float32, MKL's plain GEMV is faster at one or two tokens, but keeping
both weights would double the model's memory; the packed weight alone is kept. Results differ
from the plain path only in float rounding.

Sibling projections that read the same input (an attention's q/k/v, an MLP's gate/up) share one
packed weight: one call instead of three or two, which at decode sizes is dominated by per-call
cost.
NOTE: measurements behind these choices: ops/bench/README.md (its per-machine sections and
"Figures behind the kernels' comments").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.kernels import panel_linear
from tokenmill.engine.kernels.cpp_build import cpu_flags, cpu_vendor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinearKernel:
    """How packed layers multiply: ``pack(weight)`` once, then ``run(x, packed, bias, out_features)``."""

    name: str  # "onednn" | "panels"
    pack: Callable[[torch.Tensor], torch.Tensor]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]


# NOTE: oneDNN's packed linear has no public torch API: these private ATen ops are the ones torch's
# own inductor packs and runs its CPU linears with.
def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # noqa: SLF001 - see NOTE
    return out


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, None)  # noqa: SLF001 - see NOTE
    return packed


ONEDNN = LinearKernel("onednn", _onednn_pack, _onednn_linear)
PANELS = LinearKernel("panels", panel_linear.pack_weight, panel_linear.linear)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` packed for its kernel; shares the bias with the wrapped layer.

    The plain weight is dropped: :attr:`weight` only describes it (a meta tensor of its shape
    and dtype), so code that reads its dtype or shape still works and code that reads its
    values fails loudly. A weight other modules share (a tied LM head) stays with them.
    """

    def __init__(self, linear: nn.Linear, kernel: LinearKernel = ONEDNN) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.bias = linear.bias
        self.kernel = kernel
        weight = linear.weight.detach()
        self.packed_weight = kernel.pack(weight)
        self._meta = torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    @property
    def weight(self) -> torch.Tensor:
        return self._meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.run(x, self.packed_weight, self.bias, self.out_features)


# Names of nn.Linear children of one module that Hugging Face decoders call on the same input.
SIBLING_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedSiblings:
    """One packed weight for sibling layers; each :class:`SiblingSlice` returns its columns.

    The first sibling called with an input computes every sibling's output; the others, called with
    the same tensor object in the same round, take their slice of it. Any other call order (a
    different input, a sibling called twice) just computes again, so results never depend on
    the order the model calls them in.
    """

    def __init__(self, linears: list[nn.Linear], kernel: LinearKernel = ONEDNN) -> None:
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.kernel = kernel
        self.packed_weight: torch.Tensor = kernel.pack(weight)
        biases = [linear.bias for linear in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else weight.new_zeros(linear.out_features)
             for b, linear in zip(biases, linears)])
        self.sizes = [linear.out_features for linear in linears]
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._served: set[int] = set()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if x is not self._input or index in self._served:
            out = self.kernel.run(x, self.packed_weight, self.bias, sum(self.sizes))
            self._input, self._outputs, self._served = x, torch.split(out, self.sizes, dim=-1), set()
        result = self._outputs[index]
        self._served.add(index)
        if len(self._served) == len(self.sizes):  # the round is over: hold no activations
            self._input, self._outputs = None, ()
        return result


class SiblingSlice(nn.Module):
    """One sibling of a :class:`FusedSiblings` group, standing where its ``nn.Linear`` was."""

    def __init__(self, group: FusedSiblings, index: int, linear: nn.Linear) -> None:
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._meta = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta")

    @property
    def weight(self) -> torch.Tensor:
        return self._meta

    @property
    def packed_weight(self) -> torch.Tensor:
        """The group's packed weight, of which this sibling's :attr:`weight` is the share."""
        return self.group.packed_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)


def packing_works(dtype: torch.dtype, kernel: LinearKernel = ONEDNN) -> bool:
    """Whether ``kernel`` packs ``dtype`` layers on this CPU and build (a small layer, checked
    against the plain one)."""
    if kernel is ONEDNN and not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if kernel is PANELS and not panel_linear.is_available():
        return False
    try:
        linear = nn.Linear(64, 32).to(dtype)
        x = torch.randn(3, 64).to(dtype)
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        packed = PackedLinear(linear, kernel)
        return bool(torch.allclose(packed(x).float(), linear(x).float(), atol=tolerance, rtol=tolerance))
    except (RuntimeError, AttributeError):  # op missing or unsupported on this build / CPU
        return False


def _bfloat16_native(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is bfloat16 on an AVX-512 CPU that multiplies bfloat16 natively (AVX512-BF16,
    AMX). There the panel kernel leads (panel_linear.bfloat16_path): on the AMX tile unit it streams
    the weights near the memory's read rate at decode sizes, where oneDNN's inner product is
    slower; by VDPBF16PS dot products on AMD; on Intel without a usable tile unit it widens into
    float32 FMAs, where oneDNN's dot products issue at half their rate. Reads the CPU's flags;
    builds nothing."""
    flags = cpu_flags().split()
    return (dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and ("amx_bf16" in flags or "avx512_bf16" in flags))


def _prefers_panels(dtype: torch.dtype) -> bool:
    """Whether the panel kernel goes first for ``dtype`` (builds nothing): wherever ATen does not
    run AVX-512 (there oneDNN has no bfloat16 path and its float32 is slower at decode sizes),
    for bfloat16 where the CPU multiplies it natively (:func:`_bfloat16_native`), and for float32 on
    AMD's AVX-512 CPUs (Zen 4 and later): there oneDNN's inner product is slower per call at a few
    rows, and decode steps at small batches are faster on the panels, level at large ones."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or _bfloat16_native(dtype):
        return True
    return dtype == torch.float32 and cpu_vendor() == "AuthenticAMD"


KERNELS = {"onednn": ONEDNN, "panels": PANELS}  # by the name ``[engine.execution] linear_kernel`` gives


def kernel_for(dtype: torch.dtype, choice: str = "auto") -> LinearKernel | None:
    """The kernel that packs ``dtype`` layers here.

    Args:
        choice: ``auto``: the faster one for this CPU (see :func:`_prefers_panels`), the other one if
            the first cannot; ``onednn`` / ``panels``: that one; ``off``: none.

    Returns:
        The kernel; None: layers stay plain ``nn.Linear`` (``off``, or ``auto`` where neither packs).

    Raises:
        ModelLoadError: a kernel named by ``choice`` cannot pack ``dtype`` on this CPU and build.
    """
    if choice == "off":
        return None
    if choice != "auto":
        kernel = KERNELS[choice]
        if not packing_works(dtype, kernel):
            raise ModelLoadError(f"linear_kernel = {choice!r} cannot pack {dtype} layers on this CPU/build; "
                                 "use 'auto' or 'off'")
        return kernel
    order = (PANELS, ONEDNN) if _prefers_panels(dtype) else (ONEDNN, PANELS)
    return next((kernel for kernel in order if packing_works(dtype, kernel)), None)


def prebuild_kernel_for(dtype: torch.dtype, choice: str = "auto") -> None:
    """Start building the panel kernel now if ``dtype`` layers may use it (``engine.kernels.cpp_build``:
    builds overlap the model's loading)."""
    if dtype not in (torch.float32, torch.bfloat16) or choice in ("off", "onednn"):
        return
    if choice == "panels" or _prefers_panels(dtype) or not packing_works(dtype, ONEDNN):
        panel_linear.build_in_background()


def pack_linears(model: nn.Module, choice: str = "auto") -> int:
    """Replace the ``nn.Linear`` layers of a float32 or bfloat16 CPU model in place with packed ones
    (:func:`kernel_for` picks the kernel; the choice is logged once, here).

    Returns:
        How many layers were replaced (0: ``off``, another dtype, or no kernel packs it here).

    Raises:
        ModelLoadError: ``choice`` names a kernel that cannot pack this model's dtype here.
    """
    # NOTE: no list of the layers or their weights here: each plain layer is freed as soon as it is replaced, so
    # packing holds one layer twice at a time, not the whole model (a tensor-parallel rank's peak is its shard)
    first = next((m.weight for m in model.modules() if type(m) is nn.Linear), None)
    if first is None or first.device.type != "cpu" or first.dtype not in (torch.float32, torch.bfloat16):
        return 0
    dtype = first.dtype
    del first
    kernel = kernel_for(dtype, choice)
    if kernel is None:
        logger.info("linear layers: plain nn.Linear for %s (linear_kernel=%s%s)", dtype, choice,
                    "" if choice == "off" else ": no packed kernel here")
        return 0
    replaced = 0
    for parent in [m for m in model.modules() if type(m) is not nn.Linear]:
        replaced += _fuse_siblings(parent, dtype, kernel)
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == dtype:
                setattr(parent, name, PackedLinear(child, kernel))
                replaced += 1
    logger.info("linear layers: %d packed for %s (%s, linear_kernel=%s)", replaced, kernel.name, dtype, choice)
    return replaced


def _fuse_siblings(parent: nn.Module, dtype: torch.dtype, kernel: LinearKernel) -> int:
    """Replace each complete sibling group among ``parent``'s children; returns layers replaced."""
    replaced = 0
    for names in SIBLING_GROUPS:
        linears = [getattr(parent, name, None) for name in names]
        if not all(type(m) is nn.Linear and m.weight.dtype == dtype for m in linears):
            continue
        group_linears: list[nn.Linear] = linears  # type: ignore[assignment]
        if len({m.in_features for m in group_linears}) != 1:
            continue
        group = FusedSiblings(group_linears, kernel)
        for index, (name, linear) in enumerate(zip(names, group_linears)):
            setattr(parent, name, SiblingSlice(group, index, linear))
        replaced += len(names)
    return replaced
