"""The packed CPU linear layers (engine/kernels/cpu_linear.py) against the plain ``nn.Linear`` path they
replace: single layers, fused sibling groups in any call order, and a whole model's logits."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from tests.tiny_models import tiny_config
from tokenmill.engine.errors import ModelLoadError
from tokenmill.engine.kernels import cpu_linear
from tokenmill.engine.kernels.cpu_linear import (
    ONEDNN,
    PANELS,
    FusedSiblings,
    LinearKernel,
    PackedLinear,
    SiblingSlice,
    pack_linears,
    packing_works,
)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Each kernel with each dtype it packs (oneDNN's bfloat16 only where this CPU allows).
KERNEL_DTYPES = [(ONEDNN, torch.float32), (ONEDNN, torch.bfloat16), (PANELS, torch.float32), (PANELS, torch.bfloat16)]


def _needs_packing(dtype: torch.dtype, kernel: LinearKernel = ONEDNN) -> None:
    if not packing_works(dtype, kernel):
        pytest.skip(f"{kernel.name} cannot pack {dtype} on this CPU / torch build")


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.allclose(a.float(), b.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]))


@pytest.mark.parametrize(("kernel", "dtype"), KERNEL_DTYPES, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_a_packed_layer_computes_what_the_plain_one_does(kernel: LinearKernel, dtype: torch.dtype,
                                                         num_tokens: int) -> None:
    _needs_packing(dtype, kernel)
    torch.manual_seed(0)
    plain = nn.Linear(48, 40).to(dtype)
    x = torch.randn(num_tokens, 48).to(dtype)
    packed = PackedLinear(plain, kernel)
    assert _close(packed(x), plain(x), dtype)
    assert packed.weight.is_meta and packed.weight.shape == plain.weight.shape


@pytest.mark.parametrize(("kernel", "dtype"), KERNEL_DTYPES, ids=lambda v: getattr(v, "name", str(v)))
def test_siblings_give_their_own_columns_whatever_the_call_order(kernel: LinearKernel, dtype: torch.dtype) -> None:
    _needs_packing(dtype, kernel)
    torch.manual_seed(0)
    plain = [nn.Linear(32, n, bias=n != 8).to(dtype) for n in (16, 8, 8)]  # a bias on some only
    group = FusedSiblings(plain, kernel)
    q, k, v = (SiblingSlice(group, i, linear) for i, linear in enumerate(plain))
    x, y = torch.randn(3, 32).to(dtype), torch.randn(3, 32).to(dtype)
    # the usual round, a reversed one, a sibling called twice, and a different input in mid-round
    calls = [(q, x), (k, x), (v, x), (v, y), (k, y), (q, y), (q, x), (q, x), (k, y), (k, x), (v, x), (q, x)]
    for layer, inputs in calls:
        assert _close(layer(inputs), plain[layer.index](inputs), dtype), (layer.index, inputs is x)
    assert group._input is None  # a finished round holds no activations


def test_a_model_keeps_its_logits_with_packed_and_fused_layers() -> None:
    _needs_packing(torch.float32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=300, eos_token_id=2)).eval()
    packed = copy.deepcopy(model)
    num_replaced = pack_linears(packed)
    attention, mlp = packed.model.layers[0].self_attn, packed.model.layers[0].mlp
    assert isinstance(attention.q_proj, SiblingSlice) and isinstance(mlp.up_proj, SiblingSlice)
    assert isinstance(attention.o_proj, PackedLinear) and isinstance(packed.lm_head, PackedLinear)
    assert num_replaced == 2 * 7 + 1  # 2 layers x (q, k, v, o, gate, up, down) + the LM head
    ids = torch.randint(0, 300, (2, 9))
    with torch.inference_mode():
        assert _close(packed(ids).logits, model(ids).logits, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_packed_for_the_panel_kernel_keeps_its_logits(dtype: torch.dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_packing(dtype, PANELS)
    monkeypatch.setattr(cpu_linear, "_prefers_panels", lambda _: True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=300, eos_token_id=2)).to(dtype).eval()
    packed = copy.deepcopy(model)
    assert pack_linears(packed) == 2 * 7 + 1
    assert packed.lm_head.kernel is PANELS and packed.model.layers[0].mlp.gate_proj.group.kernel is PANELS
    ids = torch.randint(0, 300, (2, 9))
    with torch.inference_mode():
        assert _close(packed(ids).logits, model(ids).logits, dtype)


def test_the_kernel_choice_follows_the_cpu_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    works = {(ONEDNN, torch.float32): True, (ONEDNN, torch.bfloat16): False, (PANELS, torch.float32): True,
             (PANELS, torch.bfloat16): True}
    monkeypatch.setattr(cpu_linear, "packing_works", lambda dtype, kernel=ONEDNN: works[kernel, dtype])
    monkeypatch.setattr(cpu_linear, "_prefers_panels", lambda _: False)  # AVX-512: oneDNN first
    assert cpu_linear.kernel_for(torch.float32) is ONEDNN
    assert cpu_linear.kernel_for(torch.bfloat16) is PANELS  # oneDNN cannot: the other kernel
    monkeypatch.setattr(cpu_linear, "_prefers_panels", lambda _: True)  # AVX2 and below
    assert cpu_linear.kernel_for(torch.float32) is PANELS
    works[PANELS, torch.float32] = works[PANELS, torch.bfloat16] = False  # not built here
    assert cpu_linear.kernel_for(torch.float32) is ONEDNN
    assert cpu_linear.kernel_for(torch.bfloat16) is None


def test_linear_kernel_setting_names_the_kernel_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    works = {(ONEDNN, torch.float32): True, (ONEDNN, torch.bfloat16): False, (PANELS, torch.float32): True,
             (PANELS, torch.bfloat16): True}
    monkeypatch.setattr(cpu_linear, "packing_works", lambda dtype, kernel=ONEDNN: works[kernel, dtype])
    monkeypatch.setattr(cpu_linear, "_prefers_panels", lambda _: False)
    assert cpu_linear.kernel_for(torch.float32, "panels") is PANELS  # against the CPU's own order
    assert cpu_linear.kernel_for(torch.float32, "onednn") is ONEDNN
    assert cpu_linear.kernel_for(torch.float32, "off") is None
    with pytest.raises(ModelLoadError, match="linear_kernel = 'onednn' cannot pack torch.bfloat16"):
        cpu_linear.kernel_for(torch.bfloat16, "onednn")  # a named kernel that cannot is an error, never a fallback


@pytest.mark.parametrize("choice", ["off", "onednn", "panels"])
def test_each_linear_kernel_keeps_the_plain_models_logits(choice: str) -> None:
    if choice != "off":
        _needs_packing(torch.float32, cpu_linear.KERNELS[choice])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=300, eos_token_id=2)).eval()
    packed = copy.deepcopy(model)
    assert pack_linears(packed, choice) == (0 if choice == "off" else 2 * 7 + 1)
    kernels = {m.kernel.name for m in packed.modules() if isinstance(m, PackedLinear)}
    assert kernels == (set() if choice == "off" else {choice})
    ids = torch.randint(0, 300, (2, 9))
    with torch.inference_mode():
        assert _close(packed(ids).logits, model(ids).logits, torch.float32)


@pytest.mark.parametrize(("capability", "vendor", "flags", "panels_for"), [
    ("AVX2", "AuthenticAMD", "avx2", {torch.float32, torch.bfloat16}),
    ("AVX2", "GenuineIntel", "avx2", {torch.float32, torch.bfloat16}),
    ("AVX512", "GenuineIntel", "avx512f", set()),
    ("AVX512", "GenuineIntel", "avx512f avx512_bf16 amx_bf16", {torch.bfloat16}),  # tiles, or widening FMAs
    ("AVX512", "GenuineIntel", "avx512f avx512_bf16", {torch.bfloat16}),  # widening FMAs
    ("AVX512", "AuthenticAMD", "avx512f avx512_bf16", {torch.float32, torch.bfloat16}),  # Zen 4: VDPBF16PS
])
def test_the_panel_kernel_leads_where_it_measured_faster_than_onednn(
        capability: str, vendor: str, flags: str, panels_for: set[torch.dtype],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_linear, "cpu_flags", lambda: flags)
    assert {dtype for dtype in (torch.float32, torch.bfloat16) if cpu_linear._prefers_panels(dtype)} == panels_for
