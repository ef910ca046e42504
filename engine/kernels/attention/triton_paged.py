"""Paged attention for CUDA in Triton: every query row reads its sequence's keys and values straight
from the block pool through the block table (no gather), decodes and prefill chunks alike.

Imports torch and triton (triton only where this module is imported: the CUDA path). The grid
depends only on the number of sequences, the longest query and (for a split decode) the longest
context the step may have, never on the contexts themselves, so a decode step's launch is the same
every step and can be captured in a CUDA graph.

Tiles (one program per sequence, kv head and block of query tokens)::

    rows of the tile:   q_tok 0: heads g0..gG | q_tok 1: heads g0..gG | ...   (BLOCK_M rows)
    keys of the tile:   TILE_N consecutive context positions; each position's block is looked
                        up in the block table, so any block size works (1, 4, 16, ...)

Decode steps with few (sequence, kv head) pairs split each context into partitions (flash-decoding):
one program per (sequence, kv head, partition) writes its partial softmax state, and a second
kernel merges the partitions of each (sequence, head)::

    context:      | partition 0 | partition 1 | ... | partition P-1 |   (partitions past a
    partial:        (m0, l0, acc0)  (m1, l1, acc1)       ...              context: m = -inf, l = 0)
    output:       sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,   M = max_p m_p
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill.engine.kernels.attention.metadata import AttentionMetadata

TILE_N = 32  # context positions per inner step
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows on the GPU
MIN_HEAD_DIM_P = 16  # and a K of at least 16: an 8-wide head is padded (NVIDIA Triton before 2026-04)
MIN_PARTITION = 128  # fewest context positions of one decode partition (a multiple of TILE_N)
PROGRAMS_PER_SM = 2  # a split decode aims at this many programs per multiprocessor
INTERPRETER_SMS = 4  # what a split decode assumes off CUDA (Triton's interpreter, in tests)


@triton.jit
def _attend_range(
    q, q_pos, row_ok, lo, hi,
    k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, scale,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, ACC: tl.constexpr,
):
    """Online softmax of the tile's rows over context positions ``lo .. hi - 1``: ``(m, denom, acc)``,
    acc not yet divided by denom."""
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    m = tl.full([ROWS], float("-inf"), ACC)
    denom = tl.zeros([ROWS], ACC)
    acc = tl.zeros([ROWS, HEAD_DIM_P], ACC)
    k_head = kv_head.to(tl.int64) * stride_kh
    v_head = kv_head.to(tl.int64) * stride_vh
    for tile_start in range(lo, hi, TILE):
        positions = tile_start + tl.arange(0, TILE)
        pos_ok = positions < hi
        # NOTE: int64: block id x block stride passes 2^31 elements in a per-layer pool over 4 GiB.
        blocks = tl.load(table_row_ptr + positions // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slots = (positions % BLOCK_SIZE).to(tl.int64)
        k_offsets = blocks[:, None] * stride_kb + slots[:, None] * stride_ks + k_head + dims[None, :]
        v_offsets = blocks[:, None] * stride_vb + slots[:, None] * stride_vs + v_head + dims[None, :]
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
    return m, denom, acc


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
    token = (q_start + q_tok).to(tl.int64)

    q_offsets = token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    # NOTE: causal: no row of this tile attends past its last query's position.
    context_end = tl.minimum(seq_len, seq_len - q_len + (q_block + 1) * BLOCK_Q)
    m, denom, acc = _attend_range(
        q, q_pos, row_ok, 0, context_end,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        BLOCK_Q * GROUP_P, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE, ACC,
    )
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    o_offsets = token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_partition_kernel(
    m_ptr, l_ptr, acc_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, partition_size,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr, NUM_PARTITIONS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    ACC: tl.constexpr,
):
    """One partition of one decode row's context, for the query heads of one kv head: the partial
    softmax state ``(m, l, acc)`` of each head at ``[seq, head, partition]``."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, ROWS)  # the group's heads of the one query token; rows past GROUP pad tl.dot
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q_offsets = q_start.to(tl.int64) * stride_qt + head[:, None].to(tl.int64) * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = tl.zeros([ROWS], tl.int32) + seq_len - 1
    lo = partition * partition_size
    hi = tl.minimum(seq_len, lo + partition_size)  # lo >= hi past the context: m = -inf, l = 0
    m, denom, acc = _attend_range(
        q, q_pos, row_ok, lo, hi,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        ROWS, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE, ACC,
    )
    state = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_PARTITIONS + partition  # [ROWS]
    tl.store(m_ptr + state, m, mask=row_ok)
    tl.store(l_ptr + state, denom, mask=row_ok)
    tl.store(acc_ptr + state[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_partitions_kernel(
    out_ptr, m_ptr, l_ptr, acc_ptr, query_start_ptr,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_PARTITIONS: tl.constexpr, NUM_PARTITIONS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    """The output of one (decode row, head) from its partitions' partial softmax states."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, NUM_PARTITIONS_P)
    part_ok = parts < NUM_PARTITIONS
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    state = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_PARTITIONS + parts
    m = tl.load(m_ptr + state, mask=part_ok, other=float("-inf"))
    denom = tl.load(l_ptr + state, mask=part_ok, other=0.0)
    acc = tl.load(acc_ptr + state[:, None] * HEAD_DIM + dims[None, :], mask=part_ok[:, None] & dim_ok[None, :],
                  other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty partitions weigh 0
    total = tl.sum(weight * denom, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    tl.store(out_ptr + q_start * stride_ot + head.to(tl.int64) * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


def head_dim_padded(head_dim: int) -> int:
    """The head width the kernels compute at: a power of two, and at least tl.dot's smallest K."""
    return max(MIN_HEAD_DIM_P, int(triton.next_power_of_2(head_dim)))


def decode_partitions(num_sequences: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> tuple[int, int]:
    """``(partitions, positions per partition)`` of a decode step's contexts; ``(1, max_seq_len)`` = no split.

    NOTE: a decode step has one program per (sequence, kv head): at batch 1 with 8 kv heads that is
    8 programs on 132 multiprocessors, each walking the whole context. Splitting the context brings
    the step to about ``PROGRAMS_PER_SM`` programs per multiprocessor, in partitions of at least
    ``MIN_PARTITION`` positions (a merge pass costs more than a partition that short saves).
    """
    wanted = -(-PROGRAMS_PER_SM * num_sms // max(1, num_sequences * num_kv_heads))
    partitions = min(wanted, -(-max_seq_len // MIN_PARTITION))
    if partitions <= 1:
        return 1, max_seq_len
    size = -(-max_seq_len // (partitions * TILE_N)) * TILE_N
    return -(-max_seq_len // size), size


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int | None = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged context (the unified op of
    ``engine.kernels.attention.metadata``), on the query's device.

    Args:
        query: ``[T, heads, head_dim]``, head_dim contiguous.
        key_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, head_dim contiguous (any view).
        value_cache: same shape and dtype as ``key_cache``.
        block_tables: int32 ``[S, max_blocks]``.
        seq_lens: int32 ``[S]``: context lengths, this step's tokens included.
        query_start_loc: int32 ``[S + 1]``.
        scale: softmax scale.
        max_query_len: the most query tokens of one sequence (sizes the grid; 1 for decodes).
        max_seq_len: at least the longest context (sizes a split decode's partitions).
        num_sms: multiprocessors a split decode fills; None: the device's.

    Returns:
        ``[T, heads, head_dim]`` in the query's dtype (accumulated in float32; float64 for float64).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    num_sequences = seq_lens.shape[0]
    acc_torch = torch.float64 if query.dtype == torch.float64 else torch.float32
    acc = tl.float64 if query.dtype == torch.float64 else tl.float32
    out = torch.empty_like(query)
    shared = dict(HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_padded(head_dim), BLOCK_SIZE=block_size, TILE=TILE_N, ACC=acc)
    cache_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                     value_cache.stride(0), value_cache.stride(1), value_cache.stride(2))
    if max_query_len == 1:
        sms = num_sms if num_sms is not None else _multiprocessors(query.device)
        partitions, partition_size = decode_partitions(num_sequences, num_kv_heads, max_seq_len, sms)
        if partitions > 1:
            rows = max(MIN_BLOCK_M, group_p)
            m = torch.empty(num_sequences, num_heads, partitions, dtype=acc_torch, device=query.device)
            denom = torch.empty_like(m)
            partial = torch.empty(num_sequences, num_heads, partitions, head_dim, dtype=acc_torch, device=query.device)
            _decode_partition_kernel[(num_sequences, num_kv_heads, partitions)](
                m, denom, partial, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                scale, partition_size,
                query.stride(0), query.stride(1), *cache_strides, block_tables.stride(0),
                NUM_HEADS=num_heads, NUM_PARTITIONS=partitions, GROUP=group, ROWS=rows, **shared,
            )
            _merge_partitions_kernel[(num_sequences, num_heads)](
                out, m, denom, partial, query_start_loc, out.stride(0), out.stride(1),
                NUM_HEADS=num_heads, NUM_PARTITIONS=partitions, NUM_PARTITIONS_P=triton.next_power_of_2(partitions),
                HEAD_DIM=head_dim, HEAD_DIM_P=shared["HEAD_DIM_P"],
            )
            return out
    block_q = max(1, MIN_BLOCK_M // group_p) if max_query_len == 1 else max(1, 64 // group_p)
    grid = (num_sequences, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        *cache_strides,
        block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, **shared,
    )
    return out


class TritonBackend:
    """CUDA attention: keys and values written with ``index_copy_``, attention by the Triton kernels.

    Args:
        num_sms: multiprocessors a split decode fills; None: the device's (tests set it).
    """

    name = "triton"

    def __init__(self, num_sms: int | None = None) -> None:
        self.num_sms = num_sms

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = key_cache.shape[-2], key_cache.shape[-1]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, scale, meta.max_query_len, meta.max_seq_len, self.num_sms)
