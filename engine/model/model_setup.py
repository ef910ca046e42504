"""Builds the engine's real parts from a config: loads the model, sizes the KV cache from bytes or
free device memory (on CUDA after a profile of the largest steps, engine/model/memory_profile.py), and wires
scheduler, runner and limits. Imports torch (a loading helper).
NOTE: measurements behind these choices: ops/bench/README.md, "Figures behind the kernels' comments"."""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.engine.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.engine.core.clock import Clock
from tokenmill.engine.core.fleet_cache import FleetCache
from tokenmill.engine.core.length_predictor import build_length_predictor
from tokenmill.engine.core.limits import ModelLimits
from tokenmill.engine.core.scheduler import PromptBlockCollection, Scheduler
from tokenmill.engine.errors import EngineError, ModelLoadError
from tokenmill.engine.kernels import cpu_linear
from tokenmill.engine.kernels.attention import AttentionBackend, cpu_kernel, select_backend
from tokenmill.engine.kv.block_manager import BlockManager
from tokenmill.engine.kv.block_store import namespace
from tokenmill.engine.kv.fetch_rules import FetchRules, TransferCost
from tokenmill.engine.kv.fleet_io import FleetIOFactory
from tokenmill.engine.kv.prefix_cache import PrefixCache
from tokenmill.engine.model import native_decoder
from tokenmill.engine.model.hf_attention import register
from tokenmill.engine.model.kv_cache import KVCache, KVCacheSpec
from tokenmill.engine.model.memory_profile import StepProfile, cuda_peak_bytes, kv_pool_bytes, profile_steps
from tokenmill.engine.model.model_loader import (
    LoadedModel,
    load_model,
    resolve_device,
    resolve_dtype,
    tokenizer_fingerprint,
)
from tokenmill.engine.model.model_runner import ModelRunner
from tokenmill.engine.model.static_decode import (
    StaticDecode,
    cuda_graph_runner,
    decode_buckets,
    largest_verification,
    verify_query_lens,
)
from tokenmill.engine.model.tensor_parallel import Shard
from tokenmill.engine.model.tp_leader import TensorParallelLeader
from tokenmill.engine.output.no_tokenizer import NoTokenizer
from tokenmill.engine.sample.grammar import GrammarCompiler
from tokenmill.engine.sample.grammar_process import CompileLimits
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.engine.spec import build_speculator
from tokenmill.engine.spec.draft_model import (
    BLOCK_TOKENS,
    DraftModelProposer,
    check_draft_model,
    draft_kv_bytes_per_token,
    draft_working_bytes,
)
from tokenmill.engine.spec.grammar_drafts import GrammarForcedProposer

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineParts:
    """Everything ``Engine`` is made of, built from a config."""

    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Any
    limits: ModelLimits
    # Structured output, shared by the engine (admission) and the sampler; None: a model without a
    # tokenizer (structured requests are refused).
    grammars: GrammarCompiler | None
    fleet: FleetCache | None = None  # prompt blocks shared through the fleet's store ([engine.fleet_cache])


def build_engine_parts(config: EngineConfig, clock: Clock, fleet_io_for: FleetIOFactory | None = None) -> EngineParts:
    """Load the model, size the KV cache and wire the parts.

    Args:
        config: the engine's settings.
        clock: the engine's clock.
        fleet_io_for: the fleet's store for a namespace, reached off the engine thread (the worker's Redis, on
            the worker's threads); needed with ``[engine.fleet_cache] enabled``.

    Raises:
        ModelLoadError: the model cannot be found, is not a decoder-only model, or does not split over
            ``tensor_parallel_size`` ranks (or a follower rank failed to load it).
        EngineError: the KV budget holds not a single block, or a setting does not go with tensor parallelism.
    """
    leader = _start_tensor_parallel(config)
    try:
        return _build_parts(config, clock, fleet_io_for, leader)
    except BaseException:
        if leader is not None:
            leader.close()
        raise


def _build_parts(config: EngineConfig, clock: Clock, fleet_io_for: FleetIOFactory | None,
                 leader: TensorParallelLeader | None) -> EngineParts:
    """:func:`build_engine_parts`; ``leader``: the tensor-parallel followers, started (None: no tensor parallelism)."""
    model_config = config.model
    _prebuild_cpu_extensions(config)
    loaded = load_engine_model(config, leader.shard if leader is not None else None)
    if leader is not None:
        leader.connect(loaded.device)
    # NOTE: the draft model loads before the KV pool is sized: its weights are in use when free memory is read,
    # and its cache is sized with the pool, out of the same budget
    draft = load_draft_model(config, loaded)
    spec = kv_cache_spec(loaded, config.cache.block_size)
    backend = select_backend(config.execution.attention_backend, loaded.device)
    logger.info("attention backend: %s", backend.name)
    profiles: list[StepProfile] = []
    if loaded.device.type == "cuda" and config.cache.kv_cache_bytes is None:
        captures = captures_decode_steps(config, loaded.device, backend)
        verification = largest_verification(config.scheduler.max_num_seqs, num_verified_drafts(config)) \
            if captures and leader is None else None  # NOTE: tensor parallelism captures no graphs
        profiles = profile_steps(loaded, spec, backend, config.scheduler, with_decode_bucket=captures,
                                 measure=cuda_peak_bytes(loaded.device), verification=verification)
        gc.collect()  # NOTE: the profile's pool and activations go back to the device before free memory is read
        torch.cuda.empty_cache()
    draft_token_bytes, draft_reserved_bytes = draft_memory(draft, config.scheduler.max_num_seqs)
    num_gpu_blocks, num_cpu_blocks = size_kv_cache(config.cache, spec, loaded.device, profiles,
                                                   draft_token_bytes, draft_reserved_bytes)
    if leader is not None:
        leader.share_cache(num_gpu_blocks, num_cpu_blocks, backend.name)
    kv_cache = KVCache(spec, num_gpu_blocks, num_cpu_blocks, loaded.device)
    prefix_cache = PrefixCache(spec.block_size) if config.cache.enable_prefix_caching else None
    block_manager = BlockManager(num_gpu_blocks, num_cpu_blocks, spec.block_size, prefix_cache)
    fleet = _fleet_cache(config, loaded, spec, kv_cache, block_manager, prefix_cache, fleet_io_for)
    grammars = None if isinstance(loaded.tokenizer, NoTokenizer) else \
        GrammarCompiler(loaded.tokenizer, loaded.model.config.vocab_size, loaded.eos_token_ids,
                        limits=_compile_limits(config))
    draft_proposer = None if draft is None else \
        DraftModelProposer(draft, loaded, kv_cache_spec(draft, BLOCK_TOKENS), num_gpu_blocks * spec.block_size)
    speculator = build_speculator(config.speculative, draft_proposer,
                                  GrammarForcedProposer(grammars) if grammars is not None else None)
    publishes: PromptBlockCollection = "none" if fleet is None else \
        "computed" if config.fleet_cache.publish == "all" else "reused"
    scheduler = Scheduler(config.scheduler, block_manager, clock, loaded.eos_token_ids, loaded.max_model_len,
                          prefix_cache, speculator, build_length_predictor(config.length),
                          collects_prompt_blocks=publishes)
    max_request_tokens = min(loaded.max_model_len, num_gpu_blocks * spec.block_size)
    limits = ModelLimits(model_name=model_config.name, source=loaded.source, vocab_size=loaded.model.config.vocab_size,
                         max_request_tokens=max_request_tokens,
                         is_cache_bound=max_request_tokens < loaded.max_model_len,
                         kv_block_bytes=spec.bytes_per_block * model_config.tensor_parallel_size)
    logger.info(
        "engine ready: model=%s device=%s dtype=%s kv_blocks=%d (+%d host) block_size=%d max_model_len=%d",
        model_config.name, loaded.device, loaded.dtype, num_gpu_blocks, num_cpu_blocks, spec.block_size,
        loaded.max_model_len,
    )
    reference = ModelRunner(loaded, kv_cache, Sampler(grammars), backend, tensor_parallel=leader)
    runner = with_fast_paths(reference, grammars, config, max_request_tokens)
    return EngineParts(scheduler, runner, loaded.tokenizer, limits, grammars, fleet)


def _fleet_cache(config: EngineConfig, loaded: LoadedModel, spec: KVCacheSpec, kv_cache: KVCache,
                 block_manager: BlockManager, prefix_cache: PrefixCache | None,
                 fleet_io_for: FleetIOFactory | None) -> FleetCache | None:
    """The fleet cache with ``[engine.fleet_cache] enabled`` (and prefix caching, whose index it joins), its
    store under this model's namespace; else None.

    Raises:
        EngineError: it is enabled and no store was given.
    """
    if not config.fleet_cache.enabled or prefix_cache is None:
        return None
    if fleet_io_for is None:
        raise EngineError("[engine.fleet_cache] enabled needs the fleet's block store: run the engine in a "
                          "worker (its Redis holds the blocks)")
    assert loaded.weights_fingerprint is not None, "load_engine_model fingerprints them with the fleet cache on"
    root = namespace(loaded.model.config.model_type, loaded.weights_fingerprint,
                     tokenizer_fingerprint(loaded.tokenizer), str(loaded.dtype), spec.block_size,
                     (spec.num_layers, spec.num_kv_heads, spec.head_dim))
    logger.info("fleet cache on: namespace %s, publishing %s prompt blocks", root.hex(), config.fleet_cache.publish)
    cost = TransferCost(spec.bytes_per_block, spec.block_size)
    io = fleet_io_for(root, FetchRules(cost, spec.bytes_per_block, kv_cache.check_blocks))
    return FleetCache(config.fleet_cache, io, root, kv_cache, cost, block_manager, prefix_cache)


def load_engine_model(config: EngineConfig, shard: Shard | None = None) -> LoadedModel:
    """The engine's model as ``config`` asks, with its CPU threads set; the same on every tensor-parallel rank,
    each passing its ``shard`` (None: the whole model). Its weights are fingerprinted when the fleet cache is on
    (the namespace of its blocks)."""
    model_config = config.model
    threads = threads_per_rank(model_config)
    if threads:
        torch.set_num_threads(threads)
    return load_model(model_config.name, device=model_config.device, dtype=model_config.dtype,
                      attn_implementation=register(), max_model_len=model_config.max_model_len,
                      cache_dir=model_config.cache_dir, random_init=model_config.random_init,
                      linear_kernel=config.execution.linear_kernel, shard=shard,
                      fingerprint_weights=config.fleet_cache.enabled)


def threads_per_rank(config: ModelConfig) -> int | None:
    """CPU threads of one rank: ``num_threads``; unset with tensor parallelism on the CPU, this process's cores
    shared out between the ranks (torch's default would give each rank every core); else None (torch's default)."""
    if config.num_threads or config.tensor_parallel_size == 1 or config.device == "cuda" or \
            (config.device == "auto" and torch.cuda.is_available()):
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def _start_tensor_parallel(config: EngineConfig) -> TensorParallelLeader | None:
    """Check that the settings go with ``tensor_parallel_size`` and start the followers (None: size 1).

    Raises:
        ModelLoadError: on CUDA, fewer visible GPUs than ranks.
        EngineError: the fleet cache is on, or the CUDA KV pool is left to the memory profile.
    """
    size = config.model.tensor_parallel_size
    if size == 1:
        return None
    if config.fleet_cache.enabled:
        raise EngineError(f"tensor_parallel_size = {size}: [engine.fleet_cache] is not supported with tensor "
                          "parallelism (each rank holds a slice of every block); turn one of them off")
    if resolve_device(config.model.device).type == "cuda":
        found = torch.cuda.device_count()
        if size > found:
            raise ModelLoadError(f"tensor_parallel_size = {size} needs one GPU per rank, but torch sees {found} "
                                 "(CUDA_VISIBLE_DEVICES?)")
        if config.cache.kv_cache_bytes is None:
            raise EngineError(f"tensor_parallel_size = {size} on CUDA: set [engine.cache] kv_cache_memory (per rank); "
                              "the memory profile that sizes the pool otherwise runs one rank's forward alone")
    return TensorParallelLeader(config)


def with_fast_paths(reference: ModelRunner, grammars: GrammarCompiler | None, config: EngineConfig,
                    max_request_tokens: int) -> ModelRunner:
    """The engine's runner: the reference runner's parts with the fast paths ``[engine.execution]``
    allows and this machine supports, each checked against (or captured from) the reference's eager
    forward; the reference itself when there are none. Logs the choice once."""
    decoder, static = None, None
    if config.execution.decode_fast_path == "auto" and reference.device.type == "cpu":
        decoder = native_decoder.native_decoder_for(reference)
    elif captures_decode_steps(config, reference.device, reference.backend):
        if reference.tensor_parallel is not None:  # NOTE: a captured step would need its all-reduces captured too
            logger.info("tensor parallelism: no CUDA graphs (each step runs eagerly, with NCCL's all-reduces)")
        else:
            static = capture_decode_steps(reference, config.scheduler.max_num_seqs, max_request_tokens,
                                          num_verified_drafts(config))
    # NOTE: the linear layers' packing is chosen (and logged) as the model loads: engine/kernels/cpu_linear.py.
    logger.info("fast paths: forward=%s, decode steps=%s, attention=%s",
                "native C++ decoder stack" if decoder is not None else "eager",
                "CUDA graphs" if static is not None else "as any step", reference.backend.name)
    if decoder is None and static is None:
        return reference
    sampler = Sampler(grammars, argmax=native_decoder.greedy_token_ids if decoder is not None else None)
    return ModelRunner(reference.loaded, reference.kv_cache, sampler, reference.backend,
                       native_decoder=decoder, static_decode=static, tensor_parallel=reference.tensor_parallel)


def load_draft_model(config: EngineConfig, loaded: LoadedModel) -> LoadedModel | None:
    """The draft model when ``[engine.speculative] method = "draft"`` (else None), on the engine's device: load
    it before the KV pool is sized (:func:`size_kv_cache` counts its cache; on CUDA, free memory its weights).

    Raises:
        ModelLoadError: it cannot be loaded, or does not share the tokenizer of ``loaded``.
    """
    spec = config.speculative
    if spec.method != "draft" or not spec.draft_model:
        return None
    draft = load_model(spec.draft_model, device=config.model.device, dtype=config.model.dtype,
                       attn_implementation="sdpa", cache_dir=config.model.cache_dir)
    check_draft_model(draft, loaded)
    return draft


def draft_memory(draft: LoadedModel | None, max_num_seqs: int) -> tuple[int, int]:
    """What a draft model needs of the KV budget: its keys and values per token (its cache holds as many
    tokens as the engine's pool), and the bytes its batched forwards (of up to ``max_num_seqs`` requests) need
    beside them; (0, 0) without one."""
    if draft is None:
        return 0, 0
    spec, config = kv_cache_spec(draft, BLOCK_TOKENS), draft.model.config
    return draft_kv_bytes_per_token(spec), draft_working_bytes(spec, config.num_attention_heads, config.vocab_size,
                                                               max_num_seqs)


def captures_decode_steps(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> bool:
    """Whether decode steps are captured in CUDA graphs: on CUDA with ``decode_fast_path = "auto"`` and a
    kernel backend (the reference plans on the host per step)."""
    return config.execution.decode_fast_path == "auto" and device.type == "cuda" and backend.name != "reference"


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
    if config.execution.decode_fast_path == "auto":
        native_decoder.build_in_background()
    cpu_linear.prebuild_kernel_for(resolve_dtype(config.model.dtype, device), config.execution.linear_kernel)


def num_verified_drafts(config: EngineConfig) -> int:
    """The most draft tokens a verification step runs per request (0: no speculation, none captured)."""
    return config.speculative.num_speculative_tokens if config.speculative.method != "off" else 0


def capture_decode_steps(runner: ModelRunner, max_num_seqs: int, max_request_tokens: int,
                         num_speculative_tokens: int) -> StaticDecode:
    """Capture decode steps in CUDA graphs, one per batch bucket, and with speculation verification steps, one per
    bucket and query length (where :func:`captures_decode_steps`): a step with drafts replays a graph too.

    NOTE: the CPU's counterpart is engine/model/native_decoder (every step, no buckets). Inductor was
    tried there first: a long compile per bucket bought modestly faster steps, and with dynamic
    shapes its outputs drifted from eager.
    """
    block_size = runner.block_size
    static = StaticDecode(runner.forward, runner.kv_cache, runner.backend, decode_buckets(max_num_seqs),
                          max_blocks_per_seq=(max_request_tokens + block_size - 1) // block_size,
                          query_lens=[1, *verify_query_lens(num_speculative_tokens)])
    static.prepare_runners(cuda_graph_runner(torch.cuda.graph_pool_handle()), "capturing CUDA graphs")
    return static


def kv_cache_spec(loaded: LoadedModel, block_size: int) -> KVCacheSpec:
    """The shape of one KV block of this model (of its shard's KV heads, with tensor parallelism)."""
    model_config = loaded.model.config
    num_heads = model_config.num_attention_heads
    return KVCacheSpec(
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=loaded.shard.num_kv_heads if loaded.shard is not None else
        getattr(model_config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(model_config, "head_dim", None) or model_config.hidden_size // num_heads,
        block_size=block_size,
        dtype=loaded.dtype,
    )


def size_kv_cache(config: CacheConfig, spec: KVCacheSpec, device: torch.device,
                  profiles: list[StepProfile] | None = None, draft_token_bytes: int = 0,
                  reserved_bytes: int = 0) -> tuple[int, int]:
    """Number of device and host blocks.

    The KV budget is ``kv_cache_memory`` when given; otherwise on CUDA a
    ``gpu_memory_utilization`` fraction of the device's total memory, less what is in use (the weights, a
    draft model's included), what the profiled steps need beside the pool and ``reserved_bytes``
    (:func:`engine.model.memory_profile.kv_pool_bytes`); on CPU 1 GiB. With a draft model
    (``draft_token_bytes``: its keys and values per token) the budget holds both models' caches token for
    token, as one pool of both models' layers would: the engine's pool gets ``budget x its bytes per token /
    (its + the draft's)``, and the draft model's cache as many tokens.

    Raises:
        EngineError: the budget does not hold a single block.
    """
    device_bytes = config.kv_cache_bytes
    if device_bytes is None:
        if device.type == "cuda":
            free_bytes, total_bytes = torch.cuda.mem_get_info(device)
            device_bytes = kv_pool_bytes(free_bytes, total_bytes, config.gpu_memory_utilization, profiles or [],
                                         reserved_bytes)
        else:
            device_bytes = DEFAULT_CPU_KV_BYTES
    block_bytes = spec.bytes_per_block + spec.block_size * draft_token_bytes
    num_gpu_blocks = max(0, device_bytes) // block_bytes
    if num_gpu_blocks < 1:
        steps = sum(p.peak_bytes for p in profiles or [])
        draft = " with the draft model's cache of its tokens" if draft_token_bytes else ""
        raise EngineError(
            f"the KV cache budget ({device_bytes} bytes; the largest steps need {steps} bytes beside it) holds no "
            f"block of {block_bytes} bytes{draft}; raise kv_cache_memory or gpu_memory_utilization, or lower "
            "max_num_batched_tokens / max_num_seqs"
        )
    if draft_token_bytes:
        logger.info("draft model's cache: %d tokens (%.1f MiB) beside the KV pool, out of the same budget",
                    num_gpu_blocks * spec.block_size, num_gpu_blocks * spec.block_size * draft_token_bytes / 2**20)
    num_cpu_blocks = spec.num_blocks_for(config.swap_space_bytes)
    logger.info(
        "KV cache: %d device blocks (%.1f MiB), %d host blocks (%.1f MiB), %d tokens per block",
        num_gpu_blocks, num_gpu_blocks * spec.bytes_per_block / 2**20,
        num_cpu_blocks, num_cpu_blocks * spec.bytes_per_block / 2**20, spec.block_size,
    )
    return num_gpu_blocks, num_cpu_blocks


def _compile_limits(config: EngineConfig) -> CompileLimits | None:
    """Where grammars compile: in a child process under the configured limits, or (off) in-thread."""
    structured = config.structured_output
    if not structured.isolate_compiles:
        return None
    return CompileLimits(structured.compile_timeout_s, structured.compile_memory_bytes)
