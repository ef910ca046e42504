"""The fleet cache's weights fingerprint (engine/model/model_loader.py): every parameter's and buffer's name,
shape, dtype and full bytes, the same whatever the threads, and different for any change; and the tokenizer's."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import build_tokenizer
from tokenmill.engine.model.model_loader import tokenizer_fingerprint, weights_fingerprint
from tokenmill.engine.output.no_tokenizer import NoTokenizer


def _model(weight: torch.Tensor, name: str = "weight") -> torch.nn.Module:
    model = torch.nn.Module()
    model.register_parameter(name, torch.nn.Parameter(weight, requires_grad=False))
    model.register_buffer("inv_freq", torch.arange(8, dtype=torch.float32), persistent=False)
    return model


def test_the_same_weights_give_the_same_fingerprint_whatever_the_threads() -> None:
    weight = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    model = _model(weight)
    first = weights_fingerprint(model, chunk_bytes=1000, max_workers=1)
    assert weights_fingerprint(model, chunk_bytes=1000, max_workers=4) == first
    assert weights_fingerprint(_model(weight.clone()), chunk_bytes=1000, max_workers=3) == first
    assert weights_fingerprint(_model(weight.t().contiguous().t()), chunk_bytes=1000) == first  # a strided copy


@pytest.mark.parametrize("change", ["last value", "one bit", "name", "shape", "dtype", "buffer"])
def test_any_change_changes_the_fingerprint(change: str) -> None:
    weight = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    base = weights_fingerprint(_model(weight), chunk_bytes=1024)
    changed = weight.clone()
    other = _model(changed)
    if change == "last value":  # past any prefix of the tensor, in its last piece
        changed[-1, -1] += 1e-3
    elif change == "one bit":
        changed.view(torch.int32)[20, 7] ^= 1
    elif change == "name":
        other = _model(changed, name="other_weight")
    elif change == "shape":
        other = _model(changed.reshape(48, 64))
    elif change == "dtype":  # the same bytes read as another dtype
        other = _model(changed.view(torch.int32))
    else:
        other.inv_freq[3] = 0.5
    assert weights_fingerprint(other, chunk_bytes=1024) != base


def test_tokenizer_fingerprint_names_the_vocabulary() -> None:
    tokenizer = build_tokenizer()
    digest = tokenizer_fingerprint(tokenizer)
    assert digest is not None and digest == tokenizer_fingerprint(build_tokenizer())
    tokenizer.add_tokens(["<|tool|>"])
    assert tokenizer_fingerprint(tokenizer) != digest
    assert tokenizer_fingerprint(NoTokenizer("random")) is None
