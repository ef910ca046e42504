"""Sizes the device and host KV pools, in blocks, from bytes or free device memory."""

from __future__ import annotations

import logging

import torch

from engine.config import CacheConfig, EngineConfig
from engine.errors import EngineError
from engine.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


def size_kv_cache(config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> CacheConfig:
    """Number of device and host blocks.

    The device pool is ``kv_cache_memory`` when given; otherwise on CUDA a
    ``gpu_memory_utilization`` fraction of the memory free after the weights, on CPU 1 GiB.

    Raises:
        EngineError: the budget does not hold a single block.
    """
    device_bytes = config.kv_cache_bytes
    if device_bytes is None:
        if device.type == "cuda":
            free_bytes, _total = torch.cuda.mem_get_info(device)
            device_bytes = int(free_bytes * config.gpu_memory_utilization)
        else:
            device_bytes = DEFAULT_CPU_KV_BYTES
    num_gpu_blocks = spec.num_blocks_for(device_bytes)
    if num_gpu_blocks < 1:
        raise EngineError(
            f"kv_cache_memory ({device_bytes} bytes) holds no block of {spec.bytes_per_block} bytes; raise it"
        )
    num_cpu_blocks = spec.num_blocks_for(config.swap_space_bytes)
    logger.info(
        "KV cache: %d device blocks (%.1f MiB), %d host blocks (%.1f MiB), %d tokens per block",
        num_gpu_blocks, num_gpu_blocks * spec.bytes_per_block / 2**20,
        num_cpu_blocks, num_cpu_blocks * spec.bytes_per_block / 2**20, spec.block_size,
    )
    return CacheConfig(block_size=spec.block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks)
