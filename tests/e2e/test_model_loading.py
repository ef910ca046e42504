"""Model loading: directories, the GGUF alias and its safetensors cache, and clear errors for
missing models, non-decoder and unsupported architectures."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import T5Config, ViTConfig

from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.model.hf_attention import register
from tokenmill.engine.model.model_loader import load_model, resolve_model_path

pytestmark = pytest.mark.e2e


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "nope.gguf"), attn_implementation=register())
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "no-such-dir") + "/", attn_implementation=register())
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_model(str(empty), attn_implementation=register())


def test_encoder_decoder_model_is_refused(tmp_path: Path) -> None:
    T5Config(d_model=16, num_layers=1, num_heads=2, d_ff=32, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="encoder-decoder"):
        load_model(str(tmp_path), attn_implementation=register())


def test_model_without_causal_lm_head_is_refused(tmp_path: Path) -> None:
    config = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="decoder-only"):
        load_model(str(tmp_path), attn_implementation=register())


def test_tiny_directory_loads_with_eos_and_context(tiny_model_dirs: dict[str, Path]) -> None:
    loaded = load_model(str(tiny_model_dirs["qwen2"]), device="cpu", dtype="float64", attn_implementation=register())
    assert loaded.eos_token_ids == frozenset({loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert loaded.max_model_len == 1024
    assert loaded.model.config._attn_implementation == register()


@pytest.mark.slow
def test_smollm2_alias_resolves_to_the_wheel_gguf_and_caches_safetensors() -> None:
    path = resolve_model_path("smollm2-135m")
    assert isinstance(path, Path) and path.suffix == ".gguf" and path.exists()
    loaded = load_model("smollm2-135m", device="cpu", attn_implementation=register())
    cached = Path(loaded.source)
    assert (cached / "model.safetensors").exists() and (cached / "config.json").exists()
    assert loaded.tokenizer.chat_template and loaded.model.config.model_type == "llama"
