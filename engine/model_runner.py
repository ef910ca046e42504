"""Executes one SchedulerOutput: swap copies, one flattened forward over every scheduled token,
then sampling from the logits of each sequence's last token. Knows nothing of queues.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.model_loader import LoadedModel
from engine.outputs import ModelOutput, ScheduledChunk, SchedulerOutput
from engine.paged_attention import AttentionMetadata, PrefillSpan
from engine.sampler import Sampler, SamplingContext


# Keys + values gathered per decode chunk on CPU: small enough to stay in cache until SDPA
# reads them back (tuned on a 2-core AMD EPYC: 4 MiB chunks beat one gather by ~20%).
CPU_DECODE_CHUNK_BYTES = 4 << 20


@dataclass
class PreparedBatch:
    """Model inputs of one step, in the flattened order (decodes first, then prefill chunks)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [S] batch index of the last token of each chunk that samples
    sample_chunks: list[ScheduledChunk]  # the chunk of each row of the sampled logits


class ModelRunner:
    """Runs the model over the paged KV cache.

    Args:
        loaded: the model, on its device, registered with the paged attention implementation.
        kv_cache: the device and host pools.
        sampler: picks the next token of each sequence.
    """

    def __init__(self, loaded: LoadedModel, kv_cache: KVCache, sampler: Sampler) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.eos_token_ids = loaded.eos_token_ids
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.block_size = kv_cache.spec.block_size
        self._gather_workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Swap out, swap in, run the forward, sample.

        Args:
            scheduler_output: what to run this step, with each chunk's sampling parameters.

        Returns:
            One sampled token for every chunk with ``needs_sample``.
        """
        self.kv_cache.swap_out(scheduler_output.swap_out)
        self.kv_cache.swap_in(scheduler_output.swap_in)
        if not scheduler_output.chunks:
            return ModelOutput()
        batch = self.prepare(scheduler_output.chunks)
        logits = self._forward(batch)
        if not batch.sample_chunks:
            return ModelOutput()
        contexts = [SamplingContext(params=chunk.sampling_params, num_output_tokens=chunk.num_output_tokens,
                                    eos_token_ids=self.eos_token_ids) for chunk in batch.sample_chunks]
        sampled = self.sampler(logits, contexts)
        output = ModelOutput()
        for chunk, token_id, logprobs in zip(batch.sample_chunks, sampled.token_ids, sampled.logprobs):
            output.sampled_token_ids[chunk.request_id] = [token_id]
            if logprobs is not None:
                output.logprobs[chunk.request_id] = [logprobs]
        return output

    @torch.inference_mode()
    def _forward(self, batch: PreparedBatch) -> torch.Tensor:
        out = self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            logits_to_keep=batch.sample_indices,
            tokenmill_metadata=batch.metadata,
        )
        logits: torch.Tensor = out.logits[0]
        return logits

    def prepare(self, chunks: list[ScheduledChunk]) -> PreparedBatch:
        """Flatten chunks into model inputs and attention metadata (single-token chunks first,
        longest context first, so each decode chunk gathers little padding)."""
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: -c.start_position)
        prefills = [c for c in chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        token_ids: list[int] = []
        positions: list[int] = []
        for chunk in ordered:
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.start_position + chunk.num_tokens))
        dev = self.device
        decode_tables, decode_mask, decode_slots = self._decode_inputs(decodes)
        spans, prefill_slots = self._prefill_inputs(prefills, offset=len(decodes))
        slot_mapping = torch.cat([decode_slots, *prefill_slots]) if prefill_slots else decode_slots
        sample_indices: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        offset = 0
        for chunk in ordered:
            offset += chunk.num_tokens
            if chunk.needs_sample:
                sample_indices.append(offset - 1)
                sample_chunks.append(chunk)
        metadata = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slot_mapping.to(dev),
            num_decode_tokens=len(decodes),
            decode_block_tables=None if decode_tables is None else decode_tables.to(dev),
            decode_mask=None if decode_mask is None else decode_mask.to(dev),
            prefills=spans,
        )
        if decode_tables is not None:
            metadata.decode_key_buffer, metadata.decode_value_buffer = self._workspace(decode_tables.numel())
            metadata.decode_chunks = self._decode_chunks(decodes)
        return PreparedBatch(
            input_ids=torch.tensor([token_ids], device=dev),
            position_ids=torch.tensor([positions], device=dev),
            metadata=metadata,
            sample_indices=torch.tensor(sample_indices, dtype=torch.long, device=dev),
            sample_chunks=sample_chunks,
        )

    def _decode_chunks(self, decodes: list[ScheduledChunk]) -> list[tuple[int, int, int]]:
        """``(first row, end row, blocks per row)`` groups of decode rows (sorted longest first).

        On CPU a group's keys and values stay under ``CPU_DECODE_CHUNK_BYTES``; every group
        gathers only as many blocks as its longest row needs. On CUDA: one group.
        """
        bs = self.block_size
        row_blocks = [(c.start_position + bs) // bs for c in decodes]  # ceil((start + 1) / bs)
        if self.device.type != "cpu":
            return [(0, len(decodes), row_blocks[0])]
        layer_block_bytes = self.kv_cache.spec.bytes_per_block // self.kv_cache.spec.num_layers  # keys + values
        groups: list[tuple[int, int, int]] = []
        lo = 0
        while lo < len(decodes):
            rows = max(1, CPU_DECODE_CHUNK_BYTES // (row_blocks[lo] * layer_block_bytes))
            hi = min(len(decodes), lo + rows)
            groups.append((lo, hi, row_blocks[lo]))
            lo = hi
        return groups

    def _workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grow-only gather buffers for decode attention, shared by all layers and steps."""
        if self._gather_workspace is None or self._gather_workspace[0].shape[0] < num_blocks:
            spec = self.kv_cache.spec
            rows = max(num_blocks, 2 * (self._gather_workspace[0].shape[0] if self._gather_workspace else 0))
            shape = (rows, spec.block_size * spec.num_kv_heads * spec.head_dim)
            self._gather_workspace = (
                torch.empty(shape, dtype=spec.dtype, device=self.device),
                torch.empty(shape, dtype=spec.dtype, device=self.device),
            )
        return self._gather_workspace

    def _decode_inputs(
        self, decodes: list[ScheduledChunk]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Padded block tables, context masks and write slots of the single-token chunks."""
        if not decodes:
            return None, None, torch.empty(0, dtype=torch.long)
        bs = self.block_size
        context_lens = torch.tensor([c.start_position + 1 for c in decodes])
        max_blocks = (int(context_lens.max()) + bs - 1) // bs
        # Rows padded with block 0: the padded slots are masked out.
        tables = torch.tensor(
            [c.block_ids[:max_blocks] + [0] * (max_blocks - len(c.block_ids[:max_blocks])) for c in decodes],
            dtype=torch.long,
        )
        positions = context_lens - 1
        slots = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1) * bs + positions % bs
        mask = torch.arange(max_blocks * bs).unsqueeze(0) < context_lens.unsqueeze(1)
        return tables, mask[:, None, None, :], slots

    def _prefill_inputs(
        self, prefills: list[ScheduledChunk], offset: int
    ) -> tuple[list[PrefillSpan], list[torch.Tensor]]:
        bs = self.block_size
        spans: list[PrefillSpan] = []
        slots: list[torch.Tensor] = []
        for chunk in prefills:
            context = chunk.start_position + chunk.num_tokens
            num_blocks = (context + bs - 1) // bs
            block_ids = torch.tensor(chunk.block_ids[:num_blocks])
            positions = torch.arange(chunk.start_position, context)
            slots.append(block_ids[positions // bs] * bs + positions % bs)
            mask = None
            if chunk.start_position > 0:
                mask = torch.arange(context).unsqueeze(0) <= positions.unsqueeze(1)
                mask = mask.to(self.device)
            spans.append(PrefillSpan(offset, chunk.num_tokens, chunk.start_position, block_ids.to(self.device), mask))
            offset += chunk.num_tokens
        return spans, slots
