"""Paged attention, registered with transformers' attention interface so that any Hugging Face
decoder runs over our block-table KV cache with no per-architecture code.

The model sees one flattened "batch" of T tokens (``[1, T]``): decode tokens of many requests
first, then prefill chunks. For each layer this function writes the new keys/values into their
cache slots, then attends each token over its own request's cached context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.kv_cache import KVCache

ATTN_IMPLEMENTATION = "tokenmill_paged"


@dataclass
class PrefillSpan:
    """One prefill chunk inside the flattened batch."""

    token_offset: int  # index of its first token in the flattened batch
    num_tokens: int
    start_position: int  # tokens of this request already in the cache before this chunk
    block_ids: torch.Tensor  # [num_blocks] device blocks covering start_position + num_tokens
    mask: torch.Tensor | None  # [num_tokens, context] bool (True = attend); None when start_position == 0


@dataclass
class AttentionMetadata:
    """Everything the attention function needs for one step, built once per step by the runner.

    Decode tokens occupy batch indices ``0 .. num_decode_tokens - 1``, one per request.
    """

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] cache slot of every token (block_id * block_size + offset)
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks]; padded with block 0
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool, True = attend
    prefills: list[PrefillSpan]
    # Reused gather targets for the decode keys/values, [num_decode * max_blocks, block numel] each.
    # NOTE: fresh multi-MB allocations per layer page-fault on every step on CPU; reusing one
    # buffer for all layers made decode attention several times faster.
    decode_key_buffer: torch.Tensor | None = None
    decode_value_buffer: torch.Tensor | None = None
    # Groups of decode rows gathered and attended together: (first row, end row, blocks per row).
    # NOTE: rows come longest context first, so a group gathers only the blocks its longest row
    # needs; on CPU a group's keys and values (a few MiB) are still in cache when SDPA reads them
    # back (one big gather measured ~20% slower).
    decode_chunks: list[tuple[int, int, int]] = field(default_factory=list)


def _gather_blocks(pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of whole blocks: ``[*block_ids.shape[:-1], num_blocks * block_size, kv_heads, head_dim]``.

    NOTE: index_select on a 2-D view copies contiguous rows and is several times faster on CPU
    than advanced indexing of the 4-D pool.
    """
    num_blocks, block_size, num_kv_heads, head_dim = pool.shape
    flat_ids = block_ids.reshape(-1)
    if out is None:
        rows = torch.index_select(pool.view(num_blocks, -1), 0, flat_ids)
    else:
        rows = torch.index_select(pool.view(num_blocks, -1), 0, flat_ids, out=out[: flat_ids.numel()])
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_dim)


def _attend_decodes(
    query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, meta: AttentionMetadata, scaling: float
) -> torch.Tensor:
    """Single-token queries of many requests, one SDPA call per chunk of rows.

    NOTE: the query heads that share a KV head are laid out as the "query length" axis, so GQA
    needs neither repeat_kv nor enable_gqa: q is ``[B, kv_heads, group, D]`` against
    k/v ``[B, kv_heads, context, D]``.
    """
    assert meta.decode_block_tables is not None and meta.decode_mask is not None
    num_decodes = meta.num_decode_tokens
    num_kv_heads, head_dim = key_pool.shape[-2], key_pool.shape[-1]
    q = query[0, :, :num_decodes].transpose(0, 1).reshape(num_decodes, num_kv_heads, -1, head_dim)
    block_size = key_pool.shape[1]
    outs = []
    for lo, hi, num_blocks in meta.decode_chunks:
        tables = meta.decode_block_tables[lo:hi, :num_blocks]
        mask = meta.decode_mask[lo:hi, :, :, : num_blocks * block_size]
        keys = _gather_blocks(key_pool, tables, meta.decode_key_buffer).transpose(1, 2)
        values = _gather_blocks(value_pool, tables, meta.decode_value_buffer).transpose(1, 2)
        outs.append(F.scaled_dot_product_attention(q[lo:hi], keys, values, attn_mask=mask, scale=scaling))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(num_decodes, -1, head_dim)


def _attend_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    span: PrefillSpan,
    scaling: float,
) -> torch.Tensor:
    """Causal attention of one prefill chunk over its cached prefix plus itself."""
    lo, hi = span.token_offset, span.token_offset + span.num_tokens
    q = query[:, :, lo:hi]
    if span.mask is None:  # first chunk: the context is exactly this chunk's own keys
        k, v = key[:, :, lo:hi], value[:, :, lo:hi]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        context = span.start_position + span.num_tokens
        k = _gather_blocks(key_pool, span.block_ids)[:context].transpose(0, 1).unsqueeze(0)
        v = _gather_blocks(value_pool, span.block_ids)[:context].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scaling, enable_gqa=True)
    return out[0].transpose(0, 1)  # [num_tokens, heads, head_dim]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface entry point.

    Args:
        module: the attention layer; ``module.layer_idx`` selects the cache layer.
        query: ``[1, heads, T, head_dim]`` (RoPE applied).
        key: ``[1, kv_heads, T, head_dim]``.
        value: ``[1, kv_heads, T, head_dim]``.
        attention_mask: ignored; masking comes from the paged metadata.
        scaling: softmax scale.
        dropout: must be 0 (inference only).
        **kwargs: must carry ``tokenmill_metadata`` (:class:`AttentionMetadata`).

    Returns:
        ``([1, T, heads, head_dim], None)`` as transformers expects.
    """
    meta: AttentionMetadata = kwargs["tokenmill_metadata"]
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise TypeError(f"{type(module).__name__} has no layer_idx; cannot address the KV cache")
    key_pool, value_pool = meta.kv_cache.layer(layer_idx)
    num_kv_heads, head_dim = key_pool.shape[-2], key_pool.shape[-1]
    key_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    value_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    scale = scaling if scaling is not None else head_dim**-0.5
    parts = []
    if meta.num_decode_tokens:
        parts.append(_attend_decodes(query, key_pool, value_pool, meta, scale))
    for span in meta.prefills:
        parts.append(_attend_prefill(query, key, value, key_pool, value_pool, span, scale))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask factory for our implementation: masking is done inside the attention function."""
    return None


def register() -> str:
    """Register the attention function and its (empty) mask factory; returns the name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
