"""Tensor parallelism's split rules: which part of every decoder layer one rank holds, and the in-place
sharding of a loaded Hugging Face model to that part (Megatron-style).

Per decoder layer, with N ranks, rank r holds:

- attention: query heads ``[r * H/N, (r + 1) * H/N)`` (q_proj's rows, column-parallel) and the KV heads they
  read (k_proj's and v_proj's rows): ``KV/N`` of them when N divides the KV heads, else (N a multiple of KV,
  fewer KV heads than ranks) the one KV head its query heads share, replicated on N/KV ranks. o_proj keeps
  the matching input columns (row-parallel): its output is a partial sum, all-reduced across ranks.
- MLP: gate_proj's and up_proj's rows ``[r * I/N, (r + 1) * I/N)`` (column-parallel) and down_proj's matching
  input columns (row-parallel), all-reduced.

So a layer costs two all-reduces of its hidden states. A row-parallel layer's bias is added by rank 0 alone
(before the sum), so it counts once. Embeddings, norms, rotary tables and the LM head stay whole on every rank.
The rules read only the modules' names and shapes (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
as in llama, mistral and qwen2), so no model family needs code of its own; a model without that layout is
refused. Sharding runs before the CPU's linear layers are packed (engine/kernels/cpu_linear.py), which then
pack the shards. Imports torch (a loading helper).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill.engine.errors import ModelLoadError

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over every rank, in place


@dataclass(frozen=True)
class ForwardShape:
    """The all-reduces of one sharded forward over T tokens: ``num_all_reduces`` of them (two per decoder layer, in
    the eager forward and the native stack alike), each of ``T * hidden_size`` elements of ``dtype``. A rank whose
    forward fails makes the rest of them (engine/model/tp_group.py), so that every rank's collectives still pair."""

    num_all_reduces: int
    hidden_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Shard:
    """Which shard a rank loads, and how its row-parallel layers sum their outputs across the ranks.

    ``on_sharded``: told the sharded forward's all-reduces once the model is cut (its rank's process groups count
    them per step: :meth:`engine.model.tp_group.ProcessGroups.expect_forward`)."""

    rank: int
    world_size: int
    all_reduce: AllReduce
    on_sharded: Callable[[ForwardShape], None] | None = None


@dataclass(frozen=True)
class ShardPlan:
    """The part of every decoder layer one rank holds (the same ranges in every layer)."""

    rank: int
    world_size: int
    head_dim: int
    heads: range  # query heads
    kv_heads: range  # KV heads those query heads read (this rank's KV pool holds only these)
    intermediate: range  # MLP channels

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def plan_shard(config: Any, intermediate_size: int, rank: int, world_size: int) -> ShardPlan:
    """The split rules (module docstring) for one rank of a Hugging Face decoder config.

    Raises:
        ModelLoadError: the heads, KV heads or MLP channels do not split over ``world_size`` ranks.
    """
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    size = f"tensor_parallel_size = {world_size}"
    if heads % world_size:
        raise ModelLoadError(f"{size}: num_attention_heads ({heads}) must divide by it; choose a divisor of {heads}")
    if intermediate_size % world_size:
        raise ModelLoadError(f"{size}: intermediate_size ({intermediate_size}) must divide by it")
    if kv_heads % world_size and world_size % kv_heads:
        raise ModelLoadError(f"{size}: num_key_value_heads ({kv_heads}) must divide by it, or divide it (fewer "
                             "KV heads than ranks are replicated)")
    local_heads, local_channels = heads // world_size, intermediate_size // world_size
    group = heads // kv_heads  # query heads per KV head
    first_head = rank * local_heads
    first_kv = first_head // group
    num_kv = max(1, local_heads // group)
    return ShardPlan(rank, world_size, head_dim, range(first_head, first_head + local_heads),
                     range(first_kv, first_kv + num_kv),
                     range(rank * local_channels, (rank + 1) * local_channels))


class RowParallelLinear(nn.Module):
    """A row-parallel layer's shard (``linear``, over this rank's input columns) followed by the all-reduce
    that sums every rank's partial output. ``linear`` stays a child, so packing replaces it in place."""

    def __init__(self, linear: nn.Linear, all_reduce: AllReduce) -> None:
        super().__init__()
        self.linear = linear
        self._all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x).contiguous()
        self._all_reduce(out)
        return out


def shard_model(model: Any, shard: Shard) -> ShardPlan:
    """Cut a loaded causal LM down, in place, to ``shard``'s part of every decoder layer (module docstring).

    Raises:
        ModelLoadError: the model lacks the Llama-style projections, or they do not split over the ranks.
    """
    layers = _decoder_layers(model)
    plan = plan_shard(model.config, layers[0].mlp.gate_proj.out_features, shard.rank, shard.world_size)
    dim = plan.head_dim
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn.q_proj, plan.heads.start * dim, plan.heads.stop * dim)
        for kv in (attn.k_proj, attn.v_proj):
            _keep_rows(kv, plan.kv_heads.start * dim, plan.kv_heads.stop * dim)
        _keep_rows(mlp.gate_proj, plan.intermediate.start, plan.intermediate.stop)
        _keep_rows(mlp.up_proj, plan.intermediate.start, plan.intermediate.stop)
        attn.o_proj = _row_parallel(attn.o_proj, plan.heads.start * dim, plan.heads.stop * dim, shard)
        mlp.down_proj = _row_parallel(mlp.down_proj, plan.intermediate.start, plan.intermediate.stop, shard)
        if hasattr(attn, "num_key_value_groups"):  # HF's eager attention repeats KV heads by it: keep it true
            attn.num_key_value_groups = len(plan.heads) // plan.num_kv_heads
    if shard.on_sharded is not None:
        o_proj = layers[0].self_attn.o_proj.linear
        shard.on_sharded(ForwardShape(2 * len(layers), o_proj.out_features, o_proj.weight.dtype))
    return plan


def _decoder_layers(model: Any) -> list[Any]:
    base = getattr(model, "model", None)
    layers = list(getattr(base, "layers", None) or [])[: model.config.num_hidden_layers]
    names = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    if not layers or not all(type(getattr(getattr(layer, part, None), name, None)) is nn.Linear
                             for layer in layers for part, projections in names.items() for name in projections):
        raise ModelLoadError(f"tensor parallelism needs Llama-style layers (model.layers[*] with self_attn."
                             "q/k/v/o_proj and mlp.gate/up/down_proj linear layers); "
                             f"{type(model).__name__} has none; use tensor_parallel_size = 1")
    return layers


def _keep_rows(linear: nn.Linear, start: int, stop: int) -> None:
    """Column-parallel: keep output features ``[start, stop)`` (the weight's rows, the bias's entries)."""
    linear.weight = nn.Parameter(linear.weight.detach()[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def _row_parallel(linear: nn.Linear, start: int, stop: int, shard: Shard) -> RowParallelLinear:
    """Row-parallel: keep input features ``[start, stop)`` (the weight's columns); the bias stays on rank 0 only."""
    linear.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone(), requires_grad=False)
    linear.in_features = stop - start
    if shard.rank:
        linear.register_parameter("bias", None)
    return RowParallelLinear(linear, shard.all_reduce)
