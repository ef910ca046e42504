"""Decode and verification steps at static shapes: persistent input buffers padded to buckets, so that
a step of n sequences with q query tokens each runs the same kernels on the same memory every time. On
CUDA each shape's forward is captured once in a CUDA graph at start-up and replayed (no Python, no
launch overhead). Tests run the same buffers eagerly on the CPU.

A shape is ``(bucket, q)``: ``bucket`` sequences (a power of two, or ``max_num_seqs``) of ``q`` query
tokens each. ``q = 1`` is a plain decode step; ``q = 1 + k`` a verification step, where each request
runs its newest token and up to ``k`` draft tokens (speculation) and every row is sampled. A request
with fewer drafts than the step's longest is padded to ``q``, as vLLM pads its uniform ``1 + k``
batches. Padding tokens (a shorter request's tail) and padding sequences (bucket - n of them) write
their (ignored) keys and values into the KV cache's scratch block, so real blocks are never touched::

    tokens of sequence j:  rows j*q .. j*q + n_j - 1   its own (newest token, then drafts)
                           rows j*q + n_j .. j*q + q-1 padding: slot in the scratch block
    seq_lens:              start_j + q (so row i sits at position start_j + i, as the kernels derive it)
    padding sequences:     q tokens at positions 0 .. q - 1 of the scratch block, seq_len q

A padding token attends positions past its request's own (whatever its block-table row holds there,
block 0 beyond its blocks): causal masking keeps every real row from seeing them, and their logits are
never read. Imports torch (a model-runner helper).
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
Shape = tuple[int, int]  # (sequences in the bucket, query tokens per sequence)
# The most tokens a captured verification step runs (bucket x query length). Drafting pays where a step is bound
# by reading the weights, small batches; a larger verification runs eagerly, and its logits (a row per token)
# need no graph memory kept for them.
MAX_VERIFY_TOKENS = 512


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself."""
    buckets = [1]
    while buckets[-1] * 2 < max_num_seqs:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] != max_num_seqs:
        buckets.append(max_num_seqs)
    return buckets


def verify_query_lens(num_speculative_tokens: int) -> list[int]:
    """Query lengths of the verification steps captured: ``1 + k`` for ``k`` = 1, 2, 4, ... and
    ``num_speculative_tokens`` (a step runs in the shortest that holds its longest draft, so padding
    at most doubles a step's draft tokens); none without speculation."""
    return [1 + k for k in decode_buckets(num_speculative_tokens)] if num_speculative_tokens > 0 else []


def static_shapes(buckets: list[int], query_lens: list[int]) -> list[Shape]:
    """The shapes prepared: every bucket for decode steps (``q = 1``); for each verification length ``q``, the
    buckets whose steps run at most ``MAX_VERIFY_TOKENS`` tokens (bucket 1 always)."""
    return [(bucket, q) for q in sorted(set(query_lens)) for bucket in buckets
            if q == 1 or bucket == 1 or bucket * q <= MAX_VERIFY_TOKENS]


def largest_verification(max_num_seqs: int, num_speculative_tokens: int) -> Shape | None:
    """The verification shape with the most tokens that :class:`StaticDecode` prepares (what the memory profile
    measures); None without speculation."""
    shapes = static_shapes(decode_buckets(max_num_seqs), verify_query_lens(num_speculative_tokens))
    return max(shapes, key=lambda shape: (shape[0] * shape[1], shape)) if shapes else None


class StaticDecode:
    """Persistent inputs for up to ``max(buckets)`` sequences of up to ``max(query_lens)`` tokens, and one
    runner per shape.

    Args:
        forward: ``(input_ids [1, T], position_ids [1, T], logits_to_keep [T], step) -> logits [T, vocab]``.
        kv_cache: the pools; its scratch block takes the padding's writes.
        backend: the attention backend; it must read only the metadata's tensors (the CPU kernel, Triton), never
            per-step host values, which a replayed graph would not see.
        buckets: the batch sizes to prepare, ascending.
        max_blocks_per_seq: block-table width (the longest request's blocks).
        query_lens: the query lengths to prepare: 1 (decode steps) and those of :func:`verify_query_lens`, each in
            the buckets :func:`static_shapes` gives it.
    """

    def __init__(self, forward: Forward, kv_cache: KVCache, backend: AttentionBackend, buckets: list[int],
                 max_blocks_per_seq: int, query_lens: list[int] | None = None) -> None:
        self._forward = forward
        self._kv_cache = kv_cache
        self._backend = backend
        self.buckets = buckets
        self.query_lens = sorted(set(query_lens or [1]))
        if self.query_lens[0] != 1:
            raise ValueError(f"query lengths {self.query_lens} must include 1 (decode steps)")
        self.shapes = static_shapes(buckets, self.query_lens)
        self._known_shapes = frozenset(self.shapes)
        self.block_size = kv_cache.spec.block_size
        device = kv_cache.device
        size, tokens = buckets[-1], buckets[-1] * self.query_lens[-1]
        self._input_ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
        self._positions = torch.zeros(1, tokens, dtype=torch.long, device=device)
        self._slot_mapping = torch.zeros(tokens, dtype=torch.long, device=device)
        self._logits_to_keep = torch.arange(tokens, dtype=torch.long, device=device)
        self._block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        # per query length: the sequences' first rows, and the positions of padding sequences' tokens
        self._query_start_loc = {q: torch.arange(0, (size + 1) * q, q, dtype=torch.int32, device=device)
                                 for q in self.query_lens}
        self._padding_positions = {q: torch.arange(q, dtype=torch.long, device=device).repeat(size)
                                   for q in self.query_lens}
        self._rows = torch.zeros(tokens, dtype=torch.long, device=device)  # the real rows of a verification step
        self._runners: dict[Shape, Callable[[], torch.Tensor]] = {}
        self.num_runs: Counter[Shape] = Counter()  # steps run through each shape's runner

    def shape_for(self, chunks: list[ScheduledChunk]) -> Shape | None:
        """The shape a step runs in: every chunk a decode (its newest token, sampled) or a verification (its newest
        token and drafts, each sampled), few and short enough, with tables wide enough for the padded positions;
        None: the step runs through the flattened batch.

        NOTE: a one-token chunk is not always a decode: a prompt clipped to one token by the step's
        budget has more prompt to come and samples nothing, while a static step samples every row it
        keeps; such a step runs eagerly, as does any step with a prefill chunk.
        """
        if not 0 < len(chunks) <= self.buckets[-1]:
            return None
        longest = 0
        for chunk in chunks:
            if not chunk.needs_sample or chunk.num_sample_rows != chunk.num_tokens:
                return None
            longest = max(longest, chunk.num_tokens)
        q = next((q for q in self.query_lens if q >= longest), None)
        if q is None:
            return None
        shape = self.bucket_for(len(chunks)), q
        width = self._block_tables.shape[1]
        positions = width * self.block_size
        if shape not in self._known_shapes or any(len(c.block_ids) > width or c.start_position + q > positions
                                                  for c in chunks):
            return None
        return shape

    def bucket_for(self, num_sequences: int) -> int:
        return next(b for b in self.buckets if b >= num_sequences)

    def prepare_runners(self, make_runner: Callable[[Shape, Callable[[], torch.Tensor]], Callable[[], torch.Tensor]],
                        what: str) -> None:
        """Build each shape's runner from its eager forward, largest first, with a progress line.

        Args:
            make_runner: ``(shape, eager forward) -> runner`` (capture a graph, or compile).
            what: how the log names the work ("capturing CUDA graphs", ...).
        """
        start = time.perf_counter()
        shapes = sorted(self.shapes, key=lambda shape: (shape[0] * shape[1], shape), reverse=True)
        for i, shape in enumerate(shapes, 1):
            self._fill_padding(0, shape)
            self._runners[shape] = make_runner(shape, self._eager(shape))
            logger.info("%s: %d sequences x %d tokens (%d/%d)", what, shape[0], shape[1], i, len(shapes))
        logger.info("%s: %d shapes in %.1f s", what, len(shapes), time.perf_counter() - start)

    def run(self, chunks: list[ScheduledChunk], shape: Shape, tables: TableRows | None = None) -> torch.Tensor:
        """Logits of a step's sampled rows, ``[sum of the chunks' tokens, vocab]``: each chunk's rows in order, chunks
        in order (what the sampler takes).

        Args:
            chunks: the step's decodes and verifications (:meth:`shape_for` gave ``shape``).
            shape: the shape to run in.
            tables: their block tables, a row per chunk in order, as wide as the longest (the runner's persistent
                batch, engine/model/input_batch.py); None: flattened from the chunks here.
        """
        num_tokens = self._fill(chunks, shape, tables)
        self._fill_padding(len(chunks), shape)
        self.num_runs[shape] += 1
        logits = self._runners[shape]()
        if shape[1] == 1:
            return logits[: len(chunks)]
        return logits.index_select(0, self._rows[:num_tokens])

    @property
    def runners(self) -> dict[Shape, Callable[[], torch.Tensor]]:
        """Each shape's runner (a :class:`CapturedStep` on CUDA), as ``prepare_runners`` built it."""
        return dict(self._runners)

    def _eager(self, shape: Shape) -> Callable[[], torch.Tensor]:
        bucket, q = shape
        tokens = bucket * q
        meta = AttentionMetadata(
            slot_mapping=self._slot_mapping[:tokens], block_tables=self._block_tables[:bucket],
            seq_lens=self._seq_lens[:bucket], query_start_loc=self._query_start_loc[q][: bucket + 1],
            num_decodes=bucket if q == 1 else 0, max_seq_len=self._block_tables.shape[1] * self.block_size,
            max_query_len=q, seq_lens_host=[], query_start_host=list(range(0, (bucket + 1) * q, q)),
        )
        step = StepAttention(self._kv_cache, meta, self._backend)
        input_ids, positions = self._input_ids[:, :tokens], self._positions[:, :tokens]
        keep = self._logits_to_keep[:tokens]
        return lambda: self._forward(input_ids, positions, keep, step)

    def _fill(self, chunks: list[ScheduledChunk], shape: Shape, rows: TableRows | None = None) -> int:
        """Copy one step's inputs into the first rows of the buffers: one host-to-device copy (pinned
        memory on CUDA, engine/model/step_inputs.py), then one device copy per buffer. Returns the step's
        real tokens (rows sampled)."""
        bs = self.block_size
        q = shape[1]
        num = len(chunks)
        tables = [c.block_ids for c in chunks]
        inputs = StepInputs()
        if q == 1:
            starts = [c.start_position for c in chunks]
            inputs.add("ids", [c.token_ids[0] for c in chunks])
            inputs.add("positions", starts)
            inputs.add("slots", [t[p // bs] * bs + p % bs for t, p in zip(tables, starts)])
            inputs.add("seq_lens", [p + 1 for p in starts])
            num_tokens = num
        else:
            ids: list[int] = []
            positions: list[int] = []
            slots: list[int] = []
            real_rows: list[int] = []
            scratch_slot = self._kv_cache.scratch_block_id * bs
            for j, (chunk, table) in enumerate(zip(chunks, tables)):
                start, n = chunk.start_position, chunk.num_tokens
                ids += chunk.token_ids + [0] * (q - n)
                positions += range(start, start + q)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)] + [scratch_slot] * (q - n)
                real_rows += range(j * q, j * q + n)
            inputs.add("ids", ids)
            inputs.add("positions", positions)
            inputs.add("slots", slots)
            inputs.add("seq_lens", [c.start_position + q for c in chunks])
            inputs.add("rows", real_rows)
            num_tokens = len(real_rows)
        if rows is not None:
            width = rows.width
            inputs.add_rows("tables", rows)
        else:
            width = max(len(t) for t in tables)
            inputs.add("tables", [b for t in tables for b in t + [0] * (width - len(t))])
        on_device = inputs.upload(self._kv_cache.device)
        self._input_ids[0, : num * q].copy_(on_device["ids"])
        self._positions[0, : num * q].copy_(on_device["positions"])
        self._slot_mapping[: num * q].copy_(on_device["slots"])
        self._block_tables[:num, :width].copy_(on_device["tables"].view(num, width))
        self._seq_lens[:num].copy_(on_device["seq_lens"])
        if q > 1:
            self._rows[:num_tokens].copy_(on_device["rows"])
        return num_tokens

    def _fill_padding(self, start: int, shape: Shape) -> None:
        """Sequences ``start .. bucket - 1`` attend the scratch block and write their keys and values there."""
        bucket, q = shape
        if start >= bucket:
            return
        scratch = self._kv_cache.scratch_block_id
        lo, hi = start * q, bucket * q
        self._input_ids[0, lo:hi] = 0
        self._positions[0, lo:hi].copy_(self._padding_positions[q][: hi - lo])
        self._slot_mapping[lo:hi] = scratch * self.block_size
        self._block_tables[start:bucket, 0] = scratch
        self._seq_lens[start:bucket] = q


class CapturedStep:
    """A shape's step captured in a CUDA graph: calling it replays the graph.

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


def cuda_graph_runner(pool: Any) -> Callable[[Shape, Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]:
    """A ``make_runner`` for :meth:`StaticDecode.prepare_runners` that captures CUDA graphs in one pool."""

    def make(shape: Shape, eager: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        with torch.inference_mode():
            for _ in range(2):  # NOTE: warm up: kernels compile (Triton) and allocate outside the capture
                eager()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = eager()
        return CapturedStep(graph, output)

    return make
