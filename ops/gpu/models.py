"""The models the GPU check runs, as config folders for ``[engine.model] random_init``: SmolLM2-135M's
own config and tokenizer (a few MB, where its 98 MB GGUF cannot travel to the GPU machine), an
8B-shaped Llama, and the tiny shapes of the check's dry mode. Imports transformers, not torch's GPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# Where ops/gpu/prepare.sh puts SmolLM2's files (git-ignored: .git/info/exclude), carried to the GPU machine.
SMOLLM2_FILES = REPO_ROOT / ".gpu" / "smollm2"
# What a Hugging Face tokenizer and model config are saved as (weights excluded).
_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "chat_template.jinja")

# Llama-3-8B's shape (max_position_embeddings cut to 8192: the check's contexts are 4k at most).
LLAMA_8B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001,
)
# The dry mode's stand-ins: the same code paths at shapes a CPU runs in seconds.
TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)
TINY_SMOLLM2: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16)


def export_smollm2_files(dest: Path) -> Path:
    """SmolLM2's config and tokenizer files in ``dest``, from the installed ``smollm2-135m`` alias: copied
    from the engine's dequantized cache when it is there, else read from the GGUF's metadata (seconds)."""
    from tokenmill.engine.model.model_loader import _gguf_cache_path, default_cache_dir, resolve_model_path

    gguf = resolve_model_path("smollm2-135m")
    assert isinstance(gguf, Path)
    dest.mkdir(parents=True, exist_ok=True)
    cached = _gguf_cache_path(gguf, default_cache_dir())
    if (cached / "config.json").exists() and (cached / "tokenizer.json").exists():
        for name in _MODEL_FILES:
            if (cached / name).exists():
                shutil.copy2(cached / name, dest / name)
        return dest
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)
    return dest


def shrunk(files: Path, dest: Path, shape: dict[str, Any]) -> Path:
    """``files`` (a config and its tokenizer) with the config's shape replaced by ``shape``: the dry
    mode's SmolLM2 keeps the real tokenizer and vocabulary at a tiny width and depth."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in _MODEL_FILES:
        if (files / name).exists():
            shutil.copy2(files / name, dest / name)
    config = json.loads((files / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **shape}, indent=2))
    return dest


def llama_config(dest: Path, shape: dict[str, Any]) -> Path:
    """A folder holding the ``config.json`` of a Llama of ``shape`` (no tokenizer: token-id prompts)."""
    from transformers import LlamaConfig

    dest.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape).save_pretrained(dest)
    return dest
