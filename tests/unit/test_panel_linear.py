"""The panel linear kernel (engine/kernels/panel_linear) against references, on every bfloat16 path that
runs here (panel_linear.BFLOAT16_PATHS; the CPU's own choice is one of them). bfloat16: a float32
reference that adds the products in the kernel's order; bfloat16 x bfloat16 products are exact in
float32, so a fused multiply-add per k equals a float32 add of the product, and the widening path
must agree bit for bit. On the pair paths ("avx512_bf16", "amx": in_features a multiple of 32) the
float32 sums may differ in their last bits: there, within float32 accumulation error of the same
reference. float32: a float64 product, within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.kernels import panel_linear

pytestmark = pytest.mark.skipif(not panel_linear.is_available(), reason="the C++ kernel could not be built here")
PATHS = pytest.mark.parametrize("path", panel_linear.BFLOAT16_PATHS)


def _packed(weight: torch.Tensor, path: str) -> torch.Tensor:
    """``weight`` packed for the bfloat16 ``path``; skips where that path cannot multiply it here."""
    try:
        return panel_linear.pack_weight(weight, path)
    except RuntimeError as error:
        if "cannot multiply" in str(error):
            pytest.skip(f"the {path} path cannot multiply [{weight.shape[0]}, {weight.shape[1]}] here")
        raise


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One float32 sum per output over k = 0 .. K-1 in order, plus the bias, rounded once."""
    xf, wf = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xf[:, k : k + 1] * wf[:, k]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(torch.bfloat16)


def _matches_reference(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       path: str) -> bool:
    """Bit for bit with :func:`_reference`; on the pair paths, within one bfloat16 ulp of the result
    plus twice float32 accumulation error (each float32 sum is within K ulps of the sum of the
    products' magnitudes of the exact one; rounded to bfloat16, two sums that straddle a rounding
    midpoint land one bfloat16 ulp apart, at most 2^-7 of the result)."""
    reference = _reference(x, weight, bias)
    if path == "widen":
        return torch.equal(got, reference)
    magnitude = x.float().abs() @ weight.float().abs().T + (0 if bias is None else bias.float().abs())
    bound = reference.float().abs() * 2**-7 + 2 * x.shape[-1] * 2**-24 * magnitude
    return got.dtype == torch.bfloat16 and bool(((got.float() - reference.float()).abs() <= bound).all())


def _random(*shape: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype)


def _float32_agrees(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return got.dtype == torch.float32 and bool(torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-4))


@PATHS
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [
    (1, 1, 1), (1, 64, 40), (5, 33, 17), (7, 64, 96), (13, 200, 33), (64, 48, 130),
    (100, 1536, 24),  # several row chunks, split over threads
    (9, 256, 1100),  # blocks of several panels handed out to the threads, the last block short
    # in_features a multiple of 32: the pair paths too
    (40, 64, 520),  # 32-row blocks of two 16-row tiles, then a tail of 8
    (70, 1024, 300),  # several panel groups, each passed by three row blocks
])
def test_the_kernel_adds_in_order_and_rounds_once(rows: int, in_features: int, out_features: int, bias: bool,
                                                  path: str) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    weight = _random(out_features, in_features, generator=gen)
    x = _random(rows, in_features, generator=gen)
    b = _random(out_features, generator=gen) if bias else None
    packed = _packed(weight, path)
    assert _matches_reference(panel_linear.linear(x, packed, b, out_features), x, weight, b, path)
    if path == "widen":  # float32 on the same shapes: the same panels, without widening or rounding
        x32, w32, b32 = x.float() + 1e-3, weight.float() - 1e-3, None if b is None else b.float()
        got = panel_linear.linear(x32, panel_linear.pack_weight(w32), b32, out_features)
        assert _float32_agrees(got, x32, w32, b32)


@pytest.mark.parametrize(("dtype", "path"), [(torch.float32, None)] + [(torch.bfloat16, path)
                                                                      for path in panel_linear.BFLOAT16_PATHS])
def test_a_row_gets_the_same_result_alone_as_in_any_batch(dtype: torch.dtype, path: str | None) -> None:
    gen = torch.Generator().manual_seed(3)
    weight, x = _random(70, 96, generator=gen, dtype=dtype), _random(23, 96, generator=gen, dtype=dtype)
    packed = panel_linear.pack_weight(weight) if path is None else _packed(weight, path)
    together = panel_linear.linear(x, packed, None, 70)
    for i in range(23):
        assert torch.equal(panel_linear.linear(x[i : i + 1], packed, None, 70), together[i : i + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_leading_axes_strided_rows_and_empty_inputs(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    weight, bias = _random(24, 32, generator=gen, dtype=dtype), _random(24, generator=gen, dtype=dtype)
    packed = panel_linear.pack_weight(weight)  # this CPU's own path
    wide = _random(2, 5, 48, generator=gen, dtype=dtype)
    x = wide[..., 8:40]  # rows 48 apart, 32 wide
    out = panel_linear.linear(x, packed, bias, 24)
    assert out.shape == (2, 5, 24) and out.dtype == dtype
    if dtype == torch.bfloat16:
        assert _matches_reference(out.reshape(10, 24), x.reshape(10, 32), weight, bias, panel_linear.bfloat16_path())
    else:
        assert _float32_agrees(out.reshape(10, 24), x.reshape(10, 32), weight, bias)
    assert panel_linear.linear(x[:, :0], packed, bias, 24).shape == (2, 0, 24)


@pytest.mark.parametrize(("dtype", "in_features", "path"), [
    (torch.float32, 4, None), (torch.float32, 32, None), (torch.bfloat16, 4, "widen"),
    *[(torch.bfloat16, 32, path) for path in panel_linear.BFLOAT16_PATHS]])
def test_nan_and_infinity_pass_through(dtype: torch.dtype, in_features: int, path: str | None) -> None:
    weight = torch.ones(3, in_features, dtype=dtype)
    x = torch.zeros(3, in_features, dtype=dtype)
    x[0, :2] = torch.tensor([1.0, float("nan")])
    x[1, :2] = torch.tensor([float("inf"), 1.0])
    x[2, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    packed = panel_linear.pack_weight(weight) if path is None else _packed(weight, path)
    out = panel_linear.linear(x, packed, None, 3)
    assert out[0].isnan().all() and (out[1] == float("inf")).all() and (out[2] == 10.0).all()


@PATHS
def test_mismatched_shapes_are_refused(path: str) -> None:
    packed = _packed(torch.ones(8, 32, dtype=torch.bfloat16), path)
    with pytest.raises(RuntimeError, match="in_features"):
        panel_linear.linear(torch.ones(2, 64, dtype=torch.bfloat16), packed, None, 8)
    with pytest.raises(RuntimeError, match="out_features"):
        panel_linear.linear(torch.ones(2, 32, dtype=torch.bfloat16), packed, None, 1000)
    with pytest.raises(RuntimeError, match="both bfloat16"):
        panel_linear.linear(torch.ones(2, 32), packed, None, 8)  # float32 input, bfloat16 weight


def test_weights_the_kernel_cannot_pack_are_refused() -> None:
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        panel_linear.pack_weight(torch.ones(8, 16, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="cannot multiply"):
        panel_linear.pack_weight(torch.ones(8, 64), "avx512_bf16")  # float32 has only the panels
    with pytest.raises(RuntimeError, match="cannot multiply"):
        panel_linear.pack_weight(torch.ones(8, 48, dtype=torch.bfloat16), "avx512_bf16")  # not pairs of 32
    with pytest.raises(ValueError, match="unknown bfloat16 path"):
        panel_linear.pack_weight(torch.ones(8, 64, dtype=torch.bfloat16), "fp8")


def test_calls_interleaved_with_torchs_own_tile_unit_users_keep_every_result() -> None:
    """On CPUs with AMX, oneDNN (a bfloat16 matmul) and torch's brgemm (bfloat16 SDPA) use the tile
    unit too; the kernel configures and releases the tiles on every call, and calls alternating
    with theirs on the same thread must leave every result unchanged."""
    gen = torch.Generator().manual_seed(5)
    a, b = _random(64, 256, generator=gen), _random(256, 128, generator=gen)
    q, k, v = (_random(1, 4, 160, 64, generator=gen) for _ in range(3))
    weight, x = _random(96, 256, generator=gen), _random(40, 256, generator=gen)
    packed = panel_linear.pack_weight(weight)

    def attention() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    want_matmul, want_attention, want_linear = a @ b, attention(), panel_linear.linear(x, packed, None, 96)
    for _ in range(3):
        assert torch.equal(panel_linear.linear(x, packed, None, 96), want_linear)
        assert torch.equal(a @ b, want_matmul)
        assert torch.equal(attention(), want_attention)
