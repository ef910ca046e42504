"""One step's attention inputs, built once by the model runner and read by every layer.

The flattened batch holds T tokens of S sequences, decodes first::

    tokens:            | d0 | d1 | d2 |  p0 p0 p0 p0  |  p1 p1  |
    query_start_loc:   0    1    2    3              7         9      (S + 1 offsets)
    seq_lens:          c0   c1   c2   c3             c4               (context incl. this step)

    sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1] - 1, which sit at
    positions seq_lens[s] - q_len .. seq_lens[s] - 1 of its context; position j of sequence s
    lives in block block_tables[s][j // block_size], slot j % block_size.

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
