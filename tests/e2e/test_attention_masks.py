"""The paged attention function is registered without a mask factory (engine/model/hf_attention.py): transformers
then makes no mask, and no longer looks for packed sequences in the position ids before each forward (a value read
back from the device: a host sync per eager forward on CUDA). The tokens are Hugging Face's all the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM, masking_utils

from tests.e2e.parity_helpers import hf_greedy, random_prompts
from tests.engine_helpers import build_engine
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_a_forward_makes_no_mask(family: str, tiny_model_dirs: dict[str, Path],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_model_dirs[family]
    engine = build_engine(str(path), device="cpu", dtype="float64", kv_cache_memory="8MiB", block_size=4,
                          max_prefill_chunk=7)
    looked: list[int] = []
    find = masking_utils.find_packed_sequence_indices

    def spy(*args: Any, **kwargs: Any) -> Any:
        looked.append(1)
        return find(*args, **kwargs)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", spy)
    prompts = random_prompts(engine.limits.vocab_size, 3, seed=2, max_len=20)
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=6), progress=False)
    finally:
        engine.close()
    assert looked == []
    monkeypatch.undo()
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").double().eval()
    assert [out.token_ids for out in outputs] == [hf_greedy(reference, p, 6) for p in prompts]
