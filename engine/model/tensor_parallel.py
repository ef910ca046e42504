"""Tensor parallelism's split rules: which part of every decoder layer one rank holds (Megatron-style), as the
part of each whole-model parameter it keeps (:func:`shard_cuts`, by the checkpoint's names: what a rank's loader
reads or makes alone, engine/model/shard_loader.py and random_weights.py), and the in-place cut of a Hugging Face
model to that part (:func:`shard_model`: of an empty model, the shard's shapes; of a loaded one, the plain
reference path).

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


@dataclass(frozen=True)
class Cut:
    """The part of one whole-model parameter a rank keeps: ``[start, stop)`` along ``dim`` (0: a weight's rows, the
    output features, or a bias's entries; 1: a weight's columns, the input features)."""

    dim: int
    start: int
    stop: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tensor`` (a view)."""
        return tensor.narrow(self.dim, self.start, self.stop - self.start)


# A rank's part of each parameter the shard cuts, by its name in the whole model (a checkpoint's names): a Cut, or
# None where the rank keeps none of it (a row-parallel bias off rank 0). A parameter not named is kept whole.
Cuts = dict[str, Cut | None]


def plan_model(model: Any, rank: int, world_size: int) -> ShardPlan:
    """:func:`plan_shard` for a causal LM's own config and layers (the model may be on the meta device).

    Raises:
        ModelLoadError: the model lacks the Llama-style projections, or they do not split over the ranks.
    """
    layers = _decoder_layers(model)
    return plan_shard(model.config, layers[0].mlp.gate_proj.out_features, rank, world_size)


def shard_cuts(model: Any, plan: ShardPlan) -> Cuts:
    """What ``plan``'s rank keeps of each projection of the whole (not yet sharded) ``model`` (module docstring):
    the one statement of the ranges, which :func:`shard_model` cuts in memory and a shard's loader reads alone."""
    names = {module: name for name, module in model.named_modules()}
    dim = plan.head_dim
    heads = (plan.heads.start * dim, plan.heads.stop * dim)
    kv_heads = (plan.kv_heads.start * dim, plan.kv_heads.stop * dim)
    channels = (plan.intermediate.start, plan.intermediate.stop)
    cuts: Cuts = {}
    for layer in _decoder_layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        for linear, (start, stop) in ((attn.q_proj, heads), (attn.k_proj, kv_heads), (attn.v_proj, kv_heads),
                                      (mlp.gate_proj, channels), (mlp.up_proj, channels)):  # column-parallel
            cuts[f"{names[linear]}.weight"] = Cut(0, start, stop)
            if linear.bias is not None:
                cuts[f"{names[linear]}.bias"] = Cut(0, start, stop)
        for linear, (start, stop) in ((attn.o_proj, heads), (mlp.down_proj, channels)):  # row-parallel
            cuts[f"{names[linear]}.weight"] = Cut(1, start, stop)
            if linear.bias is not None and plan.rank:
                cuts[f"{names[linear]}.bias"] = None
    return cuts


def shard_model(model: Any, shard: Shard) -> ShardPlan:
    """Cut a causal LM down, in place, to ``shard``'s part of every decoder layer (module docstring), and make its
    row-parallel layers sum over the ranks. On a loaded model this is the plain reference path (the whole model
    was in memory); on an empty one (the meta device) it gives the shard's shapes, which its loader then fills
    (engine/model/shard_loader.py).

    Raises:
        ModelLoadError: the model lacks the Llama-style projections, or they do not split over the ranks.
    """
    plan = plan_model(model, shard.rank, shard.world_size)
    for name, cut in shard_cuts(model, plan).items():
        owner, attr = name.rsplit(".", 1)
        module = model.get_submodule(owner)
        kept = None if cut is None else \
            nn.Parameter(cut.of(getattr(module, attr).detach()).clone(), requires_grad=False)
        module.register_parameter(attr, kept)
    layers = _decoder_layers(model)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            linear.out_features, linear.in_features = linear.weight.shape
        attn.o_proj = RowParallelLinear(attn.o_proj, shard.all_reduce)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, shard.all_reduce)
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
