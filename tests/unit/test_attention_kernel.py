"""The C++ CPU paged-attention kernel (engine/kernels/attention/cpu_kernel.py) against the plain-torch
reference (engine/kernels/attention/reference.py): random pools with shuffled block tables, ragged
contexts, GQA/MQA, mixed decode / chunked-prefill / first-chunk batches, three dtypes, and the
strided per-layer pool views the engine passes. Skipped when the kernel cannot be built here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenmill.engine.kernels.attention import cpu_kernel, reference

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (query heads, kv heads, head_dim): GQA groups 1, 3, 4, MQA, and a head_dim that is not a
# multiple of the SIMD width.
HEADS = [(4, 4, 32), (9, 3, 64), (8, 2, 128), (6, 1, 64), (4, 2, 40)]


@pytest.fixture(scope="module", autouse=True)
def _kernel() -> None:
    if not cpu_kernel.is_available():
        pytest.skip("the C++ paged-attention kernel is unavailable here (no C++ compiler or the build failed; "
                    "engine.kernels.attention.cpu_kernel logged why)")


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield int(request.param)
    torch.set_num_threads(before)


def make_batch(specs: list[tuple[int, int]], heads: tuple[int, int, int], block_size: int, dtype: torch.dtype,
               seed: int = 0) -> dict[str, Any]:
    """Arguments of the op for sequences given as (context length, query tokens).

    The pool is the engine's ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` tensor and the
    caches are ``pool[1, 0]`` / ``pool[1, 1]`` views; each sequence gets randomly chosen,
    non-contiguous blocks and its table row is padded with junk block ids.
    """
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    blocks = [(context + block_size - 1) // block_size for context, _ in specs]
    num_blocks = sum(blocks) + 5
    pool = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks) + 2
    tables = torch.randint(0, num_blocks, (len(specs), width), generator=gen, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = order[used : used + n].to(torch.int32)
        used += n
    query_start_loc = torch.tensor([0] + [q for _, q in specs], dtype=torch.int32).cumsum(0).to(torch.int32)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return {
        "query": query,
        "key_cache": pool[1, 0],
        "value_cache": pool[1, 1],
        "block_tables": tables,
        "seq_lens": torch.tensor([context for context, _ in specs], dtype=torch.int32),
        "query_start_loc": query_start_loc,
        "scale": head_dim**-0.5,
    }


def assert_matches_reference(args: dict[str, Any]) -> torch.Tensor:
    out = cpu_kernel.paged_attention(**args)
    expected = reference.paged_attention(**args)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    return out


def mixed_specs(block_size: int) -> list[tuple[int, int]]:
    """Decodes (context 1, exact multiples of the block size, ragged), chunks over a cached
    prefix, first chunks, and a sequence with no query this step."""
    return [
        (1, 1), (block_size, 1), (2 * block_size, 1), (37, 1), (150, 1),
        (120, 50), (3 * block_size + 5, block_size), (200, 70),
        (70, 70), (2, 2), (10, 0),
    ]


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "q{}-kv{}-d{}".format(*h))
@pytest.mark.parametrize(("dtype", "block_size"), [
    (torch.float64, 1), (torch.float64, 16), (torch.float32, 4), (torch.float32, 16), (torch.bfloat16, 4),
    (torch.bfloat16, 16),
], ids=lambda v: str(v).replace("torch.", ""))
def test_mixed_batch_matches_reference(heads: tuple[int, int, int], dtype: torch.dtype, block_size: int) -> None:
    assert_matches_reference(make_batch(mixed_specs(block_size), heads, block_size, dtype))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_long_contexts_split_across_threads(threads: int, dtype: torch.dtype) -> None:
    """A lone long decode and a chunk over a long prefix: with 2 threads the key ranges are cut
    into partitions (flash-decoding) whose partial softmaxes are merged; a lone decode over a few
    hundred keys is cut into short partitions too."""
    assert_matches_reference(make_batch([(3001, 1)], (9, 3, 64), 16, dtype, seed=1))
    assert_matches_reference(make_batch([(301, 1)], (9, 3, 64), 16, dtype, seed=4))
    assert_matches_reference(make_batch([(2500, 40), (1800, 1)], (8, 1, 64), 16, dtype, seed=2))


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128)], ids=lambda h: "q{}-kv{}-d{}".format(*h))
def test_long_bfloat16_prefill_chunks_match_reference(block_size: int, heads: tuple[int, int, int]) -> None:
    """Many-row bfloat16 tiles (on the AMX tile unit where the CPU has one): several tiles per
    sequence with a ragged last row block, long key chunks over a cached prefix, a short first chunk."""
    assert_matches_reference(make_batch([(700, 300), (260, 130), (5, 5)], heads, block_size, torch.bfloat16, seed=3))


def test_float16_matches_reference() -> None:
    args = make_batch(mixed_specs(16), (9, 3, 64), 16, torch.float16)
    out = cpu_kernel.paged_attention(**args)
    torch.testing.assert_close(out, reference.paged_attention(**args), atol=2e-2, rtol=2e-2)


def test_strided_query_and_contiguous_pool() -> None:
    """The query may be any [T, heads, head_dim] view with head_dim contiguous (the engine's
    query is a transpose of [1, heads, T, head_dim]); plain contiguous caches work too."""
    args = make_batch(mixed_specs(16), (9, 3, 64), 16, torch.float64)
    expected = cpu_kernel.paged_attention(**args)
    transposed = args["query"].transpose(0, 1).contiguous().transpose(0, 1)
    assert not transposed.is_contiguous()
    strided = dict(args, query=transposed, key_cache=args["key_cache"].contiguous(),
                   value_cache=args["value_cache"].contiguous())
    torch.testing.assert_close(cpu_kernel.paged_attention(**strided), expected, atol=0, rtol=0)


def test_rejects_inconsistent_inputs() -> None:
    args = make_batch([(40, 1), (20, 4)], (4, 2, 32), 16, torch.float32)
    bad_block = args["block_tables"].clone()
    bad_block[0, 1] = args["key_cache"].shape[0]
    cases = {
        "out of range": dict(args, block_tables=bad_block),
        "shorter than its": dict(args, seq_lens=torch.tensor([40, 3], dtype=torch.int32)),
        "int32": dict(args, seq_lens=args["seq_lens"].long()),
        "share a dtype": dict(args, query=args["query"].double()),
        "multiple of num_kv_heads": dict(args, query=args["query"][:, :3]),
    }
    for message, bad in cases.items():
        with pytest.raises(RuntimeError, match=message):
            cpu_kernel.paged_attention(**bad)


@pytest.mark.parametrize("num_tokens", [1, 7, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reshape_and_cache_matches_index_copy(num_tokens: int, dtype: torch.dtype) -> None:
    """The cache write, from the engine's [T, kv_heads, head_dim] transposed views into a
    per-layer pool view, against the two index_copy_ calls it replaces; slot -1 is skipped."""
    gen = torch.Generator().manual_seed(num_tokens)
    pool = torch.randn(2, 2, 80, 16, 3, 64, generator=gen).to(dtype)
    expected = pool.clone()
    key = torch.randn(1, num_tokens, 3, 64, generator=gen).to(dtype).transpose(1, 2)[0].transpose(0, 1)
    value = torch.randn(1, num_tokens, 3, 64, generator=gen).to(dtype).transpose(1, 2)[0].transpose(0, 1)
    slots = torch.randperm(80 * 16, generator=gen)[:num_tokens]
    cpu_kernel.reshape_and_cache(key, value, pool[1, 0], pool[1, 1], slots)
    expected[1, 0].view(-1, 3, 64).index_copy_(0, slots, key)
    expected[1, 1].view(-1, 3, 64).index_copy_(0, slots, value)
    assert torch.equal(pool, expected)
    skipped = slots.clone()
    skipped[0] = -1
    before = pool.clone()
    cpu_kernel.reshape_and_cache(key + 1, value, pool[1, 0], pool[1, 1], skipped)
    slot = int(slots[0])
    assert torch.equal(pool[1, 0, slot // 16, slot % 16], before[1, 0, slot // 16, slot % 16])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernel.reshape_and_cache(key, value, pool[1, 0], pool[1, 1], slots + 80 * 16)


def test_torch_compile_treats_the_op_as_opaque() -> None:
    """fullgraph=True fails on any graph break: the fake (meta) implementation lets dynamo and
    inductor trace through the op without running it. (Only the op: inductor would spend tens of
    seconds compiling C++ for any other op in the graph.)"""
    args = make_batch([(50, 1), (30, 6)], (4, 2, 32), 16, torch.float32)
    compiled = torch.compile(cpu_kernel.paged_attention, fullgraph=True)
    torch.testing.assert_close(compiled(**args), cpu_kernel.paged_attention(**args), atol=0, rtol=0)


def test_build_directory_is_keyed_under_tokenmill_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    folder = cpu_kernel.build_directory()
    assert folder.parent == tmp_path / "torch_extensions"
    assert folder.name.startswith("tokenmill_paged_attention_cpu-") and len(folder.name.split("-")[-1]) == 16
