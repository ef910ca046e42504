"""Random weights (``[engine.model] random_init``) that a tensor-parallel rank makes its part of without the
rest: every parameter is Hugging Face's own initialisation of its module (``_init_weights``: normal with the
config's ``initializer_range`` for linear layers and embeddings, ones for norms, zeros for biases), seeded by
:data:`RANDOM_INIT_SEED` and the parameter's name. A linear layer's weight (and bias) is made a block of rows at
a time (about :data:`BLOCK_ELEMENTS` each), every block seeded by its first row too: a rank makes only the
blocks that hold its rows (a row-parallel layer's every block, keeping its columns of each), so it never holds
more than its shard and one block, and the model is the same whatever the number of ranks: one rank's shard is
exactly that part of the whole random model.

NOTE: seeded per parameter, not one stream over the model as ``from_config`` draws it: the same config and dtype on
the same device give the same model, but not the values ``from_config`` would. A family whose initialisation is its
own (``_init_weights`` overridden: GPT-2 rescales a block's output projections from the block's) is not made here
(:func:`random_shard` returns None): its modules' initialisations do not stand alone. Imports torch.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from tokenmill.engine.model.meta_model import Slot, empty_model, empty_shard, materialise, module_inits, new_tensor
from tokenmill.engine.model.tensor_parallel import Shard, ShardPlan

RANDOM_INIT_SEED = 0  # every random-weight load of one config and dtype builds the same model
BLOCK_ELEMENTS = 1 << 20  # a linear layer's weight is made in blocks of rows of about this many elements

Init = Callable[[nn.Module], None]


def random_shard(config: Any, dtype: torch.dtype, device: torch.device, attn_implementation: str,
                 shard: Shard | None = None) -> tuple[Any, ShardPlan | None] | None:
    """The model of ``config`` with random weights made on ``device``, cut to ``shard`` (None: whole), and its
    plan; None: a family whose initialisation is its own (module docstring). Leaves the caller's random state as
    it was.

    Raises:
        ModelLoadError: the model does not split over ``shard``'s ranks.
    """
    model = empty_model(config, dtype, attn_implementation)
    if any(type(m)._init_weights is not PreTrainedModel._init_weights  # noqa: SLF001 - overridden or not
           for m in model.modules() if isinstance(m, PreTrainedModel)):
        return None
    empty = empty_shard(model, shard)
    inits = module_inits(empty.model)
    scratch = _Scratch(device)

    def fill(slot: Slot) -> torch.Tensor:
        init = inits[slot.module]
        if isinstance(slot.module, nn.Linear):
            return _linear_part(slot, init, scratch, device)
        return _module_part(slot, init, device)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return materialise(empty, fill, device), empty.plan


class _Scratch:
    """One buffer for every block a rank makes but keeps only part of.

    NOTE: one, kept, rather than a block allocated and freed each time: glibc raises its mmap threshold to the size
    of a freed mapped block, after which blocks come from the heap, whose holes the process's RSS keeps: a peak
    32 MB over the 70 MB shard of tests/e2e/test_tensor_parallel_memory.py, 5 MB with this buffer."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffer = torch.empty(0, dtype=torch.uint8, device=device)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        if self._buffer.numel() < size:
            self._buffer = torch.empty(max(size, BLOCK_ELEMENTS * dtype.itemsize), dtype=torch.uint8,
                                       device=self._device)
        return self._buffer[:size].view(dtype).view(shape)


def _linear_part(slot: Slot, init: Init, scratch: _Scratch, device: torch.device) -> torch.Tensor:
    """A linear layer's weight or bias, the rank's part of it, made from the blocks of rows that hold it: in place
    where a block is all the rank's, else in ``scratch``, of which the rank's rows (and columns) are kept."""
    bias = slot.owners[0][1] == "bias"
    num_rows = slot.shape[0]
    block_rows = max(1, BLOCK_ELEMENTS // (1 if bias else slot.shape[1]))
    cut = slot.cut
    columns = cut if cut is not None and cut.dim == 1 else None
    rows = range(cut.start, cut.stop) if cut is not None and cut.dim == 0 else range(num_rows)
    out = new_tensor(slot.shard_shape, slot.dtype, device)
    for first in range(rows.start - rows.start % block_rows, rows.stop, block_rows):
        count = min(block_rows, num_rows - first)
        lo, hi = max(first, rows.start), min(first + count, rows.stop)
        if columns is None and (lo, hi) == (first, first + count):
            _init_block(out[lo - rows.start:hi - rows.start], slot.names[0], first, bias, init)
            continue
        values = scratch.take((count, *slot.shape[1:]), slot.dtype)
        _init_block(values, slot.names[0], first, bias, init)
        part = values[lo - first:hi - first]
        out[lo - rows.start:hi - rows.start] = columns.of(part) if columns is not None else part
    return out


def _init_block(target: torch.Tensor, name: str, first: int, bias: bool, init: Init) -> None:
    """Fill ``target``, rows ``first`` on of the parameter ``name``, by its module's initialisation of a linear layer
    that holds it as its weight (``bias``: as its bias, beside a one-column weight: Hugging Face zeros biases)."""
    torch.manual_seed(_seed(name, first))
    in_features = 1 if bias else target.shape[1]
    block = nn.Linear(in_features, target.shape[0], bias=bias, device="meta", dtype=target.dtype)
    if bias:
        block.weight = nn.Parameter(torch.empty(target.shape[0], 1, dtype=target.dtype, device=target.device),
                                    requires_grad=False)
    setattr(block, "bias" if bias else "weight", nn.Parameter(target, requires_grad=False))
    init(block)


def _module_part(slot: Slot, init: Init, device: torch.device) -> torch.Tensor:
    """A parameter of any other module (an embedding, a norm): that module's initialisation, on a copy of it with
    new tensors, so the parameters already made (a module's others) stay as they are."""
    stand_in = copy.deepcopy(slot.module).to_empty(device=device)
    torch.manual_seed(_seed(slot.names[0], 0))
    init(stand_in)
    value = getattr(stand_in, slot.owners[0][1]).detach()
    return value if slot.cut is None else slot.cut.of(value).clone()


def _seed(name: str, first_row: int) -> int:
    digest = hashlib.blake2b(f"{RANDOM_INIT_SEED}/{name}/{first_row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
