"""What the engine checks each request against at admission: the model's vocabulary and the most
tokens one request may hold (the model's context or the whole KV cache). Standard library only."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelLimits:
    """What the engine checks requests against."""

    model_name: str  # as configured (alias, id or path)
    source: str  # what was loaded: the resolved directory or hub id
    vocab_size: int  # prompt token ids must be below this
    max_request_tokens: int  # prompt + max_tokens of one request: the model context or the whole KV cache
    is_cache_bound: bool  # max_request_tokens is the KV cache's size, not the model's context
    kv_block_bytes: int  # bytes of one KV block (stats)
