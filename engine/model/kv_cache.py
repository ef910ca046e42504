"""The paged KV cache tensors: one device pool and one host (swap) pool, and the block copies
between them. The block manager decides which blocks; this module only holds and moves bytes.

Layout of each pool (one tensor for all layers)::

    pool[layer, 0 = key | 1 = value, block_id, offset_in_block, kv_head, head_dim]

    token at position p of a request lives at slot  block_table[p // block_size] * block_size
                                                     + p % block_size
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# NOTE: the largest magnitude a fetched key or value may have (float16's maximum). Real keys and values are
# orders of magnitude smaller (float16 models compute them in float16); a block beyond it was not computed by
# a model (a block of 1e30s would load and silently wreck every answer that attends over it).
MAX_KV_MAGNITUDE = 65504.0


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one KV block, from the model config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def num_blocks_for(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block

    def zeroed_blocks(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """A device pool of ``num_blocks`` blocks, ``[layers, 2 (key, value), num_blocks, block_size, kv_heads,
        head_dim]``, zeroed: on the CPU lazily (:func:`lazy_zeros`). The engine's pool and the draft model's
        (engine/spec/draft_model.py) are made here.

        NOTE: zeros, never torch.empty: padded reads of never-written slots are masked out, but a NaN bit pattern
        there would still poison the weighted sum (0 * NaN = NaN).
        """
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if device.type == "cpu":
            return lazy_zeros(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=device)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor on fresh anonymous memory: it reads as zeros and becomes resident only
    where it is written, so a large KV budget costs memory only as blocks are first used."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor keeps buffer alive


class KVCache:
    """Device and host pools, plus swap copies between them.

    On CUDA the host pool is pinned and copies run on a side stream:

    - swap-out: the side stream gathers the victim's blocks into a device staging tensor, and
      the compute stream waits only for that gather (after it, the freed blocks may be
      reused). The device-to-host copy then runs on the side stream *while the forward
      computes*; the staged bytes are scattered into the host pool at the next step, once the
      copy is done (a swapped-out request is never swapped back in within the same step).
    - swap-in: host blocks are gathered into pinned staging memory and copied on the side
      stream; the compute stream waits for them before the forward that reads them.

    On CPU both are plain synchronous copies between two separate tensors.
    """

    def __init__(self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        # NOTE: one block more than the block manager hands out: the scratch block, where padding
        # rows of static-shape decode steps write their keys and values (engine/model/static_decode.py).
        self.scratch_block_id = num_gpu_blocks
        host_shape = (spec.num_layers, 2, num_cpu_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        is_cuda = device.type == "cuda"
        # NOTE: both pools zeroed (see KVCacheSpec.zeroed_blocks); on CPU the zeros come lazily from the kernel (see
        # lazy_zeros), and the block manager reuses the most recently freed blocks first, so resident memory tracks
        # the peak number of used blocks.
        self.device_pool = spec.zeroed_blocks(num_gpu_blocks + 1, device)
        if is_cuda:
            self.host_pool = torch.zeros(host_shape, dtype=spec.dtype, pin_memory=num_cpu_blocks > 0)
        else:
            self.host_pool = lazy_zeros(host_shape, spec.dtype)
        self._copy_stream = torch.cuda.Stream(device) if is_cuda else None  # type: ignore[no-untyped-call]
        # Device-to-host copies still in flight: (pinned staging, host block ids, done event).
        self._pending_host_writes: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []

    @property
    def num_gpu_blocks(self) -> int:
        """Blocks the block manager may hand out (the scratch block excluded)."""
        return self.scratch_block_id

    @property
    def num_cpu_blocks(self) -> int:
        return int(self.host_pool.shape[2])

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value pools of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]``."""
        return self.device_pool[layer_idx, 0], self.device_pool[layer_idx, 1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks onto device blocks (``(source, destination)`` pairs), in every layer:
        a sample's own copy of a block it shared, before it writes into it."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.device_pool[:, :, dst] = self.device_pool[:, :, src]

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each device block's keys and values, every layer, as bytes laid out ``[layer, key | value, offset_in_block,
        kv_head, head_dim]`` (the fleet cache's wire value, engine/kv/block_store.py)."""
        index = torch.tensor(block_ids, device=self.device)
        gathered = self.device_pool[:, :, index].permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        raw = gathered.view(torch.uint8).reshape(len(block_ids), -1).numpy()
        return [row.tobytes() for row in raw]

    def write_blocks(self, block_ids: list[int], blocks: Sequence[bytes | memoryview]) -> None:
        """Overwrite device blocks with bytes :meth:`read_blocks` gave (on an engine of the same model, dtype
        and block layout)."""
        spec = self.spec
        shape = (len(block_ids), spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        values = _as_values(blocks, spec.dtype).view(shape).permute(1, 2, 0, 3, 4, 5)
        index = torch.tensor(block_ids, device=self.device)
        self.device_pool[:, :, index] = values.to(self.device)

    def check_blocks(self, blocks: Sequence[bytes | memoryview]) -> list[str | None]:
        """Why each block's bytes cannot be keys and values this pool computed, None where they can: the wrong
        length, non-finite values, or values beyond :data:`MAX_KV_MAGNITUDE`. Any thread (the fleet cache's rules,
        engine/kv/fetch_rules.py, check fetched blocks on the fetch thread, before they may be written); reads no
        pool."""
        block_bytes = self.spec.bytes_per_block
        sized = [block for block in blocks if len(block) == block_bytes]
        # NOTE: one pass over the values; a NaN anywhere makes its block's peak NaN (amax propagates it).
        peaks = iter(_as_values(sized, self.spec.dtype).view(len(sized), -1).abs().amax(dim=1).tolist()
                     if sized else [])
        reasons: list[str | None] = []
        for block in blocks:
            peak = next(peaks) if len(block) == block_bytes else None
            reasons.append(f"{len(block)} bytes, not the {block_bytes} of a block" if peak is None else
                           None if peak <= MAX_KV_MAGNITUDE else
                           "non-finite values" if not math.isfinite(peak) else
                           f"values up to {peak:.3g}, beyond any real key or value ({MAX_KV_MAGNITUDE:g})")
        return reasons

    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks (pairs of ``(device_block_id, host_block_id)``)."""
        self._finish_host_writes()
        if not device_to_host:
            return
        src = torch.tensor([d for d, _ in device_to_host], device=self.device)
        dst = torch.tensor([h for _, h in device_to_host])
        if self._copy_stream is None:
            self.host_pool[:, :, dst] = self.device_pool[:, :, src]
            return
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)  # the gather must see every earlier write
        with torch.cuda.stream(self._copy_stream):
            staged = self.device_pool[:, :, src]
            gathered = torch.cuda.Event()  # type: ignore[no-untyped-call]
            gathered.record()
            pinned = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            pinned.copy_(staged, non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record()
        staged.record_stream(self._copy_stream)
        compute.wait_event(gathered)  # freed blocks may be overwritten once gathered
        self._pending_host_writes.append((pinned, dst, copied))

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        """Copy host blocks back into device blocks (pairs of ``(host_block_id, device_block_id)``).

        NOTE: called after :meth:`swap_out` of the same step, which completed every earlier
        step's host writes; this step's swap-outs target other host blocks (the scheduler never
        swaps a request out and back in within one step), so they may stay in flight.
        """
        if not host_to_device:
            return
        src = torch.tensor([h for h, _ in host_to_device])
        dst = torch.tensor([d for _, d in host_to_device], device=self.device)
        if self._copy_stream is None:
            self.device_pool[:, :, dst] = self.host_pool[:, :, src]
            return
        pinned = self.host_pool[:, :, src].pin_memory()
        # NOTE: block copies of this step (compute stream) may read blocks this swap-in overwrites.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            self.device_pool[:, :, dst] = pinned.to(self.device, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        torch.cuda.current_stream(self.device).wait_event(done)  # the forward reads these blocks

    def _finish_host_writes(self) -> None:
        """Scatter completed device-to-host copies into the host pool (CUDA only)."""
        for pinned, dst, copied in self._pending_host_writes:
            copied.synchronize()
            self.host_pool[:, :, dst] = pinned
        self._pending_host_writes.clear()


def _as_values(blocks: Sequence[bytes | memoryview], dtype: torch.dtype) -> torch.Tensor:
    """The blocks' bytes, concatenated, as one flat CPU tensor of ``dtype``.

    NOTE: one copy, into a writable buffer: torch.frombuffer warns on read-only ones (bytes, their views).
    """
    return torch.frombuffer(bytearray().join(blocks), dtype=torch.uint8).view(dtype)
