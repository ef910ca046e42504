"""Executes one SchedulerOutput: swap copies, one flattened forward over every scheduled token,
then sampling from the logits of each sequence's last token. Knows nothing of queues.

With tensor parallelism this is rank 0's runner: each step's block copies and inputs go to the follower
ranks first (engine/model/tp_leader.py), whose forwards run beside this one (engine/model/tp_follower.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.engine.core.step_io import ModelOutput, ScheduledChunk, SchedulerOutput
from tokenmill.engine.kernels.attention import AttentionBackend, AttentionMetadata
from tokenmill.engine.model.hf_attention import StepAttention
from tokenmill.engine.model.input_batch import InputBatch
from tokenmill.engine.model.kv_cache import KVCache
from tokenmill.engine.model.model_loader import LoadedModel
from tokenmill.engine.model.static_decode import Shape, StaticDecode
from tokenmill.engine.model.step_inputs import StepInputs, TableRows
from tokenmill.engine.sample.context import SamplingContext
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.engine.spec.verification import accept_drafts

# The lists of one step's inputs (engine/model/step_inputs.py), in the order they are packed.
STEP_INPUT_NAMES = ("input_ids", "positions", "slots", "sample_indices", "seq_lens", "query_start", "tables")

# Whether a runner keeps its requests' block tables in a persistent batch (engine/model/input_batch.py), each step
# changed by difference and its tables gathered from it; False: every step's tables are flattened from the chunks
# (the plain reference, O(batch x context) Python work a step). A runner's ``persistent_batch`` argument overrides it.
PERSISTENT_BATCH = True


class StepForward(Protocol):
    """A stand-in for :meth:`ModelRunner.forward` that model setup may hand the runner: the CPU's native
    decoder stack (engine/model/native_decoder), which is built from and checked against the runner."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                step: StepAttention) -> torch.Tensor: ...


class StepBroadcast(Protocol):
    """The follower ranks of a tensor-parallel model (engine/model/tp_leader.py): each step goes to them before
    it runs here."""

    def send_step(self, scheduler_output: SchedulerOutput, batch: PreparedBatch | None) -> None: ...

    def send_probe(self, batch: PreparedBatch, fused_mlp: bool) -> None: ...

    def count_disagreeing(self, agrees: bool) -> int: ...

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


@dataclass
class StaticStep:
    """A decode or verification step that runs at a static shape (engine/model/static_decode.py), with its block
    tables."""

    static: StaticDecode
    shape: Shape
    tables: TableRows | None  # the persistent batch's rows, in chunk order; None: flattened from the chunks


@dataclass
class PreparedBatch:
    """Model inputs of one step, in the flattened order (decodes first, then prefill chunks)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    attention: StepAttention
    sample_indices: torch.Tensor  # [S] batch index of each row sampled: each chunk's last 1 + draft tokens
    sample_chunks: list[ScheduledChunk]  # the chunk of each row of the sampled logits
    inputs: StepInputs  # the host lists the tensors above came from (what tensor-parallel followers get)


def step_tensors(inputs: StepInputs, num_decodes: int, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device) -> tuple[dict[str, torch.Tensor], StepAttention]:
    """One step's inputs on ``device`` (:data:`STEP_INPUT_NAMES`, flat) and its attention metadata; the same on
    every tensor-parallel rank, whose inputs came from rank 0's."""
    on_device = inputs.upload(device)
    seq_lens, query_start = inputs.values("seq_lens"), inputs.values("query_start")
    meta = AttentionMetadata(
        slot_mapping=on_device["slots"],
        block_tables=on_device["tables"].view(len(seq_lens), -1).to(torch.int32),
        seq_lens=on_device["seq_lens"].to(torch.int32),
        query_start_loc=on_device["query_start"].to(torch.int32),
        num_decodes=num_decodes,
        max_seq_len=max(seq_lens),
        max_query_len=max(end - start for start, end in zip(query_start, query_start[1:])),
        seq_lens_host=seq_lens,
        query_start_host=query_start,
    )
    return on_device, StepAttention(kv_cache, meta, backend)


class ModelRunner:
    """Runs the model over the paged KV cache.

    Which forward a step runs is fixed here, at construction: a runner built with neither fast path
    is the plain reference (:meth:`forward`, eager), and the fast paths are checked against one
    (engine/model/model_setup.py builds the reference first, then the engine's runner with what it chose).

    Args:
        loaded: the model, on its device, registered with the paged attention implementation.
        kv_cache: the device and host pools.
        sampler: picks the next token of each sequence.
        backend: the attention backend every layer uses.
        native_decoder: on the CPU, the decoder layers in one C++ call (bitwise the eager forward),
            run in place of :meth:`forward`; None: eager.
        static_decode: decode and verification steps at static shapes (CUDA graphs), run when a step fits one;
            None: every step runs through the forward.
        tensor_parallel: the follower ranks of a sharded model, sent every step before it runs here (then
            no static decode steps; the native decoder stack, if given, runs on every rank); None: the model is
            whole.
        persistent_batch: keep the block tables in a persistent batch, changed by difference each step
            (engine/model/input_batch.py); False: flatten them from the chunks every step (the plain reference,
            whose inputs are the same integers); None: :data:`PERSISTENT_BATCH`.
    """

    def __init__(self, loaded: LoadedModel, kv_cache: KVCache, sampler: Sampler, backend: AttentionBackend, *,
                 native_decoder: StepForward | None = None, static_decode: StaticDecode | None = None,
                 tensor_parallel: StepBroadcast | None = None, persistent_batch: bool | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.eos_token_ids = loaded.eos_token_ids
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.backend = backend
        self.block_size = kv_cache.spec.block_size
        self.static_decode = static_decode
        self.native_decoder = native_decoder
        self.tensor_parallel = tensor_parallel
        is_persistent = PERSISTENT_BATCH if persistent_batch is None else persistent_batch
        self.input_batch = InputBatch(self.block_size) if is_persistent else None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Swap out, swap in, run the forward, sample.

        Args:
            scheduler_output: what to run this step, with each chunk's sampling parameters.

        Returns:
            One sampled token for every chunk with ``needs_sample``.
        """
        chunks = scheduler_output.chunks
        planned = self.plan_step(scheduler_output)
        if self.tensor_parallel is not None:
            self.tensor_parallel.send_step(scheduler_output, planned if isinstance(planned, PreparedBatch) else None)
        # NOTE: this order: swap-outs read blocks a copy or swap-in may reuse; copies read shared
        # blocks a swap-in may reuse (their other owner was preempted this step).
        self.kv_cache.swap_out(scheduler_output.swap_out)
        self.kv_cache.copy_blocks(scheduler_output.copy_blocks)
        self.kv_cache.swap_in(scheduler_output.swap_in)
        if planned is None:
            return ModelOutput()
        if isinstance(planned, PreparedBatch):
            logits, sample_chunks = self._forward(planned), planned.sample_chunks
        else:
            logits, sample_chunks = planned.static.run(chunks, planned.shape, planned.tables), chunks
        if not sample_chunks:
            return ModelOutput()
        # NOTE: a chunk with draft tokens samples one row after each of its last 1 + k tokens, each
        # exactly as a plain decode at that output position would (engine/spec/verification.py).
        contexts = [SamplingContext(params=chunk.sampling_params, num_output_tokens=chunk.num_output_tokens + row,
                                    eos_token_ids=self.eos_token_ids, state=chunk.sampling_state,
                                    draft_prefix=chunk.draft_token_ids[:row])
                    for chunk in sample_chunks for row in range(chunk.num_sample_rows)]
        sampled = self.sampler(logits, contexts)
        output = ModelOutput(path="flat" if isinstance(planned, PreparedBatch) else "static")
        first_row = 0
        for chunk in sample_chunks:
            rows = slice(first_row, first_row + chunk.num_sample_rows)
            first_row = rows.stop
            token_ids = sampled.token_ids[rows]
            num_kept = accept_drafts(chunk.draft_token_ids, token_ids) if chunk.num_draft_tokens else 1
            output.sampled_token_ids[chunk.request_id] = token_ids[:num_kept]
            logprobs = sampled.logprobs[rows][:num_kept]
            if logprobs[0] is not None:
                output.logprobs[chunk.request_id] = [entry for entry in logprobs if entry is not None]
        return output

    def plan_step(self, scheduler_output: SchedulerOutput) -> PreparedBatch | StaticStep | None:
        """The first part of :meth:`execute`: the step's inputs, with the persistent batch brought up to it (rows of
        preempted requests released, then the chunks' rows), or None when it runs no chunk."""
        if self.input_batch is not None and scheduler_output.preempted_request_ids:
            self.input_batch.release(scheduler_output.preempted_request_ids)
        return self._plan(scheduler_output.chunks)

    def _plan(self, chunks: list[ScheduledChunk]) -> PreparedBatch | StaticStep | None:
        """How a step's chunks run: in a static decode bucket, through the forward (prepared here, before
        the step's block copies, so tensor-parallel followers get both in one message), or not at all."""
        if not chunks:
            return None
        static = self.static_decode
        shape = static.shape_for(chunks) if static is not None else None
        if static is not None and shape is not None:
            tables = None
            if self.input_batch is not None:
                rows = self.input_batch.rows(chunks)
                tables = self.input_batch.gather(rows, self.input_batch.max_length(rows))
            return StaticStep(static, shape, tables)
        return self.prepare(chunks)

    def _forward(self, batch: PreparedBatch) -> torch.Tensor:
        forward = self.native_decoder.forward if self.native_decoder is not None else self.forward
        return forward(batch.input_ids, batch.position_ids, batch.sample_indices, batch.attention)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                step: StepAttention) -> torch.Tensor:
        """The model over one flattened batch, eagerly: logits ``[len(logits_to_keep), vocab]``."""
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         logits_to_keep=logits_to_keep, tokenmill_step=step)
        logits: torch.Tensor = out.logits[0]
        return logits

    def prepare(self, chunks: list[ScheduledChunk]) -> PreparedBatch:
        """Flatten chunks into model inputs and attention metadata: single-token chunks first,
        longest context first (the reference backend gathers less padding), then prefill chunks.

        Host work is a few list operations per chunk and one host-to-device copy (engine/model/step_inputs.py); the
        block tables are a gather of the persistent batch's rows (engine/model/input_batch.py: these chunks are
        the next step it sees), or, without one, flattened here (work that grows with the context).
        """
        bs = self.block_size
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -c.start_position)
        ordered = decodes + [c for c in chunks if c.num_tokens > 1]
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        for chunk in ordered:
            end = chunk.start_position + chunk.num_tokens
            chunk_positions = range(chunk.start_position, end)
            token_ids += chunk.token_ids
            positions += chunk_positions
            slots += [chunk.block_ids[p // bs] * bs + p % bs for p in chunk_positions]
            seq_lens.append(end)
            query_start.append(query_start[-1] + chunk.num_tokens)
        width = (max(seq_lens) + bs - 1) // bs
        sample_chunks = [c for c in ordered if c.needs_sample]
        inputs = StepInputs()
        inputs.add("input_ids", token_ids)
        inputs.add("positions", positions)
        inputs.add("slots", slots)
        inputs.add("sample_indices", [index for i, c in enumerate(ordered)
                                      for index in range(query_start[i + 1] - c.num_sample_rows, query_start[i + 1])])
        inputs.add("seq_lens", seq_lens)
        inputs.add("query_start", query_start)
        if self.input_batch is not None:
            inputs.add_rows("tables", self.input_batch.gather(self.input_batch.rows(ordered), width))
        else:
            inputs.add("tables", [b for c in ordered
                                  for b in c.block_ids[:width] + [0] * (width - len(c.block_ids[:width]))])
        on_device, attention = step_tensors(inputs, len(decodes), self.kv_cache, self.backend, self.device)
        return PreparedBatch(
            input_ids=on_device["input_ids"].view(1, -1),
            position_ids=on_device["positions"].view(1, -1),
            attention=attention,
            sample_indices=on_device["sample_indices"],
            sample_chunks=sample_chunks,
            inputs=inputs,
        )

    def close(self) -> None:
        """Stop the tensor-parallel followers, if any (the engine's :meth:`close`)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
