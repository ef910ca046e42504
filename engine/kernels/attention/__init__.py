"""Attention backends over the paged KV cache, behind one small interface: write this step's
keys and values into their slots, then attend every query row over its sequence's context.

- ``reference``: gather + SDPA, any device. The oracle every other backend is tested against.
- ``cpu``: a C++ kernel that reads the block pool in place (built on first use; needs a compiler).
- ``triton``: a Triton kernel for CUDA that reads the pool through the block table.

``auto`` picks the kernel of the device and falls back to ``reference``, saying why in the log.
Imports torch; the Triton module only on CUDA.
"""

from __future__ import annotations

import logging
from typing import Literal, Protocol

import torch

from tokenmill.engine.kernels.attention import cpu_kernel
from tokenmill.engine.kernels.attention.metadata import AttentionMetadata
from tokenmill.engine.kernels.attention.reference import ReferenceBackend

logger = logging.getLogger(__name__)

BackendName = Literal["auto", "reference", "cpu", "triton"]


class AttentionBackend(Protocol):
    """One step's attention in every layer; tensors are ``[tokens, heads, head_dim]``."""

    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store this step's keys and values (``[T, kv_heads, head_dim]``) at their slots."""

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of each query row (``[T, heads, head_dim]``) over its sequence's cache."""


class CpuKernelBackend:
    """The C++ kernel (``engine/kernels/attention/csrc``): no gather, no padding, one call per layer."""

    name = "cpu"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        cpu_kernel.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return cpu_kernel.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, scale)


def select_backend(name: BackendName, device: torch.device) -> AttentionBackend:
    """The backend ``name`` asks for on ``device``; ``auto``: the device's kernel, else ``reference``.

    Raises:
        ValueError: a backend that cannot run here was asked for by name.
    """
    if name == "reference":
        return ReferenceBackend()
    wanted = name if name != "auto" else ("triton" if device.type == "cuda" else "cpu")
    reason = _unavailable_reason(wanted, device)
    if reason is None:
        return CpuKernelBackend() if wanted == "cpu" else _triton_backend()
    if name != "auto":
        raise ValueError(f"attention backend {name!r} is not available: {reason}")
    logger.warning("attention backend %r unavailable (%s); using the reference (gather + SDPA)", wanted, reason)
    return ReferenceBackend()


def _unavailable_reason(name: str, device: torch.device) -> str | None:
    if name == "cpu":
        if device.type != "cpu":
            return f"it runs on the CPU, the model is on {device.type}"
        return None if cpu_kernel.is_available() else "the C++ kernel could not be built (see the log above)"
    if device.type != "cuda":
        return f"it runs on CUDA, the model is on {device.type}"
    try:
        import triton  # noqa: F401, PLC0415 - present with CUDA builds of torch
    except ImportError:
        return "triton is not installed"
    return None


def _triton_backend() -> AttentionBackend:
    from tokenmill.engine.kernels.attention.triton_paged import TritonBackend  # noqa: PLC0415 - imports triton

    return TritonBackend()


__all__ = ["AttentionBackend", "AttentionMetadata", "BackendName", "CpuKernelBackend", "ReferenceBackend",
           "select_backend"]
