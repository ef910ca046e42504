"""The process groups of a tensor-parallel engine, the same on every rank: one for the forward's
all-reduces (NCCL on CUDA, gloo on CPU; a short timeout, as every rank is inside the same step) and one
for rank 0's step messages (gloo over host tensors; no practical timeout, as a follower waits there for as
long as the engine idles).

On CPU the forward's all-reduces go through a shared-memory segment when rank 0 made one
(engine/model/shm_all_reduce.py: microseconds where gloo's loopback TCP takes about a millisecond); the gloo
group is made either way and is the plain reference path.

*Steps that fail.* A step's forward makes the same all-reduces on every rank, in the same order, so one that
raises on one rank must not leave the others waiting in an all-reduce that will never pair, or pair it with the
next step's. Each rank counts a step's all-reduces (:meth:`ProcessGroups.begin_step`; the number and shape every
forward makes: :class:`~engine.model.tensor_parallel.ForwardShape`). A rank whose step fails makes the rest of them
with zeros (:meth:`ProcessGroups.fail_step`; its outputs are wrong then, and so are the others', which no one uses).
After its last all-reduce every rank joins a verdict, one more all-reduce of a flag per rank, so every rank learns
which ranks failed: rank 0 raises :class:`TensorParallelStepFailed` when a follower did, and the engine retries the
step's requests in halves (``Engine._isolate``), each half a step every rank runs, until the request it fails on is
found. A failure that leaves a rank unable to go on (a lost peer, a collective that fails) is
:class:`TensorParallelLost`, which no retry can mend.

The groups are made directly from a store (``ProcessGroupGloo(store, ...)``), not through
``torch.distributed.init_process_group``: no process-wide default group, so one process may hold several
tensor-parallel engines in turn (tests) or at once. Imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]  # public, not in __all__

from tokenmill.engine.errors import DeviceLost, EngineError, InvariantError
from tokenmill.engine.model.shm_all_reduce import SharedMemoryAllReduce
from tokenmill.engine.model.tensor_parallel import ForwardShape

# A collective inside a step: every rank is computing the same step, so a wait this long means a rank is gone
# or stuck (a rank that exits is noticed at once: its connections close).
STEP_TIMEOUT = timedelta(seconds=120)
IDLE_TIMEOUT = timedelta(days=365)  # a follower waiting for the next step
SETUP_TIMEOUT = timedelta(minutes=30)  # the store's: ranks meet once every one has loaded its shard


class TensorParallelLost(DeviceLost):
    """A collective failed: a rank exited, crashed or hangs. No step can run without every rank."""


class TensorParallelStepFailed(EngineError):
    """A step's forward failed on another rank (every rank failed the step together, and each can step again): the
    step's requests are retried in parts like any failed step's."""


@dataclass
class _Step:
    """A step's all-reduces still to make on this rank, and their size (elements)."""

    remaining: int
    numel: int


class ProcessGroups:
    """One rank's groups, made by :meth:`connect` (after the rank has loaded its shard); the all-reduce the
    sharded layers were built with (engine/model/tensor_parallel.py) works from then on.

    Args:
        explain: says what became of the other ranks, for the message of a failed collective (rank 0's).
        check_peers: raises when another rank is gone (rank 0's: its followers' exit status), for waits in
            the shared-memory all-reduce, which no closed connection ends.
        step_failed: the error to raise when other ranks failed a step this rank did not (rank 0's, given the
            ranks that failed); None: go on (a follower: rank 0 decides what happens next).
    """

    def __init__(self, rank: int, world_size: int, explain: Callable[[], str] | None = None,
                 check_peers: Callable[[], None] | None = None,
                 step_failed: Callable[[list[int]], Exception] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._explain = explain
        self._check_peers = check_peers or (lambda: None)
        self._step_failed = step_failed
        self._compute: Any = None
        self._control: Any = None
        self._shared_memory: SharedMemoryAllReduce | None = None
        self._device = torch.device("cpu")
        self._forward: ForwardShape | None = None
        self._step: _Step | None = None

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
        self._device = device
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

    def expect_forward(self, shape: ForwardShape) -> None:
        """The all-reduces each step's forward makes (told once the model is sharded): steps are counted from now."""
        self._forward = shape

    @property
    def in_step(self) -> bool:
        """Whether a step began (:meth:`begin_step`) whose all-reduces this rank has not all made."""
        return self._step is not None

    def begin_step(self, num_tokens: int) -> None:
        """A step's forward over ``num_tokens`` tokens begins on this rank: its all-reduces are counted, and the last
        one is followed by the ranks' verdict on the step (:meth:`all_reduce`).

        Raises:
            InvariantError: the previous step is still open (its failure was not settled with :meth:`fail_step`).
        """
        if self._forward is None:
            return
        if self._step is not None:
            raise InvariantError("tensor parallelism: a step began before the last one's all-reduces were all made")
        self._step = _Step(self._forward.num_all_reduces, num_tokens * self._forward.hidden_size)

    def fail_step(self) -> None:
        """This rank's step failed: make the all-reduces it had left (of zeros, which pair with the other ranks'),
        then the verdict that it failed. Nothing when its all-reduces were all made (the failure came after them,
        where no other rank waits for it).

        Raises:
            TensorParallelLost: a rank is gone or stuck, or this one cannot make its share.
        """
        step, shape = self._step, self._forward
        if step is None or shape is None:
            return
        self._step = None
        try:
            filler = torch.zeros(step.numel, dtype=shape.dtype, device=self._device)
        except RuntimeError as exc:  # NOTE: e.g. out of memory on the device: the others would wait for good
            raise self._lost("finishing a failed step's all-reduces", exc) from exc
        for _ in range(step.remaining):
            filler.zero_()
            self._reduce(filler)
        self._verdict(failed=True)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over every rank, in place. Inside a step (:meth:`begin_step`), its last all-reduce is
        followed by the verdict: every rank learns which ranks failed the step.

        Raises:
            TensorParallelLost: a rank is gone or stuck.
            TensorParallelStepFailed: (rank 0) the step's last all-reduce is made, and another rank failed the step.
        """
        self._reduce(tensor)
        step = self._step
        if step is not None:
            step.remaining -= 1
            if step.remaining <= 0:
                self._step = None
                self._verdict(failed=False)

    def _verdict(self, failed: bool) -> None:
        """One flag per rank, summed over every rank (through shared memory where the all-reduces go, else gloo on
        the host: on CUDA no device sync); raises when others failed and this rank says what that means."""
        flags = torch.zeros(self.world_size, dtype=torch.float64)
        flags[self.rank] = float(failed)
        if self._shared_memory is not None:
            self._shared_memory(flags)
        else:
            try:
                self._control.allreduce([flags]).wait()
            except RuntimeError as exc:
                raise self._lost("a step's verdict", exc) from exc
        failed_ranks = [rank for rank, flag in enumerate(flags.tolist()) if flag]
        if failed_ranks and not failed and self._step_failed is not None:
            raise self._step_failed(failed_ranks)

    def _reduce(self, tensor: torch.Tensor) -> None:
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
