"""One step's attention inputs, built once by the model runner and read by every layer, and the paged-attention
op every backend implements over them (the contract below: reference.py, cpu_kernel.py and triton_paged.py each
compute it, and the tests compare them on it).

The flattened batch holds T tokens of S sequences, decodes first::

    tokens:            | d0 | d1 | d2 |  p0 p0 p0 p0  |  p1 p1  |
    query_start_loc:   0    1    2    3              7         9      (S + 1 offsets)
    seq_lens:          c0   c1   c2   c3             c4               (context incl. this step)

    sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1] - 1, which sit at
    positions seq_lens[s] - q_len .. seq_lens[s] - 1 of its context; position j of sequence s
    lives in block block_tables[s][j // block_size], slot j % block_size.

The op, ``paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)``:
causal attention of every query row over its sequence's paged context, the keys and values of this step's
tokens already written to the cache. Its arguments:

- ``query``: ``[T, heads, head_dim]``, head_dim contiguous.
- ``key_cache``, ``value_cache``: one layer's pools, ``[num_blocks, block_size, kv_heads, head_dim]``, of the
  query's dtype, head_dim contiguous; may be strided views into the engine's pool of every layer
  (engine/model/kv_cache.py). ``heads`` is a multiple of ``kv_heads`` (grouped-query attention).
- ``block_tables``: int32 ``[S, max_blocks]``: the blocks of each sequence, in order, then padding.
- ``seq_lens``: int32 ``[S]``: each sequence's context length, this step's tokens included.
- ``query_start_loc``: int32 ``[S + 1]``, from 0 to T: sequence ``s`` owns query rows
  ``query_start_loc[s] .. query_start_loc[s+1] - 1``, the last positions of its context.
- ``scale``: the softmax scale.

It returns ``[T, heads, head_dim]`` in the query's dtype. Writing a step's keys and values
(``AttentionBackend.write_kv``) takes them as ``[T, kv_heads, head_dim]`` and an int64 ``slot_mapping``
``[T]``: token ``t`` goes to block ``slot // block_size``, offset ``slot % block_size``. A backend may refuse
arguments outside this contract (the CPU kernel checks every one of them); none is bound to accept more.

Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Tensors on the model's device, plus the few host-side numbers backends size work by."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) of every token
    block_tables: torch.Tensor  # [S, max_blocks] int32: each sequence's blocks, padded with block 0
    seq_lens: torch.Tensor  # [S] int32: context length of each sequence, this step's tokens included
    query_start_loc: torch.Tensor  # [S + 1] int32: first query row of each sequence, then T
    num_decodes: int  # sequences 0 .. num_decodes - 1 have one query token each (rows 0 .. num_decodes - 1)
    max_seq_len: int  # the longest context
    max_query_len: int  # the most query tokens of one sequence (1 in a decode-only step)
    seq_lens_host: list[int]  # seq_lens, on the host
    query_start_host: list[int]  # query_start_loc, on the host
    # Per-step values a backend derives once and reuses in every layer (e.g. masks).
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_host[-1]
