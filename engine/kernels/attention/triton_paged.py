"""Paged attention for CUDA in Triton: every query row reads its sequence's keys and values straight
from the block pool through the block table (no gather), decodes and prefill chunks alike.

Imports torch and triton (triton only where this module is imported: the CUDA path). Grids and
compile-time constants depend only on the step's shapes (tokens, sequences, heads), never on its
contexts: an eager step compiles each kernel once whatever its contexts grow to, and a captured decode
step (which knows only its block table's width) launches exactly what the eager step of its batch does.

Tiles (one program per kv head and block of one sequence's query tokens)::

    rows of the tile:   q_tok 0: heads g0..gG | q_tok 1: heads g0..gG | ...   (BLOCK_M rows)
    keys of the tile:   TILE_N consecutive context positions; each position's block is looked
                        up in the block table, so any block size works (1, 4, 16, ...)

The query blocks of all sequences are numbered in one flat grid axis, so a mixed step launches about
as many programs as it has query blocks, not sequences x the longest query's blocks (most of which
would exit at once); each program finds its sequence by a binary search over ``query_start_loc``
(vLLM's unified attention does the same)::

    sequence s owns flat blocks  first(s) .. first(s + 1) - 1,   first(s) = (query_start[s] - s) // BLOCK_Q + s

    (first(s + 1) - first(s) >= cdiv(q_len_s, BLOCK_Q) for q_len_s >= 1; first(S) = (T - S) // BLOCK_Q + S
    from the shapes alone: exactly S for a decode step, and over the sum of cdiv(q_len, BLOCK_Q) by less
    than one block per prefill chunk)

Decode steps with few (sequence, kv head) pairs split each context into NUM_SEGMENTS segments
(flash-decoding): one program per (sequence, kv head, segment) writes its partial softmax state, and a
second kernel merges the segments of each (sequence, head). The segment count is fixed; each segment's
length comes from the sequence's own context, in the kernels::

    length:       max(MIN_SEGMENT, cdiv(context, NUM_SEGMENTS) rounded up to TILE_N)
    context:      | segment 0 | segment 1 | ... | segment k-1 |  (segments k.. past the context:
    partial:        (m0, l0, acc0)  (m1, l1, acc1)   ...           no program works, the merge skips them)
    output:       sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p,   M = max_p m_p
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill.engine.kernels.attention import reference
from tokenmill.engine.kernels.attention.metadata import AttentionMetadata

TILE_N = 32  # context positions per inner step
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows on the GPU
MIN_HEAD_DIM_P = 16  # and a K of at least 16: an 8-wide head is padded (NVIDIA Triton before 2026-04)
NUM_SEGMENTS = 16  # segments of a split decode's context (a power of two: the merge loads them as one vector)
# NOTE: a shorter segment would load the query and write a partial state for a handful of keys.
MIN_SEGMENT = 128  # fewest context positions of one segment (a multiple of TILE_N: no tile is cut)
PROGRAMS_PER_SM = 2  # a decode step with fewer (sequence, kv head) programs per multiprocessor splits
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
def _first_q_block(query_start_ptr, seq, BLOCK_Q: tl.constexpr):
    """The flat index of sequence ``seq``'s first query block (see the module's docstring)."""
    return (tl.load(query_start_ptr + seq) - seq) // BLOCK_Q + seq


@triton.jit
def _find_sequence(query_start_ptr, q_block, num_sequences, BLOCK_Q: tl.constexpr):
    """The sequence that owns flat query block ``q_block``: the last one whose first block is not past it."""
    lo = q_block * 0  # an int32 of the loop's type (num_sequences may be specialised to a constant)
    hi = lo + num_sequences
    while lo < hi:
        mid = (lo + hi) // 2
        if _first_q_block(query_start_ptr, mid, BLOCK_Q) <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, num_sequences,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    ACC: tl.constexpr,
):
    flat_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_ptr, flat_block, num_sequences, BLOCK_Q)
    q_block = flat_block - _first_q_block(query_start_ptr, seq, BLOCK_Q)  # within the sequence
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # first(s + 1) may leave one block past sequence s's queries
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
def _segment_length(seq_len, NUM_SEGMENTS: tl.constexpr, MIN_SEGMENT: tl.constexpr, TILE: tl.constexpr):
    """Context positions per segment of a ``seq_len`` context, whole tiles: both kernels of a split decode
    derive it, so the segments in use follow each sequence's own context, not a host-side bound."""
    tiles = (seq_len + NUM_SEGMENTS * TILE - 1) // (NUM_SEGMENTS * TILE)
    return tl.maximum(tiles * TILE, MIN_SEGMENT)


@triton.jit
def _decode_segment_kernel(
    m_ptr, l_ptr, acc_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr, NUM_SEGMENTS: tl.constexpr, MIN_SEGMENT: tl.constexpr, GROUP: tl.constexpr,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, ACC: tl.constexpr,
):
    """One segment of one decode row's context, for the query heads of one kv head: the partial
    softmax state ``(m, l, acc)`` of each head at ``[seq, head, segment]``; nothing for a segment
    past the context (the merge does not read it)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    length = _segment_length(seq_len, NUM_SEGMENTS, MIN_SEGMENT, TILE)
    lo = segment * length
    if lo >= seq_len:
        return
    hi = tl.minimum(seq_len, lo + length)
    q_start = tl.load(query_start_ptr + seq)

    rows = tl.arange(0, ROWS)  # the group's heads of the one query token; rows past GROUP pad tl.dot
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    q_offsets = q_start.to(tl.int64) * stride_qt + head[:, None].to(tl.int64) * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = tl.zeros([ROWS], tl.int32) + seq_len - 1
    m, denom, acc = _attend_range(
        q, q_pos, row_ok, lo, hi,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, scale,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        ROWS, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, TILE, ACC,
    )
    state = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS + segment  # [ROWS]
    tl.store(m_ptr + state, m, mask=row_ok)
    tl.store(l_ptr + state, denom, mask=row_ok)
    tl.store(acc_ptr + state[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_segments_kernel(
    out_ptr, m_ptr, l_ptr, acc_ptr, seq_lens_ptr, query_start_ptr,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SEGMENTS: tl.constexpr, MIN_SEGMENT: tl.constexpr, TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    """The output of one (decode row, head) from the partial softmax states of its context's segments;
    the segments past the context count as empty (max -inf, sum 0)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    length = _segment_length(seq_len, NUM_SEGMENTS, MIN_SEGMENT, TILE)
    segments = tl.arange(0, NUM_SEGMENTS)
    used = segments * length < seq_len
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    state = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS + segments
    m = tl.load(m_ptr + state, mask=used, other=float("-inf"))
    denom = tl.load(l_ptr + state, mask=used, other=0.0)
    acc = tl.load(acc_ptr + state[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None] & dim_ok[None, :],
                  other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty segments weigh 0
    total = tl.sum(weight * denom, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    q_start = tl.load(query_start_ptr + seq).to(tl.int64)
    tl.store(out_ptr + q_start * stride_ot + head.to(tl.int64) * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


def head_dim_padded(head_dim: int) -> int:
    """The head width the kernels compute at: a power of two, and at least tl.dot's smallest K."""
    return max(MIN_HEAD_DIM_P, int(triton.next_power_of_2(head_dim)))


def splits_decode(num_sequences: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a decode step splits its contexts into ``NUM_SEGMENTS`` segments.

    NOTE: a decode step has one program per (sequence, kv head): at batch 1 with 8 kv heads that is
    8 programs on 132 multiprocessors, each walking the whole context. Under ``PROGRAMS_PER_SM`` per
    multiprocessor the step splits. Only the batch's shape decides, never its contexts: a captured
    step, which sees only its block table's width, takes the eager step's path, and the segments of a
    short context that are not needed cost a program that exits at once.
    """
    return num_sequences * num_kv_heads < PROGRAMS_PER_SM * num_sms


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, max_query_len: int,
                    num_sms: int | None = None) -> torch.Tensor:
    """The paged-attention op (engine/kernels/attention/metadata.py) on the query's device, accumulated in float32
    (float64 for float64); every sequence has at least one query token here.

    Args:
        max_query_len: the most query tokens of one sequence (1: a decode step, which may split).
        num_sms: multiprocessors a split decode fills; None: the device's.
    """
    num_tokens, num_heads, head_dim = query.shape
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
    sms = num_sms if num_sms is not None else _multiprocessors(query.device)
    if max_query_len == 1 and splits_decode(num_sequences, num_kv_heads, sms):
        m = torch.empty(num_sequences, num_heads, NUM_SEGMENTS, dtype=acc_torch, device=query.device)
        denom = torch.empty_like(m)
        partial = torch.empty(num_sequences, num_heads, NUM_SEGMENTS, head_dim, dtype=acc_torch, device=query.device)
        _decode_segment_kernel[(num_sequences, num_kv_heads, NUM_SEGMENTS)](
            m, denom, partial, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            scale,
            query.stride(0), query.stride(1), *cache_strides, block_tables.stride(0),
            NUM_HEADS=num_heads, NUM_SEGMENTS=NUM_SEGMENTS, MIN_SEGMENT=MIN_SEGMENT, GROUP=group,
            ROWS=max(MIN_BLOCK_M, group_p), **shared,
        )
        _merge_segments_kernel[(num_sequences, num_heads)](
            out, m, denom, partial, seq_lens, query_start_loc, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SEGMENTS=NUM_SEGMENTS, MIN_SEGMENT=MIN_SEGMENT, TILE=TILE_N,
            HEAD_DIM=head_dim, HEAD_DIM_P=shared["HEAD_DIM_P"],
        )
        return out
    block_q = max(1, MIN_BLOCK_M // group_p) if max_query_len == 1 else max(1, 64 // group_p)
    q_blocks = (num_tokens - num_sequences) // block_q + num_sequences  # first(S): the module's docstring
    _paged_attention_kernel[(q_blocks, num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale, num_sequences,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        *cache_strides,
        block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, **shared,
    )
    return out


class TritonBackend:
    """CUDA attention: keys and values written as the reference writes them (``index_copy_``), attention by the
    Triton kernels.

    Args:
        num_sms: multiprocessors a split decode fills; None: the device's (tests set it).
    """

    name = "triton"

    def __init__(self, num_sms: int | None = None) -> None:
        self.num_sms = num_sms

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        reference.write_kv(key, value, key_cache, value_cache, slot_mapping)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, scale, meta.max_query_len, self.num_sms)
