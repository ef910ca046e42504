"""The bfloat16 linear kernel (engine/bf16_linear) against a float32 reference that adds the
products in the kernel's order: bfloat16 x bfloat16 products are exact in float32, so a fused
multiply-add per k equals a float32 add of the product, and the two must agree bit for bit."""

from __future__ import annotations

import pytest
import torch

from engine import bf16_linear

pytestmark = pytest.mark.skipif(not bf16_linear.is_available(), reason="the C++ kernel could not be built here")


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One float32 sum per output over k = 0 .. K-1 in order, plus the bias, rounded once."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xf[:, k : k + 1] * wf[:, k]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(torch.bfloat16)


def _random(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 1, 1), (1, 64, 40), (5, 33, 17), (7, 64, 96), (13, 200, 33), (64, 48, 130),
    (100, 1536, 24),  # several row chunks, split over threads
])
def test_the_kernel_adds_in_order_and_rounds_once(rows: int, in_features: int, out_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    weight = _random(out_features, in_features, generator=gen)
    x = _random(rows, in_features, generator=gen)
    b = _random(out_features, generator=gen) if bias else None
    packed = bf16_linear.pack_weight(weight)
    assert torch.equal(bf16_linear.linear(x, packed, b, out_features), _reference(x, weight, b))


def test_a_row_gets_the_same_result_alone_as_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    weight, x = _random(70, 96, generator=gen), _random(23, 96, generator=gen)
    packed = bf16_linear.pack_weight(weight)
    together = bf16_linear.linear(x, packed, None, 70)
    for i in range(23):
        assert torch.equal(bf16_linear.linear(x[i : i + 1], packed, None, 70), together[i : i + 1])


def test_leading_axes_strided_rows_and_empty_inputs() -> None:
    gen = torch.Generator().manual_seed(4)
    weight, bias = _random(24, 32, generator=gen), _random(24, generator=gen)
    packed = bf16_linear.pack_weight(weight)
    wide = _random(2, 5, 48, generator=gen)
    x = wide[..., 8:40]  # rows 48 apart, 32 wide
    out = bf16_linear.linear(x, packed, bias, 24)
    assert out.shape == (2, 5, 24) and out.dtype == torch.bfloat16
    assert torch.equal(out.reshape(10, 24), _reference(x.reshape(10, 32), weight, bias))
    assert bf16_linear.linear(x[:, :0], packed, bias, 24).shape == (2, 0, 24)


def test_nan_and_infinity_pass_through() -> None:
    weight = torch.ones(3, 4, dtype=torch.bfloat16)
    x = torch.tensor([[1.0, float("nan"), 0.0, 0.0], [float("inf"), 1.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]],
                     dtype=torch.bfloat16)
    out = bf16_linear.linear(x, bf16_linear.pack_weight(weight), None, 3)
    assert out[0].isnan().all() and (out[1] == float("inf")).all() and (out[2] == 10.0).all()


def test_mismatched_shapes_are_refused() -> None:
    packed = bf16_linear.pack_weight(torch.ones(8, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="in_features"):
        bf16_linear.linear(torch.ones(2, 15, dtype=torch.bfloat16), packed, None, 8)
    with pytest.raises(RuntimeError, match="out_features"):
        bf16_linear.linear(torch.ones(2, 16, dtype=torch.bfloat16), packed, None, 1000)
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16_linear.linear(torch.ones(2, 16), packed, None, 8)
