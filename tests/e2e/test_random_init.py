"""A random-weight model from a bare config.json (``[engine.model] random_init``): the engine builds
it on the device with no checkpoint and no tokenizer, generates from token ids with Hugging Face's
greedy tokens on the same random model, and refuses text prompts and structured output clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tests.e2e.parity_helpers import hf_greedy, random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import VOCAB_SIZE, save_tiny_model, tiny_config
from tokenmill.engine import EngineConfig
from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.model.hf_attention import register
from tokenmill.engine.model.model_loader import load_model, random_model
from tokenmill.engine.output.no_tokenizer import NoTokenizer
from tokenmill.protocol.sampling import ResponseFormat, SamplingParams

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny Llama's config.json and nothing else."""
    path = tmp_path_factory.mktemp("random-llama")
    tiny_config("llama", VOCAB_SIZE, eos_token_id=2).save_pretrained(path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]
    return path


def test_greedy_matches_hf_generate_on_the_same_random_model(config_dir: Path) -> None:
    engine = build_engine(str(config_dir), random_init=True, device="cpu", dtype="float64", kv_cache_memory="8MiB",
                          block_size=4)
    assert isinstance(engine.tokenizer, NoTokenizer)
    prompts = random_prompts(VOCAB_SIZE, 6, seed=4, max_len=40)
    reference = random_model(engine.runner.model.config, torch.float64, torch.device("cpu"), "sdpa").eval()
    expected = [hf_greedy(reference, p, 16) for p in prompts]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), progress=False)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.error is None and o.text == "" for o in outputs)
    [with_logprobs] = engine.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2),
                                      progress=False)
    assert with_logprobs.token_ids == expected[0][:4] and with_logprobs.token_logprobs is not None
    assert [t.token for t in with_logprobs.token_logprobs] == [""] * 4  # no tokenizer: no token text


def test_a_config_json_file_builds_the_same_model(config_dir: Path) -> None:
    by_dir = load_model(str(config_dir), device="cpu", dtype="float32", attn_implementation=register(),
                        random_init=True)
    by_file = load_model(str(config_dir / "config.json"), device="cpu", dtype="float32",
                         attn_implementation=register(), random_init=True)
    embedding = by_dir.model.get_input_embeddings().weight
    assert torch.equal(embedding, by_file.model.get_input_embeddings().weight)
    assert by_dir.eos_token_ids == frozenset({2}) and by_dir.max_model_len == 1024


def test_text_prompts_and_structured_output_are_refused_without_a_tokenizer(config_dir: Path) -> None:
    engine = build_engine(str(config_dir), random_init=True, device="cpu", dtype="float32", kv_cache_memory="8MiB")
    text, chat = engine.generate(["hello", [{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=2),
                                 progress=False)
    assert text.error is not None and "send prompt_token_ids" in text.error
    assert chat.error is not None and "send prompt_token_ids" in chat.error
    structured = SamplingParams(max_tokens=2, response_format=ResponseFormat(type="json_object"))
    engine.add_request("structured", [5, 6, 7], structured)
    outputs = [o for _ in range(3) for o in engine.step()]
    assert [o.request_id for o in outputs] == ["structured"] and outputs[0].finished
    assert outputs[0].error is not None and "structured output" in outputs[0].error


def test_a_tokenizer_beside_the_config_is_used(tmp_path: Path) -> None:
    path = save_tiny_model("llama", tmp_path / "llama")
    (path / "model.safetensors").unlink()  # only the config and tokenizer remain
    engine = build_engine(str(path), random_init=True, device="cpu", dtype="float32", kv_cache_memory="8MiB")
    [output] = engine.generate(["The quick brown fox"], SamplingParams(max_tokens=4, ignore_eos=True), progress=False)
    assert output.error is None and len(output.token_ids) == 4


def test_random_init_needs_a_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a directory holding config.json"):
        load_model(str(tmp_path), attn_implementation=register(), random_init=True)
    for name in ("echo", "model.gguf"):
        with pytest.raises(ValidationError, match="random_init builds a model from a config.json"):
            EngineConfig.model_validate({"model": {"name": name, "random_init": True}})
