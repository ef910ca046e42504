"""The paged KV cache tensors: one device pool and one host (swap) pool, and the block copies
between them. The block manager decides which blocks; this module only holds and moves bytes.

Layout of each pool (one tensor for all layers)::

    pool[layer, 0 = key | 1 = value, block_id, offset_in_block, kv_head, head_dim]

    token at position p of a request lives at slot  block_table[p // block_size] * block_size
                                                     + p % block_size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_for(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block


class KVCache:
    """Device and host pools, plus swap copies between them.

    On CUDA the host pool is pinned and copies run on a side stream; the forward pass waits on
    that stream's event only when it needs the swapped-in blocks (the next step).
    """

    def __init__(self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        shape = (spec.num_layers, 2, num_gpu_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # NOTE: zero-filled, not empty: padded reads of never-written slots are masked out, but a
        # NaN bit pattern there would still poison the weighted sum (0 * NaN = NaN).
        self.device_pool = torch.zeros(shape, dtype=spec.dtype, device=device)
        host_shape = (spec.num_layers, 2, num_cpu_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        pin = device.type == "cuda" and num_cpu_blocks > 0
        self.host_pool = torch.zeros(host_shape, dtype=spec.dtype, device="cpu", pin_memory=pin)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    @property
    def num_gpu_blocks(self) -> int:
        return int(self.device_pool.shape[2])

    @property
    def num_cpu_blocks(self) -> int:
        return int(self.host_pool.shape[2])

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value pools of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]``."""
        return self.device_pool[layer_idx, 0], self.device_pool[layer_idx, 1]

    def swap_out(self, device_to_host: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks (pairs of ``(device_block_id, host_block_id)``)."""
        if not device_to_host:
            return
        src = torch.tensor([d for d, _ in device_to_host], device=self.device)
        dst = torch.tensor([h for _, h in device_to_host])
        if self._copy_stream is None:
            self.host_pool[:, :, dst] = self.device_pool[:, :, src]
            return
        # The gather must see every write of the forward passes before it.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            staged = self.device_pool[:, :, src]
            self.host_pool[:, :, dst] = staged.to("cpu", non_blocking=False)
        # Later forwards may overwrite the freed device blocks: wait for the copy first.
        torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)

    def swap_in(self, host_to_device: list[tuple[int, int]]) -> None:
        """Copy host blocks back into device blocks (pairs of ``(host_block_id, device_block_id)``)."""
        if not host_to_device:
            return
        src = torch.tensor([h for h, _ in host_to_device])
        dst = torch.tensor([d for _, d in host_to_device], device=self.device)
        if self._copy_stream is None:
            self.device_pool[:, :, dst] = self.host_pool[:, :, src]
            return
        with torch.cuda.stream(self._copy_stream):
            staged = self.host_pool[:, :, src].pin_memory().to(self.device, non_blocking=True)
            self.device_pool[:, :, dst] = staged
        torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
