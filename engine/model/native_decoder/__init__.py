"""The CPU's captured step: a Llama-family model's decoder layers run in one C++ call.

On a GPU a captured step is a CUDA graph; on the CPU the cost it removes is the interpreter. Eager,
each decoder layer of a Hugging Face model is ~60 small operators and ~10 module calls dispatched
from Python: with 30 layers that is several milliseconds of every step, whatever the batch size,
and at small batches as much as the matrix multiplies themselves. ``csrc/decoder_stack.cpp`` runs
the same operators on the same shapes from C++ (the engine's packed linear layers, its
paged-attention kernel, and fused loops for rotary embedding, the residual add + RMSNorm and the
MLP's silu(gate) * up, that round as the eager operators do), so its output is bitwise the eager
path's; the embedding, the rotary tables, the final norm and the LM head stay the Hugging Face
modules. With it on, greedy sampling uses :func:`greedy_token_ids`, a one-pass C++ row scan.

It applies to models whose decoder layer is exactly Llama's (``llama``, ``mistral``, ``qwen2``
configs, their q/k/v and gate/up layers packed by engine/kernels/cpu_linear.py) with the C++ attention
backend; every other model runs eagerly. Before it is used, one probe step runs both ways and
must agree bit for bit; otherwise the engine logs why and stays eager. ``decode_fast_path = "off"`` keeps
the eager path.

With tensor parallelism every rank runs its shard's layers through the stack, one C++ call per attention
block and one per MLP block, with the all-reduce of each block's partial output between them, as the eager
forward's row-parallel layers do (engine/model/tensor_parallel.py). The probe then runs on every rank at once
(rank 0 sends it as a step, engine/model/tp_step.py) and the ranks sum their verdicts: the stack is used only
where every rank's agrees with its eager forward. Imports torch.
NOTE: measurements behind these choices: ops/bench/README.md (its per-machine sections and
"Figures behind the kernels' comments").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.engine.core.step_io import ScheduledChunk
from tokenmill.engine.kernels.cpp_build import CppExtension
from tokenmill.engine.kernels.cpu_linear import PANELS, PackedLinear, SiblingSlice
from tokenmill.engine.model.hf_attention import StepAttention
from tokenmill.engine.model.kv_cache import KVCache
from tokenmill.engine.model.tensor_parallel import AllReduce, RowParallelLinear
from tokenmill.engine.sample.sampler import greedy_token_ids as torch_greedy_token_ids
from tokenmill.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.model.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Model types whose Hugging Face decoder layer is Llama's: RMSNorm, q/k/v (+ bias) with rotary
# embedding over the whole head, attention, o-projection, residual, RMSNorm, SiLU-gated MLP, residual.
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})

# -ffp-contract=off: the fused loops must round a * b and a * b + c as the eager operators do.
_EXTENSION = CppExtension("tokenmill_decoder_stack_cpu", Path(__file__).resolve().parent / "csrc" /
                          "decoder_stack.cpp", ("-O3", "-march=native", "-ffp-contract=off", "-DNDEBUG"),
                          what="native CPU decoder stack", fallback="decoder layers run eagerly")
build_in_background = _EXTENSION.build_in_background


class NativeDecoder:
    """The model's forward with its decoder layers in C++; same signature as ``ModelRunner.forward``.

    Args:
        model: a Llama-family Hugging Face causal LM whose linear layers are packed (see
            :func:`ineligible_reason`); with tensor parallelism, this rank's shard of it.
        kv_cache: the pools the layers write to and attend over.
        fused_mlp: silu(gate) * up in one C++ loop (None: where it rounds as ATen's operators).
        all_reduce: with tensor parallelism, the sum over every rank that the shard's row-parallel layers
            make (the same one); None: the model is whole.
    """

    def __init__(self, model: Any, kv_cache: KVCache, fused_mlp: bool | None = None,
                 all_reduce: AllReduce | None = None) -> None:
        self.model = model
        base = model.model
        config = model.config
        attention = base.layers[0].self_attn
        head_dim = attention.head_dim
        # The fused silu(gate) * up rounds as ATen's kernels only at ATen's own vector width.
        if fused_mlp is None:
            fused_mlp = torch.backends.cpu.get_cpu_capability() == torch.ops.tokenmill_native.vec_capability()
        self.fused_mlp = fused_mlp
        self._all_reduce = all_reduce
        self._num_layers = config.num_hidden_layers
        panel_linears = _packed(attention.o_proj).kernel is PANELS  # one kernel for all (ineligible_reason)
        # NOTE: the shard's head counts (the config's are the whole model's under tensor parallelism)
        num_heads = attention.q_proj.out_features // head_dim
        num_kv_heads = attention.k_proj.out_features // head_dim
        self._stack: Any = torch.classes.tokenmill_native.DecoderStack(
            num_heads, num_kv_heads, head_dim, _packed(base.layers[0].mlp.down_proj).in_features,
            float(attention.scaling), self.fused_mlp, panel_linears)
        for index, layer in enumerate(base.layers[: config.num_hidden_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            o_proj, down_proj = _packed(attn.o_proj), _packed(mlp.down_proj)
            key_cache, value_cache = kv_cache.layer(index)
            self._stack.add_layer(
                layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon),
                attn.q_proj.group.packed_weight, attn.q_proj.group.bias,
                o_proj.packed_weight, o_proj.bias,
                layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon),
                mlp.gate_proj.group.packed_weight, mlp.gate_proj.group.bias,
                down_proj.packed_weight, down_proj.bias,
                key_cache, value_cache)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                step: StepAttention) -> torch.Tensor:
        """The model over one flattened batch: logits ``[len(logits_to_keep), vocab]``."""
        hidden = self.hidden_states(input_ids, position_ids, step)
        logits: torch.Tensor = self.model.lm_head(hidden[:, logits_to_keep, :])[0]
        return logits

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor, step: StepAttention
                      ) -> torch.Tensor:
        """The base model's output over one flattened batch (after the final norm), ``[1, T, hidden]``: what
        a tensor-parallel follower computes of a step."""
        base = self.model.model
        embeddings = base.embed_tokens(input_ids)  # [1, T, hidden]
        cos, sin = base.rotary_emb(embeddings, position_ids=position_ids)  # [1, T, head_dim] each
        meta = step.meta
        tables = (cos[0], sin[0], meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        if self._all_reduce is None:
            hidden = self._stack.forward(embeddings[0], *tables)
        else:
            hidden, delta = embeddings[0], None
            for index in range(self._num_layers):
                hidden, o = self._stack.attention_block(index, hidden, delta, *tables)
                self._all_reduce(o)
                hidden, delta = self._stack.mlp_block(index, hidden, o)
                self._all_reduce(delta)
            hidden = hidden + delta
        normed: torch.Tensor = base.norm(hidden.unsqueeze(0))
        return normed


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """:func:`engine.sample.sampler.greedy_token_ids` (first index of each row's maximum, NaN counting as
    the maximum), one C++ pass per row for CPU float32/bfloat16 rows (torch's ``max`` over
    bfloat16 rows is a visible part of a large batch's step); any other tensor goes to torch."""
    if (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] > 0):
        token_ids: torch.Tensor = torch.ops.tokenmill_native.greedy_token_ids(logits)
        return token_ids
    return torch_greedy_token_ids(logits)


def ineligible_reason(model: Any, backend_name: str) -> str | None:
    """Why this model cannot run as a :class:`NativeDecoder` (None: it can)."""
    config = model.config
    if config.model_type not in LLAMA_FAMILY:
        return f"model type {config.model_type!r} is not one of {sorted(LLAMA_FAMILY)}"
    if backend_name != "cpu":
        return f"it needs the C++ attention backend, not {backend_name!r}"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} does not have Llama's module layout"
    for layer in base.layers[: config.num_hidden_layers]:
        reason = _layer_ineligible_reason(layer)
        if reason is not None:
            return f"{type(layer).__name__}: {reason}"
    kernels = {linear.kernel.name for layer in base.layers[: config.num_hidden_layers]
               for linear in (layer.self_attn.q_proj.group, _packed(layer.self_attn.o_proj),
                              layer.mlp.gate_proj.group, _packed(layer.mlp.down_proj))}
    if len(kernels) > 1:  # the stack calls one kernel for every layer
        return f"its linear layers are packed for different kernels ({sorted(kernels)})"
    return None


def _unavailable_reason(model: Any, backend_name: str) -> str | None:
    """Why this process cannot run the model as a :class:`NativeDecoder`: the model, or a failed build."""
    reason = ineligible_reason(model, backend_name)
    if reason is None and not _EXTENSION.is_available():
        reason = "the C++ extension could not be built (see the log above)"
    return reason


def _layer_ineligible_reason(layer: Any) -> str | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return "no self_attn / mlp"
    for norm in (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)):
        if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
            return f"{type(norm).__name__} is not an RMSNorm"
    if not _one_packed_group([getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]):
        return "q/k/v are not one packed group (packing is off for this dtype?)"
    if not _one_packed_group([getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]):
        return "gate/up are not one packed group"
    if not isinstance(_packed(attn.o_proj), PackedLinear) or not isinstance(_packed(mlp.down_proj), PackedLinear):
        return "o_proj / down_proj are not packed"
    if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
        return f"activation {type(mlp.act_fn).__name__} is not SiLU"
    return None


def _packed(linear: Any) -> Any:
    """The layer that multiplies: a row-parallel layer's own linear (tensor parallelism), else the layer."""
    return linear.linear if isinstance(linear, RowParallelLinear) else linear


def _one_packed_group(layers: list[Any]) -> bool:
    groups = {id(layer.group) for layer in layers if isinstance(layer, SiblingSlice)}
    return len(groups) == 1 and all(isinstance(layer, SiblingSlice) for layer in layers)


def native_decoder_for(runner: ModelRunner) -> NativeDecoder | None:
    """A verified :class:`NativeDecoder` for the runner's model, or None (logged) to stay eager.

    With tensor parallelism, every rank probes at once and the stack is used only if all of them agree."""
    reason = _unavailable_reason(runner.model, runner.backend.name)
    if reason is not None:
        logger.info("decoder layers run eagerly: %s", reason)
        return None
    start = time.perf_counter()
    all_reduce = runner.tensor_parallel.all_reduce if runner.tensor_parallel is not None else None
    decoder = NativeDecoder(runner.model, runner.kv_cache, all_reduce=all_reduce)
    mismatch = probe_mismatch(runner, decoder)
    if mismatch is not None and decoder.fused_mlp:  # ATen's SiLU may round otherwise here: keep its own
        logger.info("the fused SiLU-gated MLP %s; using ATen's silu and mul", mismatch)
        decoder = NativeDecoder(runner.model, runner.kv_cache, fused_mlp=False, all_reduce=all_reduce)
        mismatch = probe_mismatch(runner, decoder)
    if mismatch is not None:
        logger.warning("decoder layers run eagerly: the native stack %s", mismatch)
        return None
    logger.info("decoder layers run natively (C++ stack%s, checked against eager in %.2f s)",
                ", on every tensor-parallel rank" if all_reduce is not None else "", time.perf_counter() - start)
    return decoder


def probe_mismatch(runner: ModelRunner, decoder: NativeDecoder) -> str | None:
    """Run one mixed step (a prefill chunk over a cached prefix, two decodes) eagerly and natively.

    Every slot is in the KV cache's scratch block, which no request owns: both runs write the
    same values there and read them back, so their logits must be bitwise equal. With tensor
    parallelism the followers run the same probe on their shards (each comparing its base model's
    output), and the ranks count those that differed.

    Returns:
        None when they are; else what differed.
    """
    scratch = runner.kv_cache.scratch_block_id
    width = 12 // runner.block_size + 1
    chunks = [ScheduledChunk(f"probe-{i}", token_ids, start, [scratch] * width, True, SamplingParams(), 0)
              for i, (token_ids, start) in enumerate([([11], 6), ([12], 3), ([13, 14, 15, 16], 8)])]
    batch = runner.prepare(chunks)
    args = (batch.input_ids, batch.position_ids, batch.sample_indices, batch.attention)
    if runner.tensor_parallel is not None:
        runner.tensor_parallel.send_probe(batch, decoder.fused_mlp)
    eager = runner.forward(*args)
    native = decoder.forward(*args)
    agrees = torch.equal(eager, native)
    others = runner.tensor_parallel.count_disagreeing(agrees) - (not agrees) if runner.tensor_parallel else 0
    if agrees and not others:
        return None
    if not agrees:
        return f"differs from eager by up to {(eager.float() - native.float()).abs().max().item():.3g} on a probe step"
    return f"differs from eager on {others} other tensor-parallel rank(s) on a probe step"


def follower_probe(model: Any, kv_cache: KVCache, backend_name: str, fused_mlp: bool, all_reduce: AllReduce,
                   eager: Callable[[], torch.Tensor], native_inputs: tuple[torch.Tensor, torch.Tensor, StepAttention]
                   ) -> tuple[NativeDecoder | None, bool]:
    """A tensor-parallel follower's side of :func:`probe_mismatch`: its shard's base model output eagerly
    (``eager()``), then natively (or eagerly again where it cannot build the stack: each rank must make the same
    all-reduces).

    Returns:
        The stack (None: this rank cannot build one), and whether its output equalled the eager one.
    """
    expected = eager()
    reason = _unavailable_reason(model, backend_name)
    decoder = None
    if reason is None:
        decoder = NativeDecoder(model, kv_cache, fused_mlp=fused_mlp, all_reduce=all_reduce)
        agrees = torch.equal(expected, decoder.hidden_states(*native_inputs))
    else:
        logger.warning("this rank cannot run the native decoder stack: %s", reason)
        eager()
        agrees = False
    return decoder, agrees
