"""The reference attention backend, gather + SDPA: the oracle every kernel is tested against.

``paged_attention`` is the unified op (see engine/kernels/attention/metadata.py) in plain torch: each
sequence's context blocks are gathered and attended with SDPA under a causal mask offset by the
cached prefix, one sequence at a time. ``ReferenceBackend`` batches the decode rows.
NOTE: measurements behind these choices: ops/bench/README.md, "Figures behind the kernels' comments".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.engine.kernels.attention.metadata import AttentionMetadata


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """The paged-attention op (engine/kernels/attention/metadata.py), computed in float32 (float64 for float64);
    index tensors of any integer dtype, any strides."""
    return attend_sequences(query, key_cache, value_cache, block_tables, seq_lens.tolist(), query_start_loc.tolist(),
                            scale)


def attend_sequences(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_starts: list[int],
    scale: float,
) -> torch.Tensor:
    """:func:`paged_attention` with the context lengths and query offsets given on the host (the
    backend takes them from the step's metadata, so no layer reads them back from the device).

    NOTE: every tensor made here is made on the query's device: a default-device ``arange`` beside
    CUDA tensors fails every prefill on a GPU.
    """
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    device = query.device
    out = torch.empty_like(query)
    for s, context in enumerate(seq_lens):
        lo, hi = query_starts[s], query_starts[s + 1]
        if hi == lo:
            continue
        blocks = block_tables[s, : (context + block_size - 1) // block_size].long()
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context]
        positions = torch.arange(context - (hi - lo), context, device=device)
        mask = torch.arange(context, device=device).unsqueeze(0) <= positions.unsqueeze(1)  # [q_len, context]
        attended = F.scaled_dot_product_attention(
            query[lo:hi].transpose(0, 1).to(compute),
            keys.transpose(0, 1).to(compute),
            values.transpose(0, 1).to(compute),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[lo:hi] = attended.transpose(0, 1).to(query.dtype)
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store a step's keys and values at their slots with ``index_copy_`` (any device): the reference's write, and
    the Triton backend's."""
    num_kv_heads, head_dim = key_cache.shape[-2], key_cache.shape[-1]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


class ReferenceBackend:
    """Gather + SDPA: every other backend is tested against this one, and it is the fallback
    wherever no kernel is available.

    Decode rows (one query token each) are attended together: their blocks are gathered into a
    reused buffer, padded to the longest row of a group and masked. Prefill chunks go one
    sequence at a time through :func:`paged_attention`.

    NOTE: on CPU a group's keys and values stay under ``cpu_chunk_bytes`` (a few MiB), so they are
    still in cache when SDPA reads them back; rows come longest first, so a group gathers only
    the blocks its longest row needs (one big gather was slower).
    """

    name = "reference"

    def __init__(self, cpu_chunk_bytes: int = 4 << 20) -> None:
        self.cpu_chunk_bytes = cpu_chunk_bytes
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # grow-only gather targets

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(key, value, key_cache, value_cache, slot_mapping)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_decodes = meta.num_decodes
        parts = []
        if num_decodes:
            parts.append(self._attend_decodes(query[:num_decodes], key_cache, value_cache, meta, scale))
        if num_decodes < meta.num_sequences:
            start = meta.query_start_host[num_decodes]
            parts.append(attend_sequences(
                query[start:], key_cache, value_cache, meta.block_tables[num_decodes:],
                meta.seq_lens_host[num_decodes:], [q - start for q in meta.query_start_host[num_decodes:]], scale,
            ))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _attend_decodes(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Single-token queries, one SDPA per group of rows.

        NOTE: the query heads that share a KV head are laid out as the "query length" axis, so GQA
        needs neither repeat_kv nor enable_gqa: q is ``[B, kv_heads, group, D]`` against
        k/v ``[B, kv_heads, context, D]``.
        """
        num_decodes, _, head_dim = query.shape
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        tables, mask, groups = self._decode_plan(key_cache, meta)
        key_buffer, value_buffer = self._gather_buffers(key_cache, tables.numel())
        q = query.reshape(num_decodes, num_kv_heads, -1, head_dim)
        outs = []
        for lo, hi, num_blocks in groups:
            group_tables = tables[lo:hi, :num_blocks]
            keys = _gather_blocks(key_cache, group_tables, key_buffer).transpose(1, 2)
            values = _gather_blocks(value_cache, group_tables, value_buffer).transpose(1, 2)
            group_mask = mask[lo:hi, :, :, : num_blocks * block_size]
            outs.append(F.scaled_dot_product_attention(q[lo:hi], keys, values, attn_mask=group_mask, scale=scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.reshape(num_decodes, -1, head_dim)

    def _decode_plan(self, key_cache: torch.Tensor,
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
        """Block tables, context mask and row groups of the decode rows: built once per step."""
        state = meta.backend_state
        if "decode_plan" not in state:
            block_size = key_cache.shape[1]
            contexts = meta.seq_lens_host[: meta.num_decodes]
            row_blocks = [(c + block_size - 1) // block_size for c in contexts]
            tables = meta.block_tables[: meta.num_decodes, : max(row_blocks)].long()
            positions = torch.arange(tables.shape[1] * block_size, device=tables.device)
            mask = positions.unsqueeze(0) < meta.seq_lens[: meta.num_decodes].unsqueeze(1)
            state["decode_plan"] = (tables, mask[:, None, None, :], self._groups(key_cache, row_blocks))
        plan: tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]] = state["decode_plan"]
        return plan

    def _groups(self, key_cache: torch.Tensor, row_blocks: list[int]) -> list[tuple[int, int, int]]:
        """``(first row, end row, blocks per row)``: on CPU groups of at most ``cpu_chunk_bytes`` of
        keys and values (rows must come longest first); elsewhere one group."""
        if key_cache.device.type != "cpu":
            return [(0, len(row_blocks), max(row_blocks))]
        block_bytes = 2 * key_cache[0].numel() * key_cache.element_size()  # keys + values
        groups: list[tuple[int, int, int]] = []
        lo = 0
        while lo < len(row_blocks):
            hi = min(len(row_blocks), lo + max(1, self.cpu_chunk_bytes // (row_blocks[lo] * block_bytes)))
            groups.append((lo, hi, max(row_blocks[lo:hi])))
            lo = hi
        return groups

    def _gather_buffers(self, key_cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grow-only gather targets shared by every layer and step.

        NOTE: fresh multi-MB allocations per layer page-fault on every step on CPU; reusing one
        buffer made decode attention several times faster.
        """
        if self._buffers is None or self._buffers[0].shape[0] < num_blocks:
            rows = max(num_blocks, 2 * (self._buffers[0].shape[0] if self._buffers else 0))
            shape = (rows, key_cache[0].numel())
            self._buffers = (key_cache.new_empty(shape), key_cache.new_empty(shape))
        return self._buffers


def _gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows of whole blocks: ``[rows, num_blocks * block_size, kv_heads, head_dim]``.

    NOTE: index_select on a 2-D view copies contiguous rows and is several times faster on CPU
    than advanced indexing of the 4-D pool.
    """
    num_blocks, block_size, num_kv_heads, head_dim = pool.shape
    flat_ids = block_ids.reshape(-1)
    rows = torch.index_select(pool.view(num_blocks, -1), 0, flat_ids, out=out[: flat_ids.numel()])
    return rows.view(block_ids.shape[0], block_ids.shape[1] * block_size, num_kv_heads, head_dim)
