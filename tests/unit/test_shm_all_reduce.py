"""The shared-memory all-reduce of CPU tensor-parallel ranks (engine/model/shm_all_reduce.py): three processes
sum tensors of several dtypes and sizes (some larger than a slot, so reduced in rounds) to what summing them
directly gives, every rank bit for bit the same; a wait for a rank that never comes ends through the peer
check or the timeout, never hangs."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from tokenmill.engine.model import shm_all_reduce

pytestmark = pytest.mark.skipif(not shm_all_reduce.available(), reason="no /dev/shm on this host")

WORLD_SIZE = 3
SMALL_SEGMENT = WORLD_SIZE * 2 * 4096  # one 4 KiB slot per rank and parity: 1,024 float32s per round
SHAPES = [(7,), (64, 48), (1500,), (3, 1025)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _inputs(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(shape, generator=generator).to(dtype) for dtype in DTYPES for shape in SHAPES]


def _rank(path: str, rank: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    shm_all_reduce.SEGMENT_DATA_BYTES = SMALL_SEGMENT
    reduce = shm_all_reduce.SharedMemoryAllReduce(Path(path), rank, WORLD_SIZE, lambda: None, 60.0,
                                                  lambda: TimeoutError("stuck"))
    tensors = _inputs(rank)
    for _ in range(3):  # the same tensors reduced in place three times: every round's parity is reused
        for tensor in tensors:
            reduce(tensor)
    # NOTE: as bytes: a tensor put on a queue shares its storage with a process that is about to exit
    results.put((rank, [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors]))


def test_three_ranks_sum_in_rounds_bit_identically(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_all_reduce, "SEGMENT_DATA_BYTES", SMALL_SEGMENT)
    assert shm_all_reduce.slot_bytes_for(WORLD_SIZE) == 4096
    path = shm_all_reduce.create_segment(WORLD_SIZE)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(str(path), rank, results)) for rank in range(WORLD_SIZE)]
    try:
        for process in processes:
            process.start()
        received = dict(results.get(timeout=120) for _ in range(WORLD_SIZE))
    finally:
        for process in processes:
            process.join(timeout=30)
        shm_all_reduce.unlink_segment(path)
    assert all(process.exitcode == 0 for process in processes)
    like = _inputs(0)
    got = {rank: [torch.frombuffer(bytearray(data), dtype=t.dtype).view(t.shape) for data, t in zip(datas, like)]
           for rank, datas in received.items()}
    expected = [sum(_inputs(rank)[i] for rank in range(WORLD_SIZE)) for i in range(len(SHAPES) * len(DTYPES))]
    for i, want in enumerate(expected):
        for _ in range(2):  # rounds two and three sum the previous sums
            want = want * WORLD_SIZE
        for rank in range(WORLD_SIZE):
            assert got[rank][i].dtype == want.dtype and got[rank][i].shape == want.shape
            assert torch.equal(got[rank][i], got[0][i]), f"rank {rank} differs from rank 0 (tensor {i})"
        tolerance = 1e-1 if want.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(got[0][i], want, rtol=tolerance, atol=tolerance)


def _lonely(check_peers: object, timeout_s: float) -> shm_all_reduce.SharedMemoryAllReduce:
    path = shm_all_reduce.create_segment(2)
    try:
        return shm_all_reduce.SharedMemoryAllReduce(path, 0, 2, check_peers, timeout_s,  # type: ignore[arg-type]
                                                    lambda: TimeoutError("rank 1 never came"))
    finally:
        shm_all_reduce.unlink_segment(path)


def test_a_gone_peer_ends_the_wait() -> None:
    def check_peers() -> None:
        raise RuntimeError("rank 1 exited")

    with pytest.raises(RuntimeError, match="rank 1 exited"):
        _lonely(check_peers, 60.0)(torch.ones(4))


def test_a_stuck_peer_times_out() -> None:
    with pytest.raises(TimeoutError, match="never came"):
        _lonely(lambda: None, 0.2)(torch.ones(4))


def test_refuses_a_strided_tensor() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        _lonely(lambda: None, 0.2)(torch.ones(4, 4).t())
