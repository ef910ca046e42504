"""Paged attention, registered with transformers' attention interface so that any Hugging Face
decoder runs over our block-table KV cache with no per-architecture code.

The model sees one flattened "batch" of T tokens (``[1, T]``): decode tokens of many requests
first, then prefill chunks. In every layer this function hands the layer's keys, values and
queries to the step's attention backend (engine/kernels/attention): write the new keys/values into their
cache slots, then attend each token over its own request's cached context.

Two terms some models add to the attention logits are honoured here, never dropped: logit soft-capping
(``softcap``: Gemma 2's ``attn_logit_softcapping``, scores become ``tanh(s / cap) * cap`` before the mask and the
softmax) and attention sinks (``s_aux``: gpt-oss's per-head logit that joins each row's softmax denominator and
attends to nothing). The kernels have neither, so a layer that passes either attends through
:func:`attend_with_logit_terms`, a plain-torch path over the same paged cache, after the backend wrote the step's
keys and values: every row of the step, on any device (its decode rows read only device tensors, so a captured
decode step replays it for any contexts; they gather the block table's whole width there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from tokenmill.engine.kernels.attention import AttentionBackend, AttentionMetadata
from tokenmill.engine.model.kv_cache import KVCache

ATTN_IMPLEMENTATION = "tokenmill_paged"


@dataclass
class StepAttention:
    """What every layer's attention needs in one step; passed as the model's ``tokenmill_step`` kwarg."""

    kv_cache: KVCache
    meta: AttentionMetadata
    backend: AttentionBackend


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
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
        softcap: logit soft-capping (``tanh(s / softcap) * softcap``); None or 0: none.
        s_aux: attention sinks, one logit per query head (``[heads]``); None: none.
        **kwargs: must carry ``tokenmill_step`` (:class:`StepAttention`); the rest (``sliding_window``: every
            context fits the window, engine/model/model_loader.py caps the length by it) change nothing here.

    Returns:
        ``([1, T, heads, head_dim], None)`` as transformers expects.

    Raises:
        TypeError: sinks that are not one per query head.
    """
    step: StepAttention = kwargs["tokenmill_step"]
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise TypeError(f"{type(module).__name__} has no layer_idx; cannot address the KV cache")
    key_cache, value_cache = step.kv_cache.layer(layer_idx)
    head_dim = query.shape[-1]
    step.backend.write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache,
                          step.meta.slot_mapping)
    scale = scaling if scaling is not None else head_dim**-0.5
    if softcap or s_aux is not None:
        out = attend_with_logit_terms(query[0].transpose(0, 1), key_cache, value_cache, step.meta, scale,
                                      softcap or None, s_aux)
    else:
        out = step.backend.attend(query[0].transpose(0, 1), key_cache, value_cache, step.meta, scale)
    return out.unsqueeze(0), None


def attend_with_logit_terms(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, softcap: float | None,
                            sinks: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged context, with logit soft-capping and/or
    attention sinks (as Hugging Face's eager attention of Gemma 2 and gpt-oss computes them), in float32 (float64
    for float64).

    Decode rows (the first ``meta.num_decodes``, one token each) attend together over the block table's first
    ``meta.max_seq_len`` positions, masked by ``meta.seq_lens`` on the device (no host value: a captured step
    replays it); prefill chunks one sequence at a time.

    Args:
        query: ``[T, heads, head_dim]``.
        key_cache: ``[num_blocks, block_size, kv_heads, head_dim]``; ``value_cache`` the same.
        sinks: one logit per query head, or None.

    Returns:
        ``[T, heads, head_dim]`` in the query's dtype.

    Raises:
        TypeError: ``sinks`` is not one value per query head.
    """
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    if sinks is not None and sinks.numel() != num_heads:
        raise TypeError(f"attention sinks: {sinks.numel()} values for {num_heads} query heads")
    sink = sinks.to(compute).view(num_kv_heads, group, 1) if sinks is not None else None
    out = torch.empty_like(query)
    num_decodes = meta.num_decodes
    if num_decodes:
        width = -(-meta.max_seq_len // block_size)
        tables = meta.block_tables[:num_decodes, :width].long()
        keys = key_cache[tables].reshape(num_decodes, width * block_size, num_kv_heads, head_dim)
        values = value_cache[tables].reshape(num_decodes, width * block_size, num_kv_heads, head_dim)
        positions = torch.arange(width * block_size, device=query.device)
        visible = (positions.unsqueeze(0) < meta.seq_lens[:num_decodes].unsqueeze(1))[:, None, None, :]
        q = query[:num_decodes].reshape(num_decodes, num_kv_heads, group, head_dim).to(compute)
        scores = torch.einsum("bkgd,blkd->bkgl", q, keys.to(compute)) * scale
        weights = _weights(scores, visible, softcap, sink)
        attended = torch.einsum("bkgl,blkd->bkgd", weights, values.to(compute))
        out[:num_decodes] = attended.reshape(num_decodes, num_heads, head_dim).to(query.dtype)
    for s in range(num_decodes, meta.num_sequences):
        lo, hi = meta.query_start_host[s], meta.query_start_host[s + 1]
        context = meta.seq_lens_host[s]
        if hi == lo:
            continue
        blocks = meta.block_tables[s, : -(-context // block_size)].long()
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:context]
        rows = torch.arange(context - (hi - lo), context, device=query.device)
        visible = (torch.arange(context, device=query.device).unsqueeze(0) <= rows.unsqueeze(1))[:, None, None, :]
        q = query[lo:hi].reshape(hi - lo, num_kv_heads, group, head_dim).to(compute)
        scores = torch.einsum("nkgd,lkd->nkgl", q, keys.to(compute)) * scale
        weights = _weights(scores, visible, softcap, sink)
        attended = torch.einsum("nkgl,lkd->nkgd", weights, values.to(compute))
        out[lo:hi] = attended.reshape(hi - lo, num_heads, head_dim).to(query.dtype)
    return out


def _weights(scores: torch.Tensor, visible: torch.Tensor, softcap: float | None,
             sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax weights of ``scores`` ``[..., kv_heads, group, context]`` over the ``visible`` positions: capped
    first (``tanh(s / cap) * cap``), then masked; a sink joins each row's denominator and is dropped after."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink is None:
        return F.softmax(scores, dim=-1)
    combined = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    return F.softmax(combined, dim=-1)[..., :-1]


def register() -> str:
    """Register the attention function; returns its name.

    NOTE: no mask factory: transformers makes no mask for an attention implementation without one (the paged
    metadata masks here). A factory, even one that returns None, has it first look for packed sequences in the
    position ids (``find_packed_sequence_indices``), whose ``.all()`` reads a value back from the device: a host
    sync in every eager forward on CUDA.
    """
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
