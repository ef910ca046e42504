"""The continuous-batching engine: admit requests, then step = schedule, run, postprocess.

Knows nothing of Redis, Celery or wire schemas: inputs are prompts and SamplingParams,
outputs are RequestOutputs.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.block_manager import BlockManager
from engine.clock import Clock, MonotonicClock
from engine.config import CacheConfig, EngineConfig
from engine.engine_sizing import size_kv_cache
from engine.kv_cache import KVCache, KVCacheSpec
from engine.model_loader import load_model
from engine.model_runner import ModelRunner
from engine.offline import GenerationOutput, run_offline
from engine.outputs import RequestOutput
from engine.paged_attention import register
from engine.postprocess import OutputProcessor
from engine.prompts import Prompt, PromptError, tokenize_prompt
from engine.request import Request, RequestStatus
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching over a paged KV cache for any Hugging Face decoder model.

    Args:
        config: model, device, cache sizes and scheduling policy.
        clock: time source for arrival/queue/TTFT metrics and aging (default: monotonic).
    """

    def __init__(self, config: EngineConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.loaded = load_model(
            config.model,
            device=config.device,
            dtype=config.dtype,
            attn_implementation=register(),
            max_model_len=config.max_model_len,
            cache_dir=config.cache_dir,
        )
        self.tokenizer = self.loaded.tokenizer
        # NOTE: tokenize() may run on another thread while step() detokenizes: a Hugging Face fast
        # tokenizer must not be used by two threads at once ("Already borrowed"), so prompts get
        # their own copy.
        self._prompt_tokenizer = copy.deepcopy(self.tokenizer)
        self._tokenize_lock = threading.Lock()
        self.max_model_len = self.loaded.max_model_len
        model_config = self.loaded.model.config
        num_heads = model_config.num_attention_heads
        self.kv_spec = KVCacheSpec(
            num_layers=model_config.num_hidden_layers,
            num_kv_heads=getattr(model_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(model_config, "head_dim", None) or model_config.hidden_size // num_heads,
            block_size=config.block_size,
            dtype=self.loaded.dtype,
        )
        self.cache_config: CacheConfig = size_kv_cache(config, self.kv_spec, self.loaded.device)
        self.kv_cache = KVCache(
            self.kv_spec, self.cache_config.num_gpu_blocks, self.cache_config.num_cpu_blocks, self.loaded.device
        )
        self.block_manager = BlockManager(
            self.cache_config.num_gpu_blocks, self.cache_config.num_cpu_blocks, config.block_size
        )
        self.scheduler = Scheduler(config.scheduler_config, self.block_manager, self.clock)
        self.runner = ModelRunner(self.loaded, self.kv_cache, Sampler())
        self.processor = OutputProcessor(self.tokenizer, self.loaded.eos_token_ids, self.max_model_len, self.clock)
        self.requests: dict[str, Request] = {}
        self._num_steps = 0
        self._num_generated_tokens = 0
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv_blocks=%d (+%d host) block_size=%d max_model_len=%d",
            config.model, self.loaded.device, self.loaded.dtype, self.cache_config.num_gpu_blocks,
            self.cache_config.num_cpu_blocks, config.block_size, self.max_model_len,
        )

    @property
    def model_name(self) -> str:
        """The model as configured (alias, id or path)."""
        return self.config.model

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + output tokens one request may hold: the model context or the whole cache."""
        return min(self.max_model_len, self.cache_config.num_gpu_blocks * self.cache_config.block_size)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; chat messages go through the model's chat template.

        Thread-safe, and meant to run off the engine thread: a long prompt then never stalls a
        step (the tokenizer releases the GIL). ``add_request`` of the ids skips this work.

        Raises:
            PromptError: empty or malformed prompt, or no chat template.
        """
        with self._tokenize_lock:
            return tokenize_prompt(self._prompt_tokenizer, prompt)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Per-request problems never raise: they finish the request with an
        ``error`` output on the next :meth:`step`.

        Args:
            request_id: unique among live requests.
            prompt: text, token ids, or chat messages (``[{"role": ..., "content": ...}]``).
            params: sampling parameters (default: greedy, 256 tokens).
            priority: lower is more urgent.
            arrival_time: engine-clock time it arrived (default: now).

        Raises:
            ValueError: ``request_id`` is already live.
        """
        if request_id in self.requests or self.processor.has_pending(request_id):
            raise ValueError(f"request {request_id!r} is already in the engine")
        params = params or SamplingParams()
        arrival = self.clock.now() if arrival_time is None else arrival_time
        try:
            prompt_token_ids = tokenize_prompt(self.tokenizer, prompt)
            self._check_fits(prompt_token_ids, params)
        except PromptError as exc:
            self.processor.reject(request_id, exc.code, str(exc), arrival, num_prompt_tokens=exc.num_prompt_tokens)
            return
        request = Request(request_id, prompt_token_ids, params, arrival_time_s=arrival, priority=priority)
        self.requests[request_id] = request
        self.processor.track(request)
        self.scheduler.add_request(request)

    def _check_fits(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab_size = self.loaded.model.config.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise PromptError("validation", f"prompt token ids must be in [0, {vocab_size})")
        needed = len(prompt_token_ids) + params.max_tokens
        if needed > self.max_request_tokens:
            limit = "the model context" if self.max_model_len <= self.max_request_tokens else "the KV cache"
            raise PromptError(
                "prompt_too_long",
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {needed} "
                f"exceeds {limit} ({self.max_request_tokens} tokens)",
                num_prompt_tokens=len(prompt_token_ids),
            )

    def abort(self, request_id: str) -> None:
        """Stop a request; the next :meth:`step` reports it finished with reason ``abort``.
        Unknown or already finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self.processor.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self.processor.has_any_pending()

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration and one model forward.

        Returns:
            An output for every request that progressed or finished in this step.
        """
        scheduler_output = self.scheduler.schedule()
        model_output = self.runner.execute(scheduler_output, self.requests)
        progressed = self.scheduler.update(scheduler_output, model_output)
        self._num_steps += 1
        self._num_generated_tokens += sum(len(t) for t in model_output.sampled_token_ids.values())
        for request_id in scheduler_output.finished_request_ids:
            # The scheduler finishes requests on its own only when they can never run.
            finished = self.requests.get(request_id)
            if finished is not None and finished.is_finished:
                self.processor.finish(finished, finished.status)
        for request in progressed:
            status = self.processor.process_new_tokens(request, model_output.logprobs.get(request.request_id))
            if status is not None:
                self.scheduler.finish_request(request.request_id, status)
                self.processor.finish(request, status)
        outputs = self.processor.drain()
        for output in outputs:
            if output.finished:
                self.requests.pop(output.request_id, None)
        return outputs

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = True,
        priorities: Sequence[int] | None = None,
    ) -> list[GenerationOutput]:
        """Offline convenience: run prompts to completion.

        Returns:
            Final outputs in input order.
        """
        return run_offline(self, prompts, params, progress=progress, priorities=priorities)

    def stats(self) -> dict[str, Any]:
        """Scheduler counters, KV usage (blocks, fraction, swap bytes) and totals."""
        stats = dict(self.scheduler.stats())
        bytes_per_block = self.kv_spec.bytes_per_block
        stats.update(
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated_tokens,
            kv_block_bytes=bytes_per_block,
            kv_device_blocks_total=self.cache_config.num_gpu_blocks,
            kv_host_blocks_total=self.cache_config.num_cpu_blocks,
        )
        for direction in ("out", "in"):
            blocks = stats.get(f"num_swapped_{direction}_blocks", 0)
            stats[f"swap_{direction}_bytes"] = blocks * bytes_per_block
        return stats
