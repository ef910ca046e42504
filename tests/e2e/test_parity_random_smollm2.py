"""SmolLM2-135M's shape from its config with random weights, float32: the engine's greedy tokens equal
Hugging Face ``generate`` on the same random model, except where the reference's top two logits are
a near-tie. On the CPU (slow) and on CUDA (marked ``gpu``: the Triton kernel, decode steps in CUDA
graphs), where the real weights cannot travel: ``TOKENMILL_SMOLLM2_FILES`` names a directory with
SmolLM2's config and tokenizer (ops/gpu/prepare.sh makes one); without it they come from the alias."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ops.gpu.models import export_smollm2_files
from tests.e2e.parity_helpers import DEVICES, assert_parity, attention_backend, hf_greedy, random_prompts
from tests.engine_helpers import build_engine
from tokenmill.engine.model.model_loader import random_model
from tokenmill.engine.model.model_runner import ModelRunner
from tokenmill.engine.model.static_decode import CapturedStep
from tokenmill.protocol.sampling import SamplingParams

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("TOKENMILL_SMOLLM2_FILES")
    return Path(given) if given else export_smollm2_files(tmp_path_factory.mktemp("smollm2"))


@pytest.mark.parametrize("device", DEVICES)
def test_random_smollm2_greedy_matches_hf_generate(device: str, smollm2_files: Path) -> None:
    engine = build_engine(str(smollm2_files), random_init=True, device=device, dtype="float32",
                          kv_cache_memory="256MiB", attention_backend=attention_backend("kernel", device))
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    reference = random_model(runner.model.config, torch.float32, torch.device(device), "sdpa").eval()
    # NOTE: the real weights' parity runs on the CPU already (test_parity_smollm2.py); here the CPU only
    # keeps the path working, the GPU runs the full set.
    prompts = random_prompts(engine.limits.vocab_size, 12 if device == "cuda" else 3, seed=11, max_len=100)
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in prompts]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), progress=False)
    for out, prompt, want in zip(outputs, prompts, expected):
        # HF stops at EOS; the engine was told to ignore it
        assert_parity(out.token_ids[:len(want)], want, prompt, reference)
    if device == "cuda":
        assert runner.static_decode is not None
        replays = [r.num_replays for r in runner.static_decode.runners.values() if isinstance(r, CapturedStep)]
        assert sum(replays) > 0, "no decode step replayed a CUDA graph"
