"""The all-reduce of CPU tensor-parallel ranks on one host, through a shared-memory segment instead of gloo.

Why: a forward makes two all-reduces per decoder layer (SmolLM2: 60 per step), each of a few KiB to a few MiB.
Gloo sends them over loopback TCP, about 0.5-1 ms apiece on a 2-core machine (ops/bench/README.md): more than the
layer's own compute, so two ranks stepped 2.7x slower than one. Here each rank copies its tensor into its slot of a
file in ``/dev/shm`` mapped by every rank, publishes a sequence number, waits (spinning) until every rank has
published the same one, and sums the slots in rank order: a few microseconds plus the copies, and every rank gets
bit-identical sums (gloo remains the plain reference path, ``[engine.model] tensor_parallel_cpu_all_reduce``,
and the tests compare the two).

Two sets of slots alternate by sequence parity: a rank writing round k + 2 into the set of round k knows every
other rank has left round k, since it saw them publish k + 1. A tensor larger than a slot is reduced in
slot-sized rounds. Memory order: on the CPUs this runs on (x86-64's total store order; the copy's threads
join before the sequence number is stored), a rank that reads a published number also reads the data written
before it. Imports torch.
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
SEGMENT_DATA_BYTES = 16 << 20  # the slots of every rank, both parities (containers' /dev/shm is often 64 MiB)
_FLAG_STRIDE = 8  # int64s between ranks' sequence numbers: one 64-byte cache line each
_SPINS_BEFORE_CHECK = 2048  # spins between looks at the clock (and, past CHECK_AFTER_S, at the peers)
CHECK_AFTER_S = 0.01  # a wait this long checks that the other ranks are still alive, every so often


def available() -> bool:
    """Whether this host has a shared-memory file system to map the segment from, on a CPU whose store order
    the protocol relies on (x86-64; elsewhere, e.g. ARM's weaker order, gloo)."""
    return platform.machine().lower() in ("x86_64", "amd64") and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def slot_bytes_for(world_size: int) -> int:
    """Bytes per rank and parity: larger tensors are reduced in rounds of this size (4 MiB for 2 ranks)."""
    return SEGMENT_DATA_BYTES // (2 * world_size) // 4096 * 4096


def create_segment(world_size: int) -> Path:
    """Make a zeroed segment for ``world_size`` ranks (rank 0); its path travels to them through the store. The
    caller unlinks it once every rank has mapped it (:func:`unlink_segment`).

    Raises:
        OSError: the shared-memory file system has no room (its pages are allocated here, so a full one fails now
            and not with a SIGBUS in a step).
    """
    path = SHM_DIR / f"tokenmill-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, _segment_bytes(world_size, slot_bytes_for(world_size)))
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(descriptor)
    return path


def unlink_segment(path: Path) -> None:
    """Remove the segment's name (the ranks' mappings stay valid until they exit)."""
    path.unlink(missing_ok=True)


def _segment_bytes(world_size: int, slot_bytes: int) -> int:
    return _flags_bytes(world_size) + 2 * world_size * slot_bytes


def _flags_bytes(world_size: int) -> int:
    return world_size * _FLAG_STRIDE * 8


class SharedMemoryAllReduce:
    """One rank's view of the segment: :meth:`__call__` sums a contiguous CPU tensor over every rank, in place.

    Args:
        path: the segment (:func:`create_segment`), mapped here.
        rank: this rank; every rank calls the same all-reduces in the same order with tensors of one shape
            and dtype (as a forward does).
        world_size: ranks.
        check_peers: raises when another rank is gone (rank 0: its followers' exit status); called while a
            wait lasts past :data:`CHECK_AFTER_S`.
        timeout_s: a wait this long raises ``on_timeout()``: a rank is stuck.
        on_timeout: the error to raise then.
    """

    def __init__(self, path: Path, rank: int, world_size: int, check_peers: Callable[[], None], timeout_s: float,
                 on_timeout: Callable[[], Exception]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes = slot_bytes_for(world_size)
        self._check_peers = check_peers
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout
        size = _segment_bytes(world_size, slot_bytes)
        if path.stat().st_size != size:
            raise ValueError(f"shared-memory segment {path}: {path.stat().st_size} bytes, expected {size}")
        self._buffer = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._flags = self._buffer[:_flags_bytes(world_size)].view(torch.int64)
        self._sequence = int(self._flags[rank * _FLAG_STRIDE])

    def __call__(self, tensor: torch.Tensor) -> None:
        if not tensor.is_contiguous():
            raise ValueError("the shared-memory all-reduce takes contiguous tensors")
        flat = tensor.view(-1)
        per_round = max(1, self.slot_bytes // flat.element_size())
        for start in range(0, flat.numel(), per_round):
            self._round(flat[start:start + per_round])

    def _slot(self, parity: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        offset = _flags_bytes(self.world_size) + (parity * self.world_size + rank) * self.slot_bytes
        return self._buffer[offset:offset + like.numel() * like.element_size()].view(like.dtype)

    def _round(self, chunk: torch.Tensor) -> None:
        self._sequence += 1
        parity = self._sequence % 2
        self._slot(parity, self.rank, chunk).copy_(chunk)
        self._flags[self.rank * _FLAG_STRIDE] = self._sequence
        for other in range(self.world_size):
            if other != self.rank:
                self._wait_for(other)
        torch.add(self._slot(parity, 0, chunk), self._slot(parity, 1, chunk), out=chunk)
        for other in range(2, self.world_size):
            chunk.add_(self._slot(parity, other, chunk))

    def _wait_for(self, other: int) -> None:
        flag = self._flags[other * _FLAG_STRIDE]
        if int(flag) >= self._sequence:
            return
        started = time.monotonic()
        while True:
            for _ in range(_SPINS_BEFORE_CHECK):
                if int(flag) >= self._sequence:
                    return
            waited = time.monotonic() - started
            if waited > CHECK_AFTER_S:
                self._check_peers()
                os.sched_yield()  # NOTE: a long wait (a peer still on its layer's compute) yields the core
            if waited > self._timeout_s:
                raise self._on_timeout()
