"""Every attention backend against the reference on random paged pools: block sizes 1/4/16, ragged
contexts, GQA/MQA, decodes mixed with prefill chunks over a cached prefix and first chunks, and the
strided per-layer pool views the engine passes. The backend's own write of the step's keys and
values is checked too.

Triton runs on CUDA, or in Triton's interpreter on the CPU when triton is installed (it is not in
the default environment: the CPU build of torch does not ship it).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

from engine.attention import AttentionBackend, AttentionMetadata, CpuKernelBackend, ReferenceBackend, cpu_kernel
from engine.attention.reference import paged_attention
from tests.unit.test_attention_kernel import make_batch

# (context length, query tokens): decodes first, then prefill chunks over a prefix, then first chunks.
SPECS = [(37, 1), (1, 1), (16, 1), (9, 1), (40, 7), (64, 20), (5, 5), (12, 12)]
HEADS = [(4, 4, 32), (9, 3, 64), (6, 1, 64), (8, 2, 40)]
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def metadata(args: dict[str, Any], specs: list[tuple[int, int]]) -> AttentionMetadata:
    seq_lens = [context for context, _ in specs]
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=args["block_tables"], seq_lens=args["seq_lens"],
        query_start_loc=args["query_start_loc"], num_decodes=sum(1 for _, q in specs if q == 1),
        max_seq_len=max(seq_lens), max_query_len=max(q for _, q in specs), seq_lens_host=seq_lens,
        query_start_host=args["query_start_loc"].tolist(),
    )


def backends() -> list[Any]:
    params: list[Any] = [pytest.param(ReferenceBackend, id="reference")]
    params.append(pytest.param(CpuKernelBackend, id="cpu", marks=pytest.mark.skipif(
        not cpu_kernel.is_available(), reason="the C++ kernel cannot be built here")))
    has_triton = importlib.util.find_spec("triton") is not None
    can_run = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    params.append(pytest.param("triton", id="triton", marks=pytest.mark.skipif(
        not (has_triton and can_run), reason="needs triton and CUDA (or TRITON_INTERPRET=1)")))
    return params


def make_backend(kind: Any) -> AttentionBackend:
    if kind == "triton":
        from engine.attention.triton_paged import TritonBackend

        return TritonBackend()
    backend: AttentionBackend = kind()
    return backend


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kind", backends())
def test_backend_matches_the_reference(kind: Any, block_size: int, heads: tuple[int, int, int],
                                       dtype: torch.dtype) -> None:
    args = make_batch(SPECS, heads, block_size, dtype, seed=block_size)
    meta = metadata(args, SPECS)
    expected = paged_attention(**args)
    out = make_backend(kind).attend(args["query"], args["key_cache"], args["value_cache"], meta, args["scale"])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_reference_groups_of_one_row_match() -> None:
    """The reference's CPU decode path in the smallest groups (one row each) changes nothing."""
    args = make_batch(SPECS, (9, 3, 64), 4, torch.float64, seed=7)
    meta = metadata(args, SPECS)
    backend = ReferenceBackend(cpu_chunk_bytes=1)
    out = backend.attend(args["query"], args["key_cache"], args["value_cache"], meta, args["scale"])
    torch.testing.assert_close(out, paged_attention(**args), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", backends())
def test_backend_writes_keys_and_values_at_their_slots(kind: Any) -> None:
    pool = torch.zeros(2, 2, 6, 4, 2, 8, dtype=torch.float64)
    key_cache, value_cache = pool[1, 0], pool[1, 1]
    key, value = torch.randn(5, 2, 8, dtype=torch.float64), torch.randn(5, 2, 8, dtype=torch.float64)
    slots = torch.tensor([3, 9, 10, 22, 0])
    make_backend(kind).write_kv(key, value, key_cache, value_cache, slots)
    flat_keys, flat_values = key_cache.reshape(-1, 2, 8), value_cache.reshape(-1, 2, 8)
    assert torch.equal(flat_keys[slots], key) and torch.equal(flat_values[slots], value)
    assert int((pool[0] != 0).sum()) == 0  # other layers untouched
