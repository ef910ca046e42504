"""Host memory of a CPU engine's ranks, for ops/bench/tensor_parallel.py (Linux /proc only).

Each rank is a process (rank 0 the bench's own, a follower one it starts), so each has its own peak RSS: ``VmHWM``
in ``/proc/<pid>/status``. Rank 0's is reset before its engine loads (``/proc/self/clear_refs``, 5), its baseline
then being what the process already held (imports, earlier engines' freed heap); a follower's baseline is a fresh
interpreter's RSS after the follower's imports. Beside it: the bytes of the rank's part of the model as loaded (an
empty model cut to the rank, engine/model/meta_model.py), the bytes the rank holds once the CPU has packed its
linear layers (its packed weights, and a packed copy of an LM head tied to the embedding: rank 0's, the same shapes
on every rank), and its KV pool as resident (the CPU pools are lazy zeros, resident only where blocks were written:
``mincore`` over rank 0's; a follower writes the same blocks of a pool of the same shape).
"""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
from typing import Any

import torch

from ops.bench.common import REPO_ROOT


def reset_peak() -> int:
    """Reset this process's peak RSS to its RSS now, and return that (rank 0's baseline)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return status_bytes(os.getpid(), "VmRSS")


def status_bytes(pid: int, key: str) -> int:
    """A size from ``/proc/<pid>/status`` (``VmHWM``: the peak RSS; ``VmRSS``: now)."""
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(f"{key}:"))


def follower_baseline() -> int:
    """The RSS of a fresh interpreter that imported what a follower imports before it loads a model."""
    code = ("import os, tokenmill.engine.model.tp_follower, transformers.models.llama.modeling_llama; "
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS:')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return int(done.stdout.split()[-1])


def model_bytes(model: str, dtype: torch.dtype, rank: int, world_size: int) -> int:
    """Bytes of rank ``rank``'s part of ``model`` (a config file or directory): all of it with one rank."""
    from transformers import AutoConfig

    from tokenmill.engine.model.meta_model import empty_model, empty_shard
    from tokenmill.engine.model.tensor_parallel import Shard

    empty = empty_model(AutoConfig.from_pretrained(model), dtype, "sdpa")
    if world_size > 1:
        empty_shard(empty, Shard(rank, world_size, lambda tensor: None))
    return sum(t.nbytes for t in [*empty.parameters(), *empty.buffers()])


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes a loaded model holds: its parameters and buffers (not the meta stand-ins of packed layers) and its
    packed weights (engine/kernels/cpu_linear.py: a layer's own, or its sibling group's, counted once)."""
    packed: dict[int, int] = {}
    for module in model.modules():
        for holder in (module, getattr(module, "group", None)):
            weight = getattr(holder, "packed_weight", None)
            if isinstance(weight, torch.Tensor):
                packed[id(weight)] = weight.numel() * weight.element_size()
    plain = sum(t.nbytes for t in [*model.parameters(), *model.buffers()] if not t.is_meta)
    return plain + sum(packed.values())


def resident_bytes(tensor: torch.Tensor) -> int:
    """How much of a CPU tensor's memory is resident (``mincore`` over its pages)."""
    size = tensor.untyped_storage().nbytes()
    if not size:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() - tensor.data_ptr() % page
    length = tensor.data_ptr() + size - start
    pages = (ctypes.c_ubyte * ((length + page - 1) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(flag & 1 for flag in pages) * page


def rank_memory(engine: Any, model: str, dtype: torch.dtype, ranks: int, baseline: int,
                follower_base: int) -> list[dict[str, int]]:
    """Each rank's peak RSS, baseline, model bytes (as loaded, and held) and resident KV bytes, of a live ``engine``
    (before it closes)."""
    held = held_bytes(engine.runner.model)
    kv_cache = engine.runner.kv_cache
    kv = resident_bytes(kv_cache.device_pool) + resident_bytes(kv_cache.host_pool)
    leader = engine.runner.tensor_parallel
    pids = [os.getpid(), *(leader.follower_pids if leader is not None else [])]
    return [{"rank": rank, "pid": pid, "peak_rss": status_bytes(pid, "VmHWM"),
             "baseline": baseline if rank == 0 else follower_base,
             "model_bytes": model_bytes(model, dtype, rank, ranks), "held_bytes": held, "kv_bytes": kv}
            for rank, pid in enumerate(pids)]
