"""The process groups of a tensor-parallel engine, the same on every rank: one for the forward's
all-reduces (NCCL on CUDA, gloo on CPU; a short timeout, as every rank is inside the same step) and one
for rank 0's step messages (gloo over host tensors; no practical timeout, as a follower waits there for as
long as the engine idles).

On CPU the forward's all-reduces go through a shared-memory segment when rank 0 made one
(engine/model/shm_all_reduce.py: microseconds where gloo's loopback TCP takes about a millisecond); the gloo
group is made either way and is the plain reference path.

The groups are made directly from a store (``ProcessGroupGloo(store, ...)``), not through
``torch.distributed.init_process_group``: no process-wide default group, so one process may hold several
tensor-parallel engines in turn (tests) or at once. Imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]  # public, not in __all__

from tokenmill.engine.errors import DeviceLost
from tokenmill.engine.model.shm_all_reduce import SharedMemoryAllReduce

# A collective inside a step: every rank is computing the same step, so a wait this long means a rank is gone
# or stuck (a rank that exits is noticed at once: its connections close).
STEP_TIMEOUT = timedelta(seconds=120)
IDLE_TIMEOUT = timedelta(days=365)  # a follower waiting for the next step
SETUP_TIMEOUT = timedelta(minutes=30)  # the store's: ranks meet once every one has loaded its shard


class TensorParallelLost(DeviceLost):
    """A collective failed: a rank exited, crashed or hangs. No step can run without every rank."""


class ProcessGroups:
    """One rank's groups, made by :meth:`connect` (after the rank has loaded its shard); the all-reduce the
    sharded layers were built with (engine/model/tensor_parallel.py) works from then on.

    Args:
        explain: says what became of the other ranks, for the message of a failed collective (rank 0's).
        check_peers: raises when another rank is gone (rank 0's: its followers' exit status), for waits in
            the shared-memory all-reduce, which no closed connection ends.
    """

    def __init__(self, rank: int, world_size: int, explain: Callable[[], str] | None = None,
                 check_peers: Callable[[], None] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._explain = explain
        self._check_peers = check_peers or (lambda: None)
        self._compute: Any = None
        self._control: Any = None
        self._shared_memory: SharedMemoryAllReduce | None = None

    @property
    def uses_shared_memory(self) -> bool:
        return self._shared_memory is not None

    def use_shared_memory(self, segment: Path) -> None:
        """Map the segment rank 0 made for the CPU all-reduce (engine/model/shm_all_reduce.py); every rank maps
        the same one before it reports ready, so a rank that cannot is reported like a failed load, and rank 0
        may unlink the segment once :meth:`connect` returns.

        Raises:
            OSError, ValueError: the segment cannot be mapped.
        """
        self._shared_memory = SharedMemoryAllReduce(
            segment, self.rank, self.world_size, self._check_peers, STEP_TIMEOUT.total_seconds(),
            lambda: self._lost("an all-reduce", TimeoutError(f"no answer in {STEP_TIMEOUT}")))

    def connect(self, store: Store, device: torch.device) -> None:
        """Meet the other ranks through ``store`` (each rank calls this once; it returns when all have)."""
        self._control = dist.ProcessGroupGloo(PrefixStore("control", store), self.rank, self.world_size,
                                              IDLE_TIMEOUT)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = STEP_TIMEOUT  # noqa: SLF001 - the options' only way to set it
            self._compute = dist.ProcessGroupNCCL(PrefixStore("compute", store), self.rank, self.world_size,
                                                  options)
        else:
            self._compute = dist.ProcessGroupGloo(PrefixStore("compute", store), self.rank, self.world_size,
                                                  STEP_TIMEOUT)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over every rank, in place.

        Raises:
            TensorParallelLost: a rank is gone or stuck.
        """
        if self._shared_memory is not None:
            self._shared_memory(tensor)
            return
        try:
            self._compute.allreduce([tensor]).wait()
        except RuntimeError as exc:
            raise self._lost("an all-reduce", exc) from exc

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's host ``tensor`` into every other rank's (same shape and dtype), in place.

        Raises:
            TensorParallelLost: a rank is gone.
        """
        try:
            self._control.broadcast(tensor, 0).wait()
        except RuntimeError as exc:
            raise self._lost("a step broadcast", exc) from exc

    def _lost(self, what: str, exc: Exception) -> TensorParallelLost:
        reason = " ".join(str(exc).split())
        states = f"; {self._explain()}" if self._explain is not None else ""
        return TensorParallelLost(f"tensor-parallel rank {self.rank}: {what} failed ({reason}){states}; "
                                  "the engine cannot step without every rank")
