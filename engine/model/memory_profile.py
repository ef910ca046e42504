"""How much device memory a step needs beside the weights and the KV pool, measured before the pool
is carved out (as vLLM and nano-vllm do): without it, a high ``gpu_memory_utilization``
leaves too little for the first large prefill or for the captured decode graphs.

The profile runs the largest steps the scheduler can make through a model runner of their own, on
a KV pool just large enough for them, the same ``execute`` path as every real step:

- the largest mixed step: ``max_num_batched_tokens`` tokens over ``max_num_seqs`` sequences (each
  samples a row of logits), the first one a whole ``max_prefill_chunk``;
- the largest decode bucket: ``max_num_seqs`` one-token decodes, when decode steps are captured
  (a CUDA graph keeps its activations in a pool of its own, beside the eager steps' memory);
- the largest verification shape, when speculation's verification steps are captured too: its
  sequences' newest token and drafts, a row of logits sampled for each.

Imports torch (a loading helper).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.engine.config import SchedulerConfig
from tokenmill.engine.core.step_io import ScheduledChunk, SchedulerOutput
from tokenmill.engine.kernels.attention import AttentionBackend
from tokenmill.engine.model.kv_cache import KVCache, KVCacheSpec
from tokenmill.engine.model.model_loader import LoadedModel
from tokenmill.engine.model.model_runner import ModelRunner
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.protocol.sampling import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)

# Runs one step and returns the bytes it allocated at its peak beyond what was allocated before it.
Measure = Callable[[Callable[[], object]], int]

# How every profiled row samples: the sampler's largest path, not greedy's argmax over the logits. A top-p row
# sorts the whole vocabulary (values and indices), then softmax and the random draw each make another
# [rows, vocab] tensor, and logprobs a log-softmax of the rows: at 256 rows of a 128k vocabulary, gigabytes.
PROFILE_SAMPLING = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, logprobs=MAX_LOGPROBS)


@dataclass(frozen=True)
class StepProfile:
    """One profiled step: its shape and the memory it needed at its peak."""

    name: str
    query_lengths: list[int]  # tokens of each sequence
    peak_bytes: int
    captured: bool  # a decode bucket that will be captured in a CUDA graph (its memory is its own)


def largest_step(config: SchedulerConfig) -> list[int]:
    """Query tokens of each sequence in the largest step the scheduler can make: as many sequences
    as may run (each samples a row of logits), the first a whole prefill chunk, the budget's tokens
    in all (every sequence at least one, none over ``max_prefill_chunk``)."""
    num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
    total = min(config.max_num_batched_tokens, num_seqs * config.max_prefill_chunk)
    first = min(config.max_prefill_chunk, total - (num_seqs - 1))
    rest, extra = divmod(total - first, max(1, num_seqs - 1))
    return [first] + [rest + (1 if i < extra else 0) for i in range(num_seqs - 1)]


def profile_steps(loaded: LoadedModel, spec: KVCacheSpec, backend: AttentionBackend, config: SchedulerConfig,
                  with_decode_bucket: bool, measure: Measure,
                  verification: tuple[int, int] | None = None) -> list[StepProfile]:
    """Run the largest mixed step (and the largest decode bucket, and verification shape) and measure each one's
    peak.

    Args:
        loaded: the model, on its device.
        spec: the KV block shape; a pool just large enough for the steps is made and dropped.
        backend: the attention backend the engine will use.
        config: the step budgets.
        with_decode_bucket: also profile ``max_num_seqs`` decodes (decode steps will be captured).
        measure: runs a step and returns its peak bytes (:func:`cuda_peak_bytes` on CUDA).
        verification: ``(sequences, query tokens)`` of the largest verification step that will be captured (every
            token a sampled row of logits); None: none will be.
    """
    steps = [("largest step", largest_step(config), False)]
    if with_decode_bucket:
        steps.append(("largest decode bucket", [1] * config.max_num_seqs, True))
    if verification is not None:
        steps.append(("largest verification shape", [verification[1]] * verification[0], True))
    blocks_per_step = [sum(-(-n // spec.block_size) for n in lengths) for _, lengths, _ in steps]
    kv_cache = KVCache(spec, max(blocks_per_step), 0, loaded.device)
    runner = ModelRunner(loaded, kv_cache, Sampler(), backend)
    profiles = []
    for name, lengths, captured in steps:
        chunks = _chunks(lengths, spec.block_size, drafts=name == "largest verification shape")
        peak = measure(functools.partial(runner.execute, SchedulerOutput(chunks=chunks)))
        profiles.append(StepProfile(name, lengths, peak, captured))
        logger.info("memory profile: %s (%d tokens, %d sequences) needs %.1f MiB at its peak",
                    name, sum(lengths), len(lengths), peak / 2**20)
    return profiles


def _chunks(lengths: list[int], block_size: int, drafts: bool = False) -> list[ScheduledChunk]:
    """First prompt chunks of the given lengths, each in blocks of its own, all sampling as
    :data:`PROFILE_SAMPLING` (a top-p draw with logprobs); with ``drafts``, every token but the first a draft
    token (a verification step: a row of logits sampled per token)."""
    chunks = []
    next_block = 0
    for i, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        chunks.append(ScheduledChunk(
            request_id=f"profile-{i}", token_ids=[0] * length, start_position=0,
            block_ids=list(range(next_block, next_block + num_blocks)), needs_sample=True,
            sampling_params=PROFILE_SAMPLING, num_output_tokens=0, num_draft_tokens=length - 1 if drafts else 0,
        ))
        next_block += num_blocks
    return chunks


def cuda_peak_bytes(device: torch.device) -> Measure:
    """A :data:`Measure` on CUDA: ``torch.cuda.max_memory_allocated`` over the step, less what was
    allocated when it started."""

    def measure(step: Callable[[], object]) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device)) - before

    return measure


def kv_pool_bytes(free_bytes: int, total_bytes: int, gpu_memory_utilization: float,
                  profiles: list[StepProfile], reserved_bytes: int = 0) -> int:
    """Bytes of the KV pool on CUDA: ``gpu_memory_utilization`` of the device's total memory (as vLLM
    reads it), less what is in use already (the weights -- a draft model's too, loaded before this is
    read --, the CUDA context, anything else on the device: ``total_bytes - free_bytes``), what the
    steps need beside the pool and ``reserved_bytes`` (a draft model's batched forwards, which may run
    while a step does). Eager steps reuse one another's memory (the largest counts); captured decode
    graphs keep their activations in a pool of their own (they add to it).

    Returns:
        The pool's bytes (with a draft model, its cache's too: engine/model/model_setup.py
        :func:`size_kv_cache` splits them); 0 or less when the rest already takes the whole share.
    """
    eager = max((p.peak_bytes for p in profiles if not p.captured), default=0)
    graphs = sum(p.peak_bytes for p in profiles if p.captured)
    return int(total_bytes * gpu_memory_utilization) - (total_bytes - free_bytes) - eager - graphs - reserved_bytes
