"""Every attention backend against the reference on random paged pools: block sizes 1/4/16, ragged
contexts, GQA/MQA, head widths 8 to 128, decodes mixed with prefill chunks over a cached prefix and
first chunks, and the strided per-layer pool views the engine passes; decodes over long contexts
that the Triton kernel splits into segments; a pool past 2^31 elements; the backend's own write
of the step's keys and values. (How the Triton kernels are launched: tests/unit/test_triton_paged_launch.py.)

Every case runs on the CPU (Triton in its interpreter, see tests/triton_interpreter.py) and, on a
machine with CUDA, on the GPU too (marked ``gpu``), with the same tensors moved there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.triton_interpreter import HAS_TRITON, triton_module
from tests.unit.test_attention_kernel import make_batch
from tokenmill.engine.kernels.attention import (
    AttentionBackend,
    AttentionMetadata,
    CpuKernelBackend,
    ReferenceBackend,
    cpu_kernel,
)
from tokenmill.engine.kernels.attention.reference import paged_attention
from tokenmill.engine.model.kv_cache import lazy_zeros

# (context length, query tokens): decodes first, then prefill chunks over a prefix, then first chunks.
SPECS = [(37, 1), (1, 1), (16, 1), (9, 1), (40, 7), (64, 20), (5, 5), (12, 12)]
HEADS = [(4, 4, 32), (9, 3, 64), (6, 1, 64), (8, 2, 40), (4, 2, 8)]
# Decode rows only, long and ragged: the Triton kernel splits them (see test_split_decode_...).
LONG_DECODES = [(1000, 1), (333, 1), (130, 1), (1, 1)]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}

ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NO_TRITON = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its interpreter on the CPU)")
NO_CPU_KERNEL = pytest.mark.skipif(not cpu_kernel.is_available(), reason="the C++ kernel cannot be built here")
CASES = [
    pytest.param("reference", "cpu", id="reference-cpu"),
    pytest.param("cpu", "cpu", id="cpu-cpu", marks=NO_CPU_KERNEL),
    pytest.param("triton", "cpu", id="triton-interpreter", marks=NO_TRITON),
    pytest.param("reference", "cuda", id="reference-cuda", marks=ON_CUDA),
    pytest.param("triton", "cuda", id="triton-cuda", marks=ON_CUDA),
]
TRITON_CASES = [c for c in CASES if c.values[0] == "triton"]


def metadata(args: dict[str, Any], specs: list[tuple[int, int]]) -> AttentionMetadata:
    seq_lens = [context for context, _ in specs]
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=args["query"].device), block_tables=args["block_tables"],
        seq_lens=args["seq_lens"], query_start_loc=args["query_start_loc"],
        num_decodes=sum(1 for _, q in specs if q == 1), max_seq_len=max(seq_lens),
        max_query_len=max(q for _, q in specs), seq_lens_host=seq_lens,
        query_start_host=args["query_start_loc"].tolist(),
    )


def on_device(args: dict[str, Any], device: str) -> dict[str, Any]:
    """``make_batch``'s arguments on ``device``; the caches stay strided views of one moved pool."""
    pool = args["key_cache"]._base.to(device)
    moved = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    return {**moved, "key_cache": pool[1, 0], "value_cache": pool[1, 1]}


def make_backend(kind: str, device: str, num_sms: int | None = None) -> AttentionBackend:
    if kind == "triton":
        backend: AttentionBackend = triton_module(device).TritonBackend(num_sms=num_sms)
        return backend
    return ReferenceBackend() if kind == "reference" else CpuKernelBackend()


def attend(kind: str, device: str, args: dict[str, Any], specs: list[tuple[int, int]],
           num_sms: int | None = None) -> torch.Tensor:
    return make_backend(kind, device, num_sms).attend(args["query"], args["key_cache"], args["value_cache"],
                                                      metadata(args, specs), args["scale"])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("kind", "device"), CASES)
def test_backend_matches_the_reference(kind: str, device: str, block_size: int, heads: tuple[int, int, int],
                                       dtype: torch.dtype) -> None:
    args = make_batch(SPECS, heads, block_size, dtype, seed=block_size)
    expected = paged_attention(**args)
    out = attend(kind, device, on_device(args, device), SPECS)
    assert out.device.type == device
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", [(8, 8, 64), (12, 4, 64), (8, 2, 128), (32, 8, 128)])
@pytest.mark.parametrize(("kind", "device"), CASES)
def test_bfloat16_matches_the_float32_reference(kind: str, device: str, heads: tuple[int, int, int]) -> None:
    """bfloat16 pools and queries, the reference computing in float32 on the same values."""
    args = make_batch(SPECS, heads, 16, torch.bfloat16, seed=heads[2])
    expected = paged_attention(**args)
    out = attend(kind, device, on_device(args, device), SPECS)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2, 8), (9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize(("kind", "device"), TRITON_CASES)
def test_split_decode_matches_the_reference(kind: str, device: str, heads: tuple[int, int, int],
                                            dtype: torch.dtype) -> None:
    """Long ragged decodes over few (sequence, kv head) pairs go through the segments and their merge;
    a short context leaves all segments but its first unused."""
    module = triton_module(device)
    num_sms = 64
    assert module.splits_decode(len(LONG_DECODES), heads[1], num_sms)
    args = make_batch(LONG_DECODES, heads, 16, dtype, seed=5)
    expected = paged_attention(**args)
    out = attend(kind, device, on_device(args, device), LONG_DECODES, num_sms=num_sms)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(("kind", "device"), TRITON_CASES)
def test_static_decode_width_splits_like_the_step(kind: str, device: str) -> None:
    """A captured step passes its block table's width as the longest context: the result must not depend
    on it (the launches do not either: tests/unit/test_triton_paged_launch.py)."""
    host_args = make_batch(LONG_DECODES, (8, 2, 64), 16, torch.float32, seed=6)
    expected = paged_attention(**host_args)
    args = on_device(host_args, device)
    meta = metadata(args, LONG_DECODES)
    meta.max_seq_len = 4096  # what StaticDecode passes: the table width in positions
    out = make_backend(kind, device, num_sms=16).attend(args["query"], args["key_cache"], args["value_cache"], meta,
                                                        args["scale"])
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@NO_TRITON
def test_split_decision_and_padded_heads() -> None:
    module = triton_module("cpu")
    assert not module.splits_decode(64, 8, 132)  # 512 programs already fill the GPU
    assert module.splits_decode(1, 8, 132)  # 8 programs on 132 multiprocessors
    assert module.splits_decode(16, 8, 132) and not module.splits_decode(33, 8, 132)  # under 2 per multiprocessor
    assert module.head_dim_padded(8) == 16 and module.head_dim_padded(40) == 64 and module.head_dim_padded(128) == 128


@pytest.mark.parametrize(("kind", "device"), CASES)
def test_block_offsets_past_two_to_the_31(kind: str, device: str) -> None:
    """A per-layer pool of more than 2^31 elements (over 8 GiB of float32): block id x block stride
    must be computed in 64 bits. On the CPU the pool is lazily zeroed memory, resident only where
    the test writes."""
    block_size, num_kv_heads, head_dim = 16, 1, 64
    num_blocks = (1 << 31) // (block_size * num_kv_heads * head_dim) + 8
    if device == "cpu":
        pool = lazy_zeros((2, num_blocks, block_size, num_kv_heads, head_dim), torch.float32)
    else:
        pool = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, device=device)
    # NOTE: values of the case's own: a wrapped 32-bit offset must not find a previous case's pool there.
    gen = torch.Generator().manual_seed(sum(map(ord, kind + device)))
    high = torch.arange(num_blocks - 6, num_blocks, dtype=torch.int32)  # every offset past 2^31
    pool[:, high.long()] = torch.randn(2, len(high), block_size, num_kv_heads, head_dim, generator=gen).to(device)
    specs = [(80, 1), (50, 3)]
    tables = torch.stack([high[:5], torch.cat([high[3:6], high[:2]])]).to(device)
    args = {"query": torch.randn(4, 2, head_dim, generator=gen).to(device), "key_cache": pool[0],
            "value_cache": pool[1], "block_tables": tables,
            "seq_lens": torch.tensor([80, 50], dtype=torch.int32, device=device),
            "query_start_loc": torch.tensor([0, 1, 4], dtype=torch.int32, device=device), "scale": 0.125}
    expected = paged_attention(**args)
    out = attend(kind, device, args, specs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert float(out.abs().sum()) > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
def test_reference_makes_its_tensors_on_the_inputs_device(device: str) -> None:
    """Positions and masks follow the query's device, not torch's default one (a CPU ``arange``
    beside CUDA tensors failed every prefill on a GPU): here the default device is ``meta``."""
    args = on_device(make_batch(SPECS, (9, 3, 64), 4, torch.float32, seed=1), device)
    expected = attend("reference", device, args, SPECS)
    with torch.device("meta"):
        out = attend("reference", device, args, SPECS)
    assert out.device == expected.device
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_reference_prefill_reads_the_host_lists_of_the_step() -> None:
    """Prefill chunks are sized from the metadata's host lists, built once per step: no layer reads
    context lengths back from the device (here those tensors live on ``meta`` and cannot be read)."""
    specs = [(40, 7), (64, 20), (5, 5)]
    args = make_batch(specs, (9, 3, 64), 4, torch.float64, seed=2)
    meta = metadata(args, specs)
    meta.seq_lens, meta.query_start_loc = meta.seq_lens.to("meta"), meta.query_start_loc.to("meta")
    out = ReferenceBackend().attend(args["query"], args["key_cache"], args["value_cache"], meta, args["scale"])
    torch.testing.assert_close(out, paged_attention(**args), atol=0, rtol=0)


def test_reference_groups_of_one_row_match() -> None:
    """The reference's CPU decode path in the smallest groups (one row each) changes nothing."""
    args = make_batch(SPECS, (9, 3, 64), 4, torch.float64, seed=7)
    meta = metadata(args, SPECS)
    backend = ReferenceBackend(cpu_chunk_bytes=1)
    out = backend.attend(args["query"], args["key_cache"], args["value_cache"], meta, args["scale"])
    torch.testing.assert_close(out, paged_attention(**args), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(("kind", "device"), CASES)
def test_backend_writes_keys_and_values_at_their_slots(kind: str, device: str) -> None:
    pool = torch.zeros(2, 2, 6, 4, 2, 8, dtype=torch.float64, device=device)
    key_cache, value_cache = pool[1, 0], pool[1, 1]
    key = torch.randn(5, 2, 8, dtype=torch.float64, device=device)
    value = torch.randn(5, 2, 8, dtype=torch.float64, device=device)
    slots = torch.tensor([3, 9, 10, 22, 0], device=device)
    make_backend(kind, device).write_kv(key, value, key_cache, value_cache, slots)
    flat_keys, flat_values = key_cache.reshape(-1, 2, 8), value_cache.reshape(-1, 2, 8)
    assert torch.equal(flat_keys[slots], key) and torch.equal(flat_values[slots], value)
    assert int((pool[0] != 0).sum()) == 0  # other layers untouched
