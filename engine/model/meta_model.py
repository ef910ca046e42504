"""An empty model (every tensor on the meta device: shapes, no memory) cut to one tensor-parallel rank's shard,
and its materialisation one parameter at a time, so a rank never holds more than its shard plus the one
tensor being filled. The checkpoint's reader (engine/model/shard_loader.py) and the random weights
(engine/model/random_weights.py) are the two ways to fill it; without a shard it is the whole model.

Buffers (the rotary tables) are not weights: each is computed on the device by its module's own Hugging Face
initialisation, as ``from_pretrained`` does for buffers a checkpoint does not hold. Imports torch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.model.kv_cache import lazy_zeros
from tokenmill.engine.model.tensor_parallel import Cut, Shard, ShardPlan, plan_model, shard_cuts, shard_model


@dataclass(frozen=True)
class Slot:
    """One parameter of the whole model and this rank's part of it.

    ``names``: its names in the whole model (tied parameters, an LM head sharing the embedding, have several);
    ``owners``: the (module, attribute) pairs holding it, the same modules after sharding; ``cut``: the part kept
    (None: all of it).
    """

    names: tuple[str, ...]
    owners: tuple[tuple[nn.Module, str], ...]
    shape: torch.Size  # in the whole model
    dtype: torch.dtype
    cut: Cut | None

    @property
    def module(self) -> nn.Module:
        return self.owners[0][0]

    @property
    def shard_shape(self) -> torch.Size:
        if self.cut is None:
            return self.shape
        shape = list(self.shape)
        shape[self.cut.dim] = self.cut.stop - self.cut.start
        return torch.Size(shape)


@dataclass
class EmptyShard:
    """A model on the meta device, already cut to ``plan``'s shard (None: whole), and the parameters it keeps."""

    model: Any
    plan: ShardPlan | None
    slots: list[Slot]


def empty_model(config: Any, dtype: torch.dtype, attn_implementation: str) -> Any:
    """The causal LM of ``config`` on the meta device.

    NOTE: the config is copied: transformers sets the attention implementation on the config it is given, which
    would switch the model that config came from to ``attn_implementation`` too."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype,  # type: ignore[no-untyped-call]
                                                attn_implementation=attn_implementation)


def empty_shard(model: Any, shard: Shard | None) -> EmptyShard:
    """An :func:`empty_model` cut, in place, to ``shard`` (engine/model/tensor_parallel.py's rules; None: whole).

    Raises:
        ModelLoadError: the model does not split over ``shard``'s ranks.
    """
    plan = plan_model(model, shard.rank, shard.world_size) if shard is not None else None
    cuts = shard_cuts(model, plan) if plan is not None else {}
    found: dict[int, tuple[list[str], list[tuple[nn.Module, str]], torch.Tensor]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, attr = name.rpartition(".")[::2]
        names, owners, _ = found.setdefault(id(param), ([], [], param))
        names.append(name)
        owners.append((model.get_submodule(owner), attr))
    if shard is not None:
        shard_model(model, shard)
    slots = [Slot(tuple(names), tuple(owners), param.shape, param.dtype, cuts.get(names[0]))
             for names, owners, param in found.values() if getattr(owners[0][0], owners[0][1]) is not None]
    return EmptyShard(model, plan, slots)


def materialise(empty: EmptyShard, fill: Callable[[Slot], torch.Tensor], device: torch.device) -> Any:
    """Give ``empty``'s model real tensors on ``device``: its buffers first (their modules' initialisation), then
    each parameter ``fill`` returns (of the slot's ``shard_shape``), one at a time. Returns the model.

    Raises:
        ModelLoadError: ``fill`` gave a tensor of another shape.
    """
    model = empty.model
    with torch.no_grad():
        for module, init in module_inits(model).items():
            meta = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
            for name in meta:
                setattr(module, name, torch.empty_like(getattr(module, name), device=device))
            if meta:
                init(module)  # NOTE: its parameters, if any, are still meta here: only the buffers get values
        for slot in empty.slots:
            tensor = fill(slot)
            if tensor.shape != slot.shard_shape:
                raise ModelLoadError(f"{slot.names[0]}: expected shape {tuple(slot.shard_shape)}, got "
                                     f"{tuple(tensor.shape)}")
            param = nn.Parameter(tensor, requires_grad=False)
            for module, attr in slot.owners:
                setattr(module, attr, param)
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise ModelLoadError(f"{type(model).__name__}: no values for {', '.join(left[:5])}")
    return model


def new_tensor(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor for a parameter being filled; on the CPU, in an anonymous mapping of its own.

    NOTE: so that the memory goes back to the system as soon as the tensor is freed: the CPU packs its linear layers
    after the load (engine/kernels/cpu_linear.py), freeing each plain weight as it packs it, and freed heap chunks
    would stay resident (glibc), leaving a rank at twice its shard after packing.
    """
    return lazy_zeros(tuple(shape), dtype) if device.type == "cpu" else torch.empty(shape, dtype=dtype, device=device)


def module_inits(model: Any) -> dict[nn.Module, Callable[[nn.Module], None]]:
    """Each module's Hugging Face initialisation: the ``_init_weights`` of the nearest model holding it (a composite
    model's parts each have their own, as ``PreTrainedModel.initialize_weights`` dispatches them)."""
    inits: dict[nn.Module, Callable[[nn.Module], None]] = {}

    def walk(module: nn.Module, init: Callable[[nn.Module], None]) -> None:
        inits[module] = init
        for child in module.children():
            walk(child, child._init_weights if isinstance(child, PreTrainedModel) else init)  # noqa: SLF001

    walk(model, model._init_weights)  # noqa: SLF001 - Hugging Face's initialisation of one module
    return inits
