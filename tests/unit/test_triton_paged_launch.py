"""How the Triton attention kernels (engine/kernels/attention/triton_paged.py) are launched, recorded around
the real kernels, and what they compute against the reference (gather + SDPA):

- a split decode launches the same kernels, grids and compile-time constants whatever its contexts
  (an eager step compiles them once, not once per longest context), and a captured step, which knows
  only its block table's width, launches exactly what the eager step of the same batch does;
- the prefill/mixed kernel's grid has one program per query block of the step (a flat index each
  program maps back to its sequence), not sequences x the longest query's blocks;
- mixed batches of decodes and prefill chunks of different lengths, and split decodes with contexts
  shorter than one segment, at segment bounds and longer than a sixteenth of the block table.

Runs in Triton's interpreter on the CPU (tests/triton_interpreter.py) and, with CUDA, compiled (``gpu``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.triton_interpreter import HAS_TRITON, triton_module
from tests.unit.test_attention_backends import metadata, on_device
from tests.unit.test_attention_kernel import make_batch
from tokenmill.engine.kernels.attention.reference import paged_attention

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its interpreter on the CPU)")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
SPLIT_HEADS = (8, 2, 64)  # GQA group 4
SPLIT_SMS = 16  # one sequence x 2 kv heads is far under 2 programs per multiprocessor: the decode splits
# Decodes and prefill chunks of different lengths over contexts from 1 to past a sixteenth of a
# 256-block table; chunks of 17, 64 and 100 tokens span several query blocks at every head layout.
MIXED = [(37, 1), (1, 1), (3000, 1), (129, 1), (150, 17), (64, 64), (300, 100), (20, 3), (5, 5)]


@dataclass
class Launch:
    kernel: str
    grid: tuple[int, ...]
    constants: dict[str, Any]  # the compile-time arguments (upper-case names): what a compilation is keyed by


class LaunchRecorder:
    """Stands in for the module's kernels (``*_kernel``): records every launch, then runs the real kernel."""

    def __init__(self, module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
        self.launches: list[Launch] = []
        for name, kernel in list(vars(module).items()):
            if name.endswith("_kernel") and hasattr(kernel, "__getitem__"):
                monkeypatch.setattr(module, name, _Recorded(name, kernel, self.launches))

    def take(self) -> list[Launch]:
        launches, self.launches[:] = list(self.launches), []
        return launches


class _Recorded:
    def __init__(self, name: str, kernel: Any, launches: list[Launch]) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            constants = {key: value for key, value in kwargs.items() if key.isupper()}
            self.launches.append(Launch(self.name, tuple(grid), constants))
            return self.kernel[grid](*args, **kwargs)

        return launch


def attend(module: ModuleType, args: dict[str, Any], specs: list[tuple[int, int]], num_sms: int,
           max_seq_len: int | None = None) -> torch.Tensor:
    """The Triton backend's attention; ``max_seq_len``: what the step's metadata says (a captured step
    passes its block table's width), else the longest context."""
    meta = metadata(args, specs)
    if max_seq_len is not None:
        meta.max_seq_len = max_seq_len
    backend = module.TritonBackend(num_sms=num_sms)
    out: torch.Tensor = backend.attend(args["query"], args["key_cache"], args["value_cache"], meta, args["scale"])
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_split_decode_launches_the_same_kernels_for_every_context(device: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Contexts of 20, 150 and 3000 tokens at batch 1: one launch of the segments and one of their merge,
    with the same grids and constants (no recompilation as the context grows), each matching the reference."""
    module = triton_module(device)
    recorder = LaunchRecorder(module, monkeypatch)
    per_context = []
    for context in [20, 150, 3000]:
        specs = [(context, 1)]
        host = make_batch(specs, SPLIT_HEADS, 16, torch.float32, seed=context)
        out = attend(module, on_device(host, device), specs, SPLIT_SMS)
        torch.testing.assert_close(out.cpu(), paged_attention(**host), atol=1e-5, rtol=1e-5)
        per_context.append(recorder.take())
    assert len(per_context[0]) == 2, per_context[0]  # split: the segments, then their merge
    assert per_context[1] == per_context[0], per_context
    assert per_context[2] == per_context[0], per_context


@pytest.mark.parametrize("device", DEVICES)
def test_captured_width_launches_what_the_eager_step_does(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured decode step sees a block table 256 blocks wide (4096 positions) and passes that width as
    its longest context; with a 150-token context it must launch exactly what the eager step (longest
    context 150) launches, and so give bit-identical results, equal to the reference."""
    module = triton_module(device)
    recorder = LaunchRecorder(module, monkeypatch)
    specs = [(150, 1), (7, 1)]
    host = make_batch(specs, SPLIT_HEADS, 16, torch.float32, seed=9)
    wide = torch.zeros(len(specs), 256, dtype=torch.int32)  # StaticDecode's table: padded with block 0
    wide[:, : host["block_tables"].shape[1]] = host["block_tables"]
    host["block_tables"] = wide
    args = on_device(host, device)
    eager = attend(module, args, specs, SPLIT_SMS)
    eager_launches = recorder.take()
    captured = attend(module, args, specs, SPLIT_SMS, max_seq_len=wide.shape[1] * 16)
    assert recorder.take() == eager_launches
    assert len(eager_launches) == 2, eager_launches  # the split path, as a captured step of batch 2 takes it
    assert torch.equal(captured, eager)
    torch.testing.assert_close(eager.cpu(), paged_attention(**host), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [(4, 4, 32), (9, 3, 64), (6, 1, 64)])
def test_mixed_grid_has_one_program_per_query_block(device: str, heads: tuple[int, int, int],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step launches (query blocks of the step) x kv heads programs: each sequence's
    ``cdiv(q_len, BLOCK_Q)``, up to less than one block per prefill chunk the host cannot count without
    the query lengths (``(T - S) // BLOCK_Q + S``, from the shapes alone; exact for decode rows), far
    fewer than sequences x the longest query's blocks."""
    module = triton_module(device)
    recorder = LaunchRecorder(module, monkeypatch)
    host = make_batch(MIXED, heads, 16, torch.float32, seed=4)
    out = attend(module, on_device(host, device), MIXED, num_sms=1)
    torch.testing.assert_close(out.cpu(), paged_attention(**host), atol=1e-5, rtol=1e-5)
    [launch] = recorder.take()
    block_q = launch.constants["BLOCK_Q"]
    tokens, sequences, num_kv_heads = sum(q for _, q in MIXED), len(MIXED), heads[1]
    blocks = sum(-(-q // block_q) for _, q in MIXED)
    chunks = sum(1 for _, q in MIXED if q > 1)
    assert math.prod(launch.grid) == num_kv_heads * ((tokens - sequences) // block_q + sequences), launch
    assert num_kv_heads * blocks <= math.prod(launch.grid) < num_kv_heads * (blocks + chunks), (launch, blocks)
    longest = max(-(-q // block_q) for _, q in MIXED)
    assert math.prod(launch.grid) < num_kv_heads * sequences * longest


@pytest.mark.parametrize("device", DEVICES)
def test_unsplit_decode_grid_is_one_program_per_sequence(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough decode rows to fill the multiprocessors: no split, one program per (row, kv head)."""
    module = triton_module(device)
    recorder = LaunchRecorder(module, monkeypatch)
    specs = [(40, 1), (1, 1), (300, 1), (17, 1), (64, 1)]
    host = make_batch(specs, SPLIT_HEADS, 4, torch.float32, seed=8)
    out = attend(module, on_device(host, device), specs, num_sms=1)
    torch.testing.assert_close(out.cpu(), paged_attention(**host), atol=1e-5, rtol=1e-5)
    [launch] = recorder.take()
    assert math.prod(launch.grid) == len(specs) * SPLIT_HEADS[1], launch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4, 32), (9, 3, 64), (8, 2, 40), (6, 1, 64)])
def test_mixed_batches_match_the_reference(device: str, heads: tuple[int, int, int], dtype: torch.dtype) -> None:
    module = triton_module(device)
    host = make_batch(MIXED, heads, 16, dtype, seed=heads[0])
    out = attend(module, on_device(host, device), MIXED, num_sms=1)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu(), paged_attention(**host), atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_split_decode_at_segment_bounds_matches_the_reference(device: str, dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode contexts around the segment bounds: shorter than one segment, one position either side of
    a full first segment, of every segment at its shortest and at the next tile-rounded length, and
    longer; every segment past a context is skipped by both kernels."""
    module = triton_module(device)
    shortest, segments, tile = module.MIN_SEGMENT, module.NUM_SEGMENTS, module.TILE_N
    contexts = [1, 20, shortest - 1, shortest, shortest + 1, segments * shortest, segments * shortest + 1,
                segments * (shortest + tile), segments * (shortest + tile) + 1, 3000]
    specs = [(context, 1) for context in contexts]
    recorder = LaunchRecorder(module, monkeypatch)
    host = make_batch(specs, SPLIT_HEADS, 16, dtype, seed=11)
    out = attend(module, on_device(host, device), specs, num_sms=SPLIT_SMS)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu(), paged_attention(**host), atol=tol, rtol=tol)
    segments_launch, merge_launch = recorder.take()
    assert segments_launch.grid == (len(specs), SPLIT_HEADS[1], segments), segments_launch
    assert merge_launch.grid == (len(specs), SPLIT_HEADS[0]), merge_launch
