"""The C++ CPU paged-attention kernels (``csrc/paged_attention_cpu.cpp``): builds them on first use
into a per-source, per-torch, per-CPU cache folder, loads them once per process and calls
``torch.ops.tokenmill.paged_attention`` / ``torch.ops.tokenmill.reshape_and_cache``.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
_NAME = "tokenmill_paged_attention_cpu"
# -march=native: the cache key includes the CPU's flags, so a binary is only loaded where built.
# -ffp-contract=fast: the micro-kernels' a * b + c become fused multiply-adds.
# No -fopenmp: the kernel registers through torch's stable ABI (torch/csrc/stable), whose
# parallel_for runs on torch's own thread pool; those headers also parse in a fraction of the
# time of torch/library.h.
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-DNDEBUG")

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet


def _cpu_flags() -> str:
    """The CPU's feature flags (x86 ``flags`` / Arm ``Features``), else the processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return " ".join(sorted(value.split()))
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension invokes on Linux


def build_directory() -> Path:
    """Where this source, torch build, compiler and CPU's binary lives (created on demand).

    ``$TOKENMILL_HOME/torch_extensions/<name>-<hash>``; ``TOKENMILL_HOME`` defaults to
    ``~/.cache/tokenmill``.
    """
    compiler_version = subprocess.run(
        [_compiler(), "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), str(torch.version.git_version).encode(),
                 platform.machine().encode(), _cpu_flags().encode(), compiler_version.encode(),
                 " ".join(_CFLAGS).encode()):
        key.update(part)
        key.update(b"\0")
    home = os.environ.get("TOKENMILL_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return Path(home) / "torch_extensions" / f"{_NAME}-{key.hexdigest()[:16]}"


def _build_and_load() -> None:
    """Compile (or reuse) the extension and load it into this process.

    NOTE: cpp_extension serialises builds in one folder with a lock *file* that stays behind if
    its builder is killed, blocking every later load forever. An flock (released by the kernel
    when its holder dies) is held around the whole build; whoever holds it may remove that file.
    """
    from torch.utils import cpp_extension

    if shutil.which(_compiler()) is None:
        raise RuntimeError(f"no C++ compiler ({_compiler()!r} not on PATH)")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not available")
    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "tokenmill.flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        start = time.perf_counter()
        cpp_extension.load(
            name=_NAME,
            sources=[str(_SOURCE)],
            extra_cflags=list(_CFLAGS),  # a copy: load() appends to its lists
            build_directory=str(folder),
            is_python_module=False,
        )
    logger.debug("paged-attention kernel ready in %.1f s (%s)", time.perf_counter() - start, folder)

    torch.library.register_fake("tokenmill::paged_attention", _fake_paged_attention)
    torch.library.register_fake("tokenmill::reshape_and_cache", _fake_reshape_and_cache)


def _fake_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Shape-only version of the op for torch.compile tracing (fake / meta tensors)."""
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
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            try:
                _build_and_load()
                _loaded = True
            except (RuntimeError, OSError, subprocess.SubprocessError, ImportError) as exc:
                lines = str(exc).strip().splitlines() or [type(exc).__name__]
                # A failed build's message ends with the compiler's errors: keep its head and tail.
                reason = "\n".join(lines if len(lines) <= 21 else [*lines[:1], "...", *lines[-20:]])
                logger.warning("CPU paged-attention kernel unavailable (reference path used): %s", reason)
                _loaded = False
        return _loaded


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context.

    Args:
        query: ``[T, heads, head_dim]``, head_dim contiguous; float32/float64/bfloat16/float16.
        key_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` (same dtype; may be a
            strided view into a larger pool, head_dim contiguous).
        value_cache: same shape and dtype as ``key_cache``.
        block_tables: int32 ``[S, max_blocks]``: the blocks of each sequence, in order.
        seq_lens: int32 ``[S]``: context length of each sequence including this step's tokens
            (whose keys/values are already in the cache).
        query_start_loc: int32 ``[S + 1]``: sequence ``s`` owns query rows
            ``query_start_loc[s] .. query_start_loc[s+1] - 1``, the last positions of its context.
        scale: softmax scale.

    Returns:
        ``[T, heads, head_dim]`` in the query's dtype.

    Raises:
        RuntimeError: if the kernel is not available (check :func:`is_available` first).
    """
    if not is_available():
        raise RuntimeError("the CPU paged-attention kernel is not available")
    out: torch.Tensor = torch.ops.tokenmill.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
    )
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write this step's keys and values into their cache slots (in place).

    Args:
        key: ``[T, kv_heads, head_dim]``, head_dim contiguous (any other strides).
        value: same shape as ``key``.
        key_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` (same dtype; may be a
            strided view into a larger pool, head_dim contiguous).
        value_cache: same shape and dtype as ``key_cache``.
        slot_mapping: int64 ``[T]``: token ``t`` goes to block ``slot // block_size``, offset
            ``slot % block_size``; negative slots are skipped.

    Raises:
        RuntimeError: if the kernel is not available (check :func:`is_available` first).
    """
    if not is_available():
        raise RuntimeError("the CPU paged-attention kernel is not available")
    torch.ops.tokenmill.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
