"""A tensor-parallel rank's shard of a safetensors checkpoint, read alone: the model is made empty (meta device)
and cut to the shard (engine/model/meta_model.py), then each parameter is read through
``safe_open(...).get_slice(name)``, only the rows or columns the rank keeps (engine/model/tensor_parallel.py's
cuts), into memory of its own on the device, in the model's dtype. A rank holds its shard plus the tensor being
read, where loading the whole model first held all of it on every rank.

NOTE: safetensors maps the file, and a slice is a view of the mapping: copying it reads (and makes resident) only
the pages of its rows, or, for a row-parallel layer's columns, the pages its columns touch in every row. Those
pages count in the process's RSS while the file is mapped, so each tensor is read with the file opened for it
alone: mapped pages never add up over the checkpoint.

A checkpoint read this way must be safetensors holding every parameter under the model's own names (tied ones
under one of theirs) and no buffers; :func:`load_shard` returns None for any other, which the caller loads whole
and cuts (the plain reference path, engine/model/model_loader.py). Imports torch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import GenerationConfig
from transformers.utils.hub import cached_file

from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.model.meta_model import Slot, empty_model, empty_shard, materialise, new_tensor
from tokenmill.engine.model.tensor_parallel import Shard, ShardPlan

logger = logging.getLogger(__name__)


def load_shard(path: Path | str, config: Any, dtype: torch.dtype, device: torch.device, attn_implementation: str,
               shard: Shard) -> tuple[Any, ShardPlan] | None:
    """``shard``'s part of the checkpoint at ``path`` (a directory, or a hub id in the local cache) on ``device``,
    and its plan; None: not a checkpoint this reads (module docstring).

    Raises:
        ModelLoadError: the model does not split over the ranks, or a tensor's shape is not the model's.
    """
    directory = _local_directory(path)
    files = _checkpoint_files(directory) if directory is not None else None
    if directory is None or files is None:
        logger.info("tensor parallelism: %s holds no safetensors checkpoint; loading the whole model to cut it", path)
        return None
    model = empty_model(config, dtype, attn_implementation)
    unread = _unread(model, files)
    if unread:
        logger.info("tensor parallelism: %s lacks the model's names (%s); loading the whole model to cut it", path,
                    ", ".join(unread[:3]))
        return None
    empty = empty_shard(model, shard)
    assert empty.plan is not None, "cut to a shard"
    materialise(empty, lambda slot: _read_part(files, slot, device), device)
    if (directory / "generation_config.json").is_file():  # as from_pretrained: the checkpoint's generation defaults
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model, empty.plan


def _checkpoint_files(directory: Path) -> dict[str, Path] | None:
    """The file holding each tensor of the safetensors checkpoint in ``directory`` (``model.safetensors``, or the
    files ``model.safetensors.index.json`` maps); None: there is none."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def _read_part(files: dict[str, Path], slot: Slot, device: torch.device) -> torch.Tensor:
    """The rank's part of ``slot`` from the checkpoint, copied into a tensor of its own on ``device``.

    Raises:
        ModelLoadError: the checkpoint's tensor has another shape than the model's.
    """
    name = next(n for n in slot.names if n in files)
    with safe_open(files[name], framework="pt") as handle:
        whole = handle.get_slice(name)
        if tuple(whole.get_shape()) != tuple(slot.shape):
            raise ModelLoadError(f"{name}: the checkpoint's shape {tuple(whole.get_shape())} is not the model's "
                                 f"{tuple(slot.shape)}")
        cut = slot.cut
        view = whole[(slice(None),) * cut.dim + (slice(cut.start, cut.stop),)] if cut is not None else whole[:]
        part = new_tensor(slot.shard_shape, slot.dtype, device)
        part.copy_(view)
    return part


def _unread(model: Any, files: dict[str, Path]) -> list[str]:
    """What of ``model`` the checkpoint would leave unset: parameters under none of their names, and buffers a
    checkpoint holds (persistent ones), which this loader does not read."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    params = {name for group in names.values() for name in group}
    missing = [group[0] for group in names.values() if not any(name in files for name in group)]
    return missing + [name for name in model.state_dict() if name not in params]


def _local_directory(path: Path | str) -> Path | None:
    """The directory of a local checkpoint, or of a hub id's snapshot in the local cache (None: not there)."""
    if isinstance(path, Path):
        return path if path.is_dir() else None
    try:
        config_file = cached_file(path, "config.json", local_files_only=True)
    except OSError:
        return None
    return Path(config_file).parent if config_file else None
