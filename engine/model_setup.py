"""Builds the engine's real parts from a config: loads the model, sizes the KV cache from bytes or
free device memory, and wires scheduler, runner and limits. Imports torch (a loading helper)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine import cpu_linear, native_decoder
from engine.attention import cpu_kernel, select_backend
from engine.block_manager import BlockManager
from engine.clock import Clock
from engine.config import CacheConfig, EngineConfig
from engine.engine import ModelLimits
from engine.errors import EngineError, ModelLoadError
from engine.grammar import GrammarCompiler
from engine.kv_cache import KVCache, KVCacheSpec
from engine.model_loader import LoadedModel, load_model, resolve_device, resolve_dtype
from engine.model_runner import ModelRunner
from engine.paged_attention import register
from engine.sampler import Sampler
from engine.prefix_cache import PrefixCache
from engine.scheduler import Scheduler
from engine.static_decode import StaticDecode, cuda_graph_runner, decode_buckets

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineParts:
    """Everything ``Engine`` is made of, built from a config."""

    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Any
    limits: ModelLimits
    grammars: GrammarCompiler  # structured output, shared by the engine (admission) and the sampler


def build_engine_parts(config: EngineConfig, clock: Clock) -> EngineParts:
    """Load the model, size the KV cache and wire the parts.

    Raises:
        ModelLoadError: the model cannot be found or is not a decoder-only model.
        EngineError: the KV budget holds not a single block.
    """
    model_config = config.model
    if model_config.num_threads:
        torch.set_num_threads(model_config.num_threads)
    _prebuild_cpu_extensions(config)
    loaded = load_model(model_config.name, device=model_config.device, dtype=model_config.dtype,
                        attn_implementation=register(), max_model_len=model_config.max_model_len,
                        cache_dir=model_config.cache_dir)
    spec = kv_cache_spec(loaded, config.cache.block_size)
    num_gpu_blocks, num_cpu_blocks = size_kv_cache(config.cache, spec, loaded.device)
    kv_cache = KVCache(spec, num_gpu_blocks, num_cpu_blocks, loaded.device)
    block_manager = BlockManager(num_gpu_blocks, num_cpu_blocks, spec.block_size)
    prefix_cache = PrefixCache(block_manager) if config.cache.enable_prefix_caching else None
    scheduler = Scheduler(config.scheduler, block_manager, clock, loaded.eos_token_ids, loaded.max_model_len,
                          prefix_cache)
    max_request_tokens = min(loaded.max_model_len, num_gpu_blocks * spec.block_size)
    limits = ModelLimits(model_name=model_config.name, source=loaded.source, vocab_size=loaded.model.config.vocab_size,
                         max_request_tokens=max_request_tokens,
                         is_cache_bound=max_request_tokens < loaded.max_model_len,
                         kv_block_bytes=spec.bytes_per_block)
    logger.info(
        "engine ready: model=%s device=%s dtype=%s kv_blocks=%d (+%d host) block_size=%d max_model_len=%d",
        model_config.name, loaded.device, loaded.dtype, num_gpu_blocks, num_cpu_blocks, spec.block_size,
        loaded.max_model_len,
    )
    backend = select_backend(config.execution.attention_backend, loaded.device)
    logger.info("attention backend: %s", backend.name)
    grammars = GrammarCompiler(loaded.tokenizer, limits.vocab_size, loaded.eos_token_ids)
    runner = ModelRunner(loaded, kv_cache, Sampler(grammars), backend)
    if config.execution.compile == "auto":
        if runner.device.type == "cpu":
            runner.native_decoder = native_decoder.native_decoder_for(runner)
            if runner.native_decoder is not None:
                runner.sampler.argmax = native_decoder.greedy_token_ids
        else:
            capture_decode_steps(runner, config.scheduler.max_num_seqs, max_request_tokens)
    return EngineParts(scheduler, runner, loaded.tokenizer, limits, grammars)


def _prebuild_cpu_extensions(config: EngineConfig) -> None:
    """Start compiling the C++ extensions a CPU engine will use (first start on a machine only:
    later ones load the cached binaries), side by side and while the model loads."""
    try:
        device = resolve_device(config.model.device)
    except ModelLoadError:
        return  # load_model reports it
    if device.type != "cpu":
        return
    if config.execution.attention_backend in ("auto", "cpu"):
        cpu_kernel.build_in_background()
    if config.execution.compile == "auto":
        native_decoder.build_in_background()
    cpu_linear.prebuild_kernel_for(resolve_dtype(config.model.dtype, device))


def capture_decode_steps(runner: ModelRunner, max_num_seqs: int, max_request_tokens: int) -> None:
    """On CUDA with a graph-safe backend, capture decode steps in CUDA graphs, one per batch bucket.

    NOTE: the CPU's counterpart is engine/native_decoder (every step, no buckets). Inductor was
    measured there first: 70-140 s per bucket to compile SmolLM2 on 2 cores for 10-25% faster
    steps, and with dynamic shapes its outputs drifted from eager (see ops/bench/README.md).
    """
    if runner.device.type != "cuda":
        logger.info("decode steps run eagerly on %s", runner.device.type)
        return
    if runner.backend.name == "reference":
        logger.info("no CUDA graphs with the reference attention backend (it plans on the host per step)")
        return
    block_size = runner.block_size
    static = StaticDecode(runner.forward, runner.kv_cache, runner.backend, decode_buckets(max_num_seqs),
                          max_blocks_per_seq=(max_request_tokens + block_size - 1) // block_size)
    static.prepare_runners(cuda_graph_runner(torch.cuda.graph_pool_handle()), "capturing CUDA graphs")
    runner.static_decode = static


def kv_cache_spec(loaded: LoadedModel, block_size: int) -> KVCacheSpec:
    """The shape of one KV block of this model."""
    model_config = loaded.model.config
    num_heads = model_config.num_attention_heads
    return KVCacheSpec(
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=getattr(model_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(model_config, "head_dim", None) or model_config.hidden_size // num_heads,
        block_size=block_size,
        dtype=loaded.dtype,
    )


def size_kv_cache(config: CacheConfig, spec: KVCacheSpec, device: torch.device) -> tuple[int, int]:
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
    return num_gpu_blocks, num_cpu_blocks
