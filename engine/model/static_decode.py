"""Decode steps at static shapes: persistent input buffers padded to batch-size buckets, so that a
decode step of n sequences runs the same kernels on the same memory every time. On CUDA each
bucket's forward is captured once in a CUDA graph at start-up and replayed (no Python, no launch
overhead). Tests run the same buffers eagerly on the CPU.

Padding rows (bucket size - n of them) attend a one-token context in the KV cache's scratch
block and write their (ignored) keys and values there, so real blocks are never touched::

    rows:         0 .. n-1  real decodes          n .. bucket-1  padding
    seq_lens:     c0 ... c(n-1)                   1
    block row:    the request's blocks            [scratch, ...]
    slot:         its next slot                   scratch * block_size

Imports torch (a model-runner helper).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.engine.core.step_io import ScheduledChunk
from tokenmill.engine.kernels.attention import AttentionBackend, AttentionMetadata
from tokenmill.engine.model.hf_attention import StepAttention
from tokenmill.engine.model.kv_cache import KVCache
from tokenmill.engine.model.step_inputs import StepInputs, TableRows

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepAttention], torch.Tensor]


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself."""
    buckets = [1]
    while buckets[-1] * 2 < max_num_seqs:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] != max_num_seqs:
        buckets.append(max_num_seqs)
    return buckets


class StaticDecode:
    """Persistent decode inputs for up to ``max(buckets)`` sequences, and one runner per bucket.

    Args:
        forward: ``(input_ids [1, b], position_ids [1, b], logits_to_keep [b], step) -> logits [b, vocab]``.
        kv_cache: the pools; its scratch block takes the padding rows' writes.
        backend: the attention backend (it must not depend on host-side per-step values).
        buckets: the batch sizes to prepare, ascending.
        max_blocks_per_seq: block-table width (the longest request's blocks).
    """

    def __init__(self, forward: Forward, kv_cache: KVCache, backend: AttentionBackend, buckets: list[int],
                 max_blocks_per_seq: int) -> None:
        self._forward = forward
        self._kv_cache = kv_cache
        self._backend = backend
        self.buckets = buckets
        self.block_size = kv_cache.spec.block_size
        device = kv_cache.device
        size = buckets[-1]
        self._input_ids = torch.zeros(1, size, dtype=torch.long, device=device)
        self._positions = torch.zeros(1, size, dtype=torch.long, device=device)
        self._slot_mapping = torch.zeros(size, dtype=torch.long, device=device)
        self._block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self._query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self._logits_to_keep = torch.arange(size, dtype=torch.long, device=device)
        self._runners: dict[int, Callable[[], torch.Tensor]] = {}
        self.num_runs: Counter[int] = Counter()  # steps run through each bucket's runner

    def fits(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this step is all decodes, few enough, with tables no wider than the buffers.

        NOTE: a one-token chunk is not always a decode: a prompt clipped to one token by the step's
        budget has more prompt to come and samples nothing, while a static step returns a row of
        logits for every chunk (and the runner samples each); such a step runs eagerly.
        """
        width = self._block_tables.shape[1]
        return (0 < len(chunks) <= self.buckets[-1] and all(c.num_tokens == 1 and c.needs_sample for c in chunks)
                and all(len(c.block_ids) <= width for c in chunks))

    def bucket_for(self, num_sequences: int) -> int:
        return next(b for b in self.buckets if b >= num_sequences)

    def prepare_runners(self, make_runner: Callable[[int, Callable[[], torch.Tensor]], Callable[[], torch.Tensor]],
                        what: str) -> None:
        """Build each bucket's runner from its eager forward, largest first, with a progress line.

        Args:
            make_runner: ``(bucket, eager forward) -> runner`` (capture a graph, or compile).
            what: how the log names the work ("capturing CUDA graphs", ...).
        """
        start = time.perf_counter()
        for i, bucket in enumerate(sorted(self.buckets, reverse=True), 1):
            self._fill_padding(0, bucket)
            self._runners[bucket] = make_runner(bucket, self._eager(bucket))
            logger.info("%s: bucket %d (%d/%d)", what, bucket, i, len(self.buckets))
        logger.info("%s: %d buckets in %.1f s", what, len(self.buckets), time.perf_counter() - start)

    def run(self, chunks: list[ScheduledChunk], tables: TableRows | None = None) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` of a decode step, rows in chunk order.

        Args:
            chunks: the step's decodes.
            tables: their block tables, a row per chunk in order, as wide as the longest (the runner's persistent
                batch, engine/model/input_batch.py); None: flattened from the chunks here.
        """
        num = len(chunks)
        bucket = self.bucket_for(num)
        self._fill(chunks, tables)
        self._fill_padding(num, bucket)
        self.num_runs[bucket] += 1
        return self._runners[bucket]()[:num]

    @property
    def runners(self) -> dict[int, Callable[[], torch.Tensor]]:
        """Each bucket's runner (a :class:`CapturedStep` on CUDA), as ``prepare_runners`` built it."""
        return dict(self._runners)

    def _eager(self, bucket: int) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(
            slot_mapping=self._slot_mapping[:bucket], block_tables=self._block_tables[:bucket],
            seq_lens=self._seq_lens[:bucket], query_start_loc=self._query_start_loc[: bucket + 1],
            num_decodes=bucket, max_seq_len=self._block_tables.shape[1] * self.block_size, max_query_len=1,
            seq_lens_host=[], query_start_host=list(range(bucket + 1)),
        )
        step = StepAttention(self._kv_cache, meta, self._backend)
        input_ids, positions = self._input_ids[:, :bucket], self._positions[:, :bucket]
        keep = self._logits_to_keep[:bucket]
        return lambda: self._forward(input_ids, positions, keep, step)

    def _fill(self, chunks: list[ScheduledChunk], rows: TableRows | None = None) -> None:
        """Copy one step's inputs into the first rows of the buffers: one host-to-device copy (pinned
        memory on CUDA, engine/model/step_inputs.py), then one device copy per buffer."""
        bs = self.block_size
        num = len(chunks)
        positions = [c.start_position for c in chunks]
        tables = [c.block_ids for c in chunks]
        inputs = StepInputs()
        inputs.add("ids", [c.token_ids[0] for c in chunks])
        inputs.add("positions", positions)
        inputs.add("slots", [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)])
        inputs.add("seq_lens", [p + 1 for p in positions])
        if rows is not None:
            width = rows.width
            inputs.add_rows("tables", rows)
        else:
            width = max(len(t) for t in tables)
            inputs.add("tables", [b for t in tables for b in t + [0] * (width - len(t))])
        on_device = inputs.upload(self._kv_cache.device)
        self._input_ids[0, :num].copy_(on_device["ids"])
        self._positions[0, :num].copy_(on_device["positions"])
        self._slot_mapping[:num].copy_(on_device["slots"])
        self._block_tables[:num, :width].copy_(on_device["tables"].view(num, width))
        self._seq_lens[:num].copy_(on_device["seq_lens"])

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows ``start .. end - 1`` attend one scratch slot and write their keys and values there."""
        if start >= end:
            return
        scratch = self._kv_cache.scratch_block_id
        self._input_ids[0, start:end] = 0
        self._positions[0, start:end] = 0
        self._slot_mapping[start:end] = scratch * self.block_size
        self._block_tables[start:end, 0] = scratch
        self._seq_lens[start:end] = 1


class CapturedStep:
    """A bucket's decode step captured in a CUDA graph: calling it replays the graph.

    Args:
        graph: the captured forward.
        output: the logits tensor the graph writes.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> None:
        self.graph = graph
        self.output = output
        self.num_replays = 0

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        self.num_replays += 1
        return self.output


def cuda_graph_runner(pool: Any) -> Callable[[int, Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]:
    """A ``make_runner`` for :meth:`StaticDecode.prepare_runners` that captures CUDA graphs in one pool."""

    def make(bucket: int, eager: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        with torch.inference_mode():
            for _ in range(2):  # NOTE: warm up: kernels compile (Triton) and allocate outside the capture
                eager()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = eager()
        return CapturedStep(graph, output)

    return make
