"""The C++ CPU paged-attention kernels (``csrc/paged_attention_cpu.cpp``): builds them on first use
into a per-source, per-torch, per-CPU cache folder, loads them once per process and calls
``torch.ops.tokenmill.paged_attention`` / ``torch.ops.tokenmill.reshape_and_cache``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.engine.kernels.cpp_build import AMX_TILES_HEADER, CppExtension

# -march=native: the cache key includes the CPU's flags, so a binary is only loaded where built.
# -ffp-contract=fast: the micro-kernels' a * b + c become fused multiply-adds.
# No -fopenmp: the kernel registers through torch's stable ABI (torch/csrc/stable), whose
# parallel_for runs on torch's own thread pool; those headers also parse in a fraction of the
# time of torch/library.h.
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-DNDEBUG")


def _register_fakes() -> None:
    torch.library.register_fake("tokenmill::paged_attention", _fake_paged_attention)
    torch.library.register_fake("tokenmill::reshape_and_cache", _fake_reshape_and_cache)


_EXTENSION = CppExtension("tokenmill_paged_attention_cpu", Path(__file__).resolve().parent / "csrc" /
                          "paged_attention_cpu.cpp", _CFLAGS, what="CPU paged-attention kernel",
                          fallback="reference path used", after_load=_register_fakes, headers=(AMX_TILES_HEADER,))
build_directory = _EXTENSION.build_directory
build_in_background = _EXTENSION.build_in_background


def _fake_paged_attention(query: torch.Tensor, *_context: object) -> torch.Tensor:
    """Shape-only version of the op for torch.compile tracing (fake / meta tensors): the output
    has the query's shape, whatever the context (the other arguments of :func:`paged_attention`)."""
    return query.new_empty(query.shape)


def _fake_reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """The cache write returns nothing (its schema declares the cache mutations)."""


def is_available() -> bool:
    """Whether the kernel can be used: builds and loads it on the first call (thread-safe).

    Returns:
        False, after logging the reason once, when there is no C++ compiler or the build or
        load fails; callers then use the reference path.
    """
    return _EXTENSION.is_available()


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """The paged-attention op (engine/kernels/attention/metadata.py) on the CPU, in float32, float64, bfloat16 or
    float16.

    Raises:
        RuntimeError: the kernel is not available (check :func:`is_available` first), or an argument is outside
            the op's contract (the kernel checks each: shapes, dtypes, strides, offsets, block ids).
    """
    if not is_available():
        raise RuntimeError("the CPU paged-attention kernel is not available")
    out: torch.Tensor = torch.ops.tokenmill.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
    )
    return out


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write this step's keys and values into their cache slots, in place (``AttentionBackend.write_kv``, its
    arguments as engine/kernels/attention/metadata.py has them; key and value head_dim contiguous, any other
    strides); negative slots are skipped.

    Raises:
        RuntimeError: if the kernel is not available (check :func:`is_available` first).
    """
    if not is_available():
        raise RuntimeError("the CPU paged-attention kernel is not available")
    torch.ops.tokenmill.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
