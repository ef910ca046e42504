"""Paged attention for CUDA in Triton: every query row reads its sequence's keys and values straight
from the block pool through the block table (no gather), decodes and prefill chunks alike.

Imports torch and triton (triton only where this module is imported: the CUDA path). The grid
depends only on the number of sequences and the longest query, never on context lengths, so a
decode step's launch is the same every step and can be captured in a CUDA graph.

Tiles (one program per sequence, kv head and block of query tokens)::

    rows of the tile:   q_tok 0: heads g0..gG | q_tok 1: heads g0..gG | ...   (BLOCK_M rows)
    keys of the tile:   TILE_N consecutive context positions; each position's block is looked
                        up in the block table, so any block size works (1, 4, 16, ...)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.metadata import AttentionMetadata

TILE_N = 32  # context positions per inner step
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows on the GPU


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    ACC: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    q_tok = q_block * BLOCK_Q + rows // GROUP_P  # query token within the sequence
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (q_tok < q_len) & (rows % GROUP_P < GROUP)
    q_pos = seq_len - q_len + q_tok  # context position of each row's query
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM

    q_offsets = (q_start + q_tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m = tl.full([BLOCK_Q * GROUP_P], float("-inf"), ACC)
    denom = tl.zeros([BLOCK_Q * GROUP_P], ACC)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], ACC)
    # NOTE: causal: no row of this tile attends past its last query's position.
    context_end = tl.minimum(seq_len, seq_len - q_len + (q_block + 1) * BLOCK_Q)
    for tile_start in range(0, context_end, TILE):
        positions = tile_start + tl.arange(0, TILE)
        pos_ok = positions < context_end
        blocks = tl.load(block_tables_ptr + seq * stride_bt + positions // BLOCK_SIZE, mask=pos_ok, other=0)
        slots = positions % BLOCK_SIZE
        k_offsets = (blocks[:, None] * stride_kb + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :])
        v_offsets = (blocks[:, None] * stride_vb + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :])
        k = tl.load(k_cache_ptr + k_offsets, mask=pos_ok[:, None] & dim_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + v_offsets, mask=pos_ok[:, None] & dim_ok[None, :], other=0.0)
        # NOTE: ieee: float32 inputs must not be rounded to tf32 (greedy parity is the contract).
        scores = tl.dot(q, tl.trans(k), input_precision="ieee").to(ACC) * scale
        allowed = (positions[None, :] <= q_pos[:, None]) & pos_ok[None, :] & row_ok[:, None]
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        p = tl.exp(scores - m_safe[:, None])
        correction = tl.exp(m - m_safe)
        denom = denom * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(ACC)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    o_offsets = (q_start + q_tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context (the unified op of
    ``engine.attention.metadata``), on the query's device.

    Args:
        query: ``[T, heads, head_dim]``, head_dim contiguous.
        key_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, head_dim contiguous (any view).
        value_cache: same shape and dtype as ``key_cache``.
        block_tables: int32 ``[S, max_blocks]``.
        seq_lens: int32 ``[S]``: context lengths, this step's tokens included.
        query_start_loc: int32 ``[S + 1]``.
        scale: softmax scale.
        max_query_len: the most query tokens of one sequence (sizes the grid; 1 for decodes).

    Returns:
        ``[T, heads, head_dim]`` in the query's dtype (accumulated in float32; float64 for float64).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    block_q = max(1, MIN_BLOCK_M // group_p) if max_query_len == 1 else max(1, 64 // group_p)
    out = torch.empty_like(query)
    num_sequences = seq_lens.shape[0]
    grid = (num_sequences, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_DIM_P=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, TILE=TILE_N,
        ACC=tl.float64 if query.dtype == torch.float64 else tl.float32,
    )
    return out


class TritonBackend:
    """CUDA attention: keys and values written with ``index_copy_``, attention by the Triton kernel."""

    name = "triton"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = key_cache.shape[-2], key_cache.shape[-1]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, scale, meta.max_query_len)
