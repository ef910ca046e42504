"""A tensor-parallel rank loads its shard alone: from a safetensors checkpoint, every parameter and buffer
it holds is bitwise what loading the whole model and cutting it gives (the plain reference path, which a checkpoint
in another format still takes), and random weights are exactly that rank's part of the whole random model, for a
GQA model whose KV heads split (llama) and one whose single KV head is replicated (qwen2, with biases), over 2 and 4
ranks, with blocks of rows that straddle the ranks' boundaries. A family with an initialisation of its own (GPT-2)
keeps ``from_config``'s random weights."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from tests.tiny_models import VOCAB_SIZE, tiny_config
from tokenmill.engine.model import random_weights
from tokenmill.engine.model.hf_attention import register
from tokenmill.engine.model.model_loader import load_model, random_model
from tokenmill.engine.model.random_weights import RANDOM_INIT_SEED, random_shard
from tokenmill.engine.model.tensor_parallel import Shard, shard_model

pytestmark = pytest.mark.e2e

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def _shard(rank: int, world_size: int) -> Shard:
    return Shard(rank, world_size, lambda tensor: None)


def _assert_same(got: Any, want: Any) -> None:
    """The same parameters and buffers, by name, bitwise."""
    for mine, theirs in ((dict(got.named_parameters()), dict(want.named_parameters())),
                         (dict(got.named_buffers()), dict(want.named_buffers()))):
        assert mine.keys() == theirs.keys()
        assert [name for name in mine if not torch.equal(mine[name], theirs[name])] == []


def _reference(path: Path, shard: Shard) -> Any:
    """The whole model, loaded and cut (what every rank did before it loaded its shard alone)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation=register())
    shard_model(model, shard)
    return model


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_rank_reads_its_part_of_a_checkpoint(family: str, world_size: int,
                                               tiny_model_dirs: dict[str, Path]) -> None:
    path = tiny_model_dirs[family]
    whole = load_file(path / "model.safetensors")
    config = AutoConfig.from_pretrained(path)
    kv_replicated = world_size > config.num_key_value_heads
    for rank in range(world_size):
        shard = _shard(rank, world_size)
        loaded = load_model(str(path), device="cpu", dtype="float64", attn_implementation=register(), shard=shard)
        _assert_same(loaded.model, _reference(path, shard))
        layer = loaded.model.model.layers[0]
        for name in PROJECTIONS:
            module = layer.get_submodule(name)
            held = getattr(module, "linear", module).weight.numel()
            split = not (kv_replicated and name in ("self_attn.k_proj", "self_attn.v_proj"))
            full = whole[f"model.layers.0.{name}.weight"].numel()
            assert held == (full // world_size if split else full // config.num_key_value_heads), name


def test_a_checkpoint_in_another_format_is_loaded_whole_and_cut(tiny_model_dirs: dict[str, Path],
                                                              tmp_path: Path) -> None:
    """No safetensors file: the rank loads the whole model (``pytorch_model.bin``) and cuts it, as before."""
    path = tmp_path / "bin"
    shutil.copytree(tiny_model_dirs["qwen2"], path)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    shard = _shard(1, 2)
    loaded = load_model(str(path), device="cpu", dtype="float64", attn_implementation=register(), shard=shard)
    _assert_same(loaded.model, _reference(tiny_model_dirs["qwen2"], shard))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_random_weights_of_a_rank_are_its_part_of_the_whole_random_model(family: str, world_size: int,
                                                                         tiny_model_dirs: dict[str, Path],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 5 rows of 64 (of 3 rows of 128 for down_proj), so the ranks' rows start mid-block."""
    monkeypatch.setattr(random_weights, "BLOCK_ELEMENTS", 320)
    config = AutoConfig.from_pretrained(tiny_model_dirs[family])
    cpu = torch.device("cpu")
    for rank in range(world_size):
        whole = random_model(config, torch.float64, cpu, register())
        shard_model(whole, _shard(rank, world_size))
        alone = random_shard(config, torch.float64, cpu, register(), _shard(rank, world_size))
        assert alone is not None
        _assert_same(alone[0], whole)


def test_random_weights_are_seeded_and_leave_the_callers_random_state(tiny_model_dirs: dict[str, Path]) -> None:
    """The same model every time, Hugging Face's initialisation (std ``initializer_range``, unit norms, a zero
    padding row), and the caller's random numbers go on as if none had been drawn."""
    config = AutoConfig.from_pretrained(tiny_model_dirs["llama"])
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = random_model(config, torch.float64, torch.device("cpu"), register())
    assert torch.equal(torch.rand(3), expected)
    _assert_same(random_model(config, torch.float64, torch.device("cpu"), register()), first)
    layer = first.model.layers[0]
    assert abs(layer.mlp.gate_proj.weight.std().item() - config.initializer_range) < 0.002
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    assert not first.model.embed_tokens.weight[config.pad_token_id].any()


def test_a_family_with_an_initialisation_of_its_own_is_made_by_from_config() -> None:
    """GPT-2 rescales its blocks' output projections from the block's initialisation, which a parameter made alone
    would miss: its random model is ``from_config``'s, seeded (it cannot be split over ranks anyway)."""
    config = tiny_config("gpt2", VOCAB_SIZE, eos_token_id=2)
    cpu = torch.device("cpu")
    assert random_shard(config, torch.float64, cpu, register()) is None
    with torch.random.fork_rng():
        torch.manual_seed(RANDOM_INIT_SEED)
        want = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float64,
                                                attn_implementation=register())
    _assert_same(random_model(config, torch.float64, cpu, register()), want)
