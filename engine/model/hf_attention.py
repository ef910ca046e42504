"""Paged attention, registered with transformers' attention interface so that any Hugging Face
decoder runs over our block-table KV cache with no per-architecture code.

The model sees one flattened "batch" of T tokens (``[1, T]``): decode tokens of many requests
first, then prefill chunks. In every layer this function hands the layer's keys, values and
queries to the step's attention backend (engine/kernels/attention): write the new keys/values into their
cache slots, then attend each token over its own request's cached context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

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
        **kwargs: must carry ``tokenmill_step`` (:class:`StepAttention`).

    Returns:
        ``([1, T, heads, head_dim], None)`` as transformers expects.
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
    out = step.backend.attend(query[0].transpose(0, 1), key_cache, value_cache, step.meta, scale)
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask factory for our implementation: masking is done inside the attention function."""
    return None


def register() -> str:
    """Register the attention function and its (empty) mask factory; returns the name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
