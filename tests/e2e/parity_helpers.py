"""Reference generations with Hugging Face ``generate`` and the near-tie rule for comparing them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

NEAR_TIE = 1e-4  # a float32 divergence is accepted only where the reference's top two logits are this close


# Every parity test runs on the CPU; on a machine with CUDA it also runs there (marked `gpu`).
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


# Every parity test runs with the reference attention (gather + SDPA) and with the device's kernel.
BACKENDS = ["reference", "kernel"]


def attention_backend(kind: str, device: str) -> str:
    """The ``attention_backend`` setting of a BACKENDS entry on ``device``."""
    return kind if kind == "reference" else ("triton" if device == "cuda" else "cpu")


def load_reference(path: Path | str, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, **options: Any) -> list[int]:
    """Greedy continuation by ``generate(do_sample=False, **options)``, one prompt at a time (no padding)."""
    device = next(model.parameters()).device
    out = model.generate(
        torch.tensor([prompt_ids], device=device), max_new_tokens=max_new_tokens, do_sample=False, attention_mask=None,
        pad_token_id=model.config.pad_token_id or 0, **options,
    )
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def top2_gap(model: torch.nn.Module, token_ids: list[int]) -> float:
    """Gap between the two largest next-token logits after ``token_ids``."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([token_ids], device=device)).logits[0, -1].double()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_parity(got: list[int], want: list[int], prompt: list[int], reference: torch.nn.Module) -> None:
    """``got`` equals the reference's greedy ``want``, or first differs where the reference's top two
    logits are a near-tie (a float32 rounding can pick either)."""
    at = first_divergence(got, want)
    if at is None:
        return
    assert at < min(len(got), len(want)), f"lengths differ without a token divergence: {got} vs {want}"
    gap = top2_gap(reference, prompt + want[:at])
    assert gap < NEAR_TIE, f"diverged at token {at} where the reference is decisive (top-2 gap {gap:.2e})"


def random_prompts(vocab_size: int, num_prompts: int, seed: int, min_len: int = 3,
                   max_len: int = 120) -> list[list[int]]:
    """Token-id prompts of mixed lengths, avoiding the first few (special) ids."""
    rng = random.Random(seed)
    return [
        [rng.randrange(4, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)
    ]
