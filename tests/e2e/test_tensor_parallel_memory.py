"""A tensor-parallel rank's host memory while it loads: its shard, not the whole model. Each load runs in
a fresh process whose peak RSS (``VmHWM``, reset once the imports and a warm-up load are done) is compared with the
bytes of the rank's shard and of the whole model, for a safetensors checkpoint and for random weights, on the CPU.
The model is large enough (144 MB of float32, 98% of it in the sharded projections) that a rank that held the whole
model at any moment would show it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.tiny_models import build_tokenizer, save_tiny_model

pytestmark = pytest.mark.e2e

# NOTE: in a process of its own: a warm-up load (the tiny model) first, so the imports and the allocator's first
# arenas are in the baseline; then the peak is reset (/proc/self/clear_refs, 5) and only the measured load counts.
_MEASURE = textwrap.dedent("""
    import gc, json, sys
    from tokenmill.engine.model.hf_attention import register
    from tokenmill.engine.model.model_loader import load_model
    from tokenmill.engine.model.tensor_parallel import Shard

    def status(key):
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

    model, warm_up, random_init, rank = sys.argv[1], sys.argv[2], sys.argv[3] == "random", int(sys.argv[4])

    def load(name):
        return load_model(name, device="cpu", dtype="float32", attn_implementation=register(), random_init=random_init,
                          linear_kernel="off", shard=Shard(rank, 2, lambda tensor: None) if rank >= 0 else None).model

    load(warm_up)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    baseline = status("VmRSS")
    loaded = load(model)
    peak = status("VmHWM")
    held = sum(t.nbytes for t in [*loaded.parameters(), *loaded.buffers()])
    print(json.dumps({"peak": peak - baseline, "held": held}))
""")


def _measure(model: Path, warm_up: Path, weights: str, rank: int) -> dict[str, int]:
    """Peak RSS above the baseline while ``model`` loads (``rank`` of 2; -1: whole), and the bytes it holds."""
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(model), str(warm_up), weights, str(rank)],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Llama of 144 MB (float32) saved with a tokenizer, and the tiny Llama for the warm-up."""
    root = tmp_path_factory.mktemp("tp-memory")
    tokenizer = build_tokenizer()
    config = LlamaConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=len(tokenizer), max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    big = root / "big"
    model.save_pretrained(big, safe_serialization=True)
    tokenizer.save_pretrained(big)
    layers = model.model.layers
    sharded = sum(p.nbytes for layer in layers for part in (layer.self_attn, layer.mlp) for p in part.parameters())
    whole = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    del model
    return {"big": big, "tiny": save_tiny_model("llama", root / "tiny"), "whole": whole, "sharded": sharded}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("weights", ["checkpoint", "random"])
def test_a_rank_never_holds_more_than_its_shard(weights: str, models: dict[str, Any]) -> None:
    """Rank 1 of 2 holds half of every projection and the embeddings and norms whole; at its peak while loading
    it held less than halfway from that to the whole model (the whole model at once would be more than all of it)."""
    whole, sharded = models["whole"], models["sharded"]
    got = _measure(models["big"], models["tiny"], weights, rank=1)
    assert got["held"] == whole - sharded // 2
    assert got["peak"] < got["held"] + (whole - got["held"]) // 2, \
        f"peak {got['peak'] / 2**20:.0f} MiB above the baseline for a {got['held'] / 2**20:.0f} MiB shard of a " \
        f"{whole / 2**20:.0f} MiB model"


@pytest.mark.timeout(600)
def test_the_measure_sees_a_whole_load(models: dict[str, Any]) -> None:
    """The same measure over a whole-model load (no shard): its peak is at least the whole model, so a rank that
    loaded the whole model before cutting it would fail the test above."""
    got = _measure(models["big"], models["tiny"], "checkpoint", rank=-1)
    assert got["held"] == models["whole"]
    assert got["peak"] >= models["whole"]
