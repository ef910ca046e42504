"""Typed, validated engine configuration (pydantic only, no torch).

``EngineConfig`` nests one section per part (``model``, ``cache``, ``scheduler``); each part
receives its own plain section, so tests build those inline.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

logger = logging.getLogger(__name__)

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | str) -> int:
    """Parse a size such as ``"2GiB"``, ``"512MB"`` or ``1048576`` into bytes.

    Raises:
        ValueError: the text is not a size.
    """
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a size must be >= 0")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. '512MiB', '2GiB', '4GB' or a byte count)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def _checked_size(value: int | str) -> int | str:
    parse_bytes(value)
    return value


# A size setting: bytes or a text such as "2GiB", kept as given and checked at load (its section's property
# holds the bytes).
ByteSize = Annotated[int | str, AfterValidator(_checked_size)]


class _Frozen(BaseModel):
    """A settings section: unknown keys refused (with the nearest name, by the loaders), values frozen; keys renamed
    in ``_renamed`` (old -> new) still accepted for one release, with a warning naming the new key."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    _renamed: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _accept_renamed(cls, data: Any) -> Any:
        return accept_renamed(cls.__name__, cls._renamed, data)


def accept_renamed(section: str, renamed: dict[str, str], data: Any) -> Any:
    """``data`` with each old key of ``renamed`` moved to its new name, warning once per use (a key given under both
    names keeps the new one's value)."""
    if not renamed or not isinstance(data, dict) or not renamed.keys() & data.keys():
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old in data:
            value = data.pop(old)
            message = f"{section}: {old!r} is now {new!r}; the old name is accepted until the next release"
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            logger.warning(message, extra={"event": "renamed_setting", "old": old, "new": new})
            data.setdefault(new, value)
    return data


class SchedulerConfig(_Frozen):
    """Per-step budgets and the priority / starvation / preemption policy."""

    _renamed: ClassVar[dict[str, str]] = {"max_consecutive_decode_steps": "demote_after_decode_steps"}

    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens per step, prefill and decode together")
    max_num_seqs: int = Field(64, ge=1, description="requests running at once")
    max_prefill_chunk: int = Field(512, ge=1, description="most prompt tokens of one request per step")
    max_prefill_tokens: int | None = Field(
        None, ge=1, description="prefill tokens per step (all requests); None = the total budget"
    )
    max_decode_tokens: int | None = Field(
        None, ge=1, description="decode tokens per step, their draft tokens included (all requests): a step full of "
        "drafting decodes still leaves arrivals the rest for their prefill; None = the total budget"
    )
    aging_interval_s: float = Field(
        30.0, ge=0.0, description="each interval waited improves priority by one level, so no lane starves; 0 = off"
    )
    demote_after_decode_steps: int = Field(
        2048, ge=0, description="long-output limit: decode steps while others wait before a request may be "
        "demoted (swapped out, resumed later); 0 = off (was max_consecutive_decode_steps)"
    )
    min_resident_steps: int = Field(4, ge=0, description="a resumed request is not preempted again for this many steps")
    preemption_mode: Literal["swap", "recompute"] = "swap"
    enable_priority_preemption: bool = Field(
        True, description="an urgent waiting request may preempt a less urgent one")
    watermark_blocks: int = Field(0, ge=0, description="device blocks kept free at admission to spare decodes")

    @model_validator(mode="after")
    def _check_budgets(self) -> SchedulerConfig:
        if self.max_prefill_chunk > self.max_num_batched_tokens:
            raise ValueError("max_prefill_chunk must not exceed max_num_batched_tokens")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens > self.max_num_batched_tokens:
            raise ValueError("max_prefill_tokens must not exceed max_num_batched_tokens")
        if self.max_decode_tokens is not None and self.max_decode_tokens > self.max_num_batched_tokens:
            raise ValueError("max_decode_tokens must not exceed max_num_batched_tokens")
        return self

    @property
    def prefill_token_budget(self) -> int:
        return self.max_prefill_tokens or self.max_num_batched_tokens

    @property
    def decode_token_budget(self) -> int:
        return self.max_decode_tokens or self.max_num_batched_tokens


Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "float16", "bfloat16", "float64"]


class ModelConfig(_Frozen):
    """Which model, on which device, in which dtype."""

    name: str = Field("smollm2-135m", min_length=1,
                      description="alias, Hugging Face id, local directory, .gguf file, or echo (no model)")
    device: Device = "auto"
    dtype: DType = Field("auto", description="auto: float32 on CPU, bfloat16 on CUDA")
    max_model_len: int | None = Field(None, ge=1, description="cap on prompt + output tokens; None: the model's")
    cache_dir: str | None = Field(None, description="where dequantized GGUF weights are cached")
    num_threads: int | None = Field(None, ge=1, description="CPU threads for torch; None: leave torch's default")
    random_init: bool = Field(
        False, description="build the model from name's config.json (a directory holding one, or the .json file) with "
        "random weights, no checkpoint (for measuring speed at any shape); without tokenizer files beside it, "
        "prompts must be token ids"
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="processes the model is sharded over (Megatron-style tensor parallelism, "
        "engine/model/tensor_parallel.py): each holds 1/N of every layer's attention heads, KV heads and MLP, and "
        "its own KV pool; the engine's process is rank 0 and starts N - 1 followers. num_attention_heads and "
        "intermediate_size must divide by N; on CUDA one visible GPU per rank; on CPU num_threads and the cache "
        "sizes count per rank. 1: no sharding"
    )
    tensor_parallel_cpu_all_reduce: Literal["shared_memory", "gloo"] = Field(
        "shared_memory", description="how CPU ranks sum their partial outputs (two all-reduces per decoder layer): "
        "shared_memory: through a segment in /dev/shm (microseconds; gloo when there is none); gloo: over loopback "
        "TCP (about a millisecond each), the plain reference path. CUDA ranks use NCCL"
    )

    @model_validator(mode="after")
    def _check_random_init(self) -> ModelConfig:
        if self.random_init and (self.name == "echo" or self.name.startswith("echo:") or self.name.endswith(".gguf")):
            raise ValueError("random_init builds a model from a config.json: name must be a directory holding one "
                             f"or a .json file, not {self.name!r}")
        return self

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> ModelConfig:
        if self.tensor_parallel_size > 1 and (self.name == "echo" or self.name.startswith("echo:")):
            raise ValueError(f"tensor_parallel_size = {self.tensor_parallel_size}: the echo model has no weights to "
                             "shard; use tensor_parallel_size = 1")
        return self


class CacheConfig(_Frozen):
    """The paged KV cache: block size and the memory of its two pools. Sizes take bytes or "2GiB"."""

    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    kv_cache_memory: ByteSize | None = Field(
        None, description="device KV pool size; None: 1GiB on CPU, gpu_memory_utilization on CUDA"
    )
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=0.99, description="CUDA: fraction of the device's total "
                                          "memory (as vLLM reads it) for the weights, the KV pool, the largest steps' "
                                          "activations and the captured graphs; memory in use by others counts too")
    swap_space: ByteSize = Field("1GiB", description="host KV pool for swapped-out requests")
    enable_prefix_caching: bool = Field(
        True, description="requests reuse the KV blocks of prompt prefixes computed before (shared system prompts)"
    )

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_memory is None else parse_bytes(self.kv_cache_memory)

    @property
    def swap_space_bytes(self) -> int:
        return parse_bytes(self.swap_space)


class ExecutionConfig(_Frozen):
    """How a step executes: the attention backend, the CPU's linear-layer kernel, and whether decode steps take
    the fast path (captured / native). Each fast path keeps its reference beside it (``reference``, ``off``)."""

    _renamed: ClassVar[dict[str, str]] = {"compile": "decode_fast_path"}

    attention_backend: Literal["auto", "reference", "cpu", "triton"] = Field(
        "auto", description="auto: the device's kernel (cpu: C++, cuda: Triton), else reference (gather + SDPA)"
    )
    decode_fast_path: Literal["auto", "off"] = Field(
        "auto", description="auto: decode steps through the fast path (CUDA: captured in CUDA graphs; CPU: "
        "Llama-family decoder layers in one C++ call); off: eager Hugging Face modules, the reference (was compile)"
    )
    linear_kernel: Literal["auto", "onednn", "panels", "off"] = Field(
        "auto", description="CPU linear layers, packed once at load: auto: the faster kernel for this CPU and dtype "
        "(engine/kernels/cpu_linear.py); onednn: torch's oneDNN; panels: the engine's C++ panel kernel; off: plain "
        "nn.Linear"
    )
    overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="run a step's forward on a device thread while the engine plans the next step "
        "(async scheduling: its input token is filled in from this step's) and makes the previous step's outputs "
        "(detokenize, stop strings, output objects); outputs then come one step later. auto: on for CUDA (the host "
        "work hides behind the device's), off on the CPU, where the forward's threads need both cores (measured: "
        "ops/bench/overhead.py and docs/design.md); off: the synchronous loop (the reference)"
    )


class SpeculativeConfig(_Frozen):
    """Speculative decoding inside the step's token budget (engine/spec/): draft tokens for decoding
    requests, verified in one forward; the output is the same as without (greedy float32: token for
    token; sampled: the same distribution)."""

    method: Literal["off", "ngram", "suffix", "draft", "auto"] = Field(
        "auto", description="off; ngram: the request's own prompt and output (prompt lookup); suffix: a pool of "
        "continuations of earlier outputs of this engine; draft: a smaller model (draft_model); auto: the tokens a "
        "structured request's grammar forces, then ngram, then suffix")
    num_speculative_tokens: int = Field(10, ge=1, le=32, description="most draft tokens per request per step (the "
                                        "goodput rule runs fewer where they do not pay)")
    ngram_min: int = Field(1, ge=1, le=16, description="shortest suffix n-gram the lookup matches; 1: where no match "
                           "of 2 or more tokens is found (the request's own tokens, then the suffix pool), the "
                           "latest occurrence of the last token alone drafts, a weaker guess with its own acceptance")
    ngram_max: int = Field(5, ge=1, le=16, description="longest suffix n-gram the lookup matches")
    ngram_index: Literal["auto", "python"] = Field(
        "auto", description="where the n-gram lookup runs: auto: in C++ (engine/spec/csrc/ngram_index.cpp, built on "
        "first use with the machine's compiler; the Python index where none is found); python: the Python index "
        "(the reference: the same drafts, at several times the host time per request)")
    suffix_pool_tokens: int = Field(1_000_000, ge=0, description="n-grams the suffix pool remembers, shared "
                                    "evenly by the n-gram lengths (oldest forgotten first)")
    draft_model: str | None = Field(None, description="method draft: a Hugging Face causal LM sharing the "
                                    "model's tokenizer (a path or a name in the cache)")
    min_acceptance: float = Field(0.2, ge=0.0, le=1.0, description="a proposer whose recent drafts for a request "
                                  "were accepted less than this stops drafting for it (a short draft now and then "
                                  "checks again)")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method 'draft' needs draft_model (a smaller model with the same tokenizer)")
        return self


class LengthConfig(_Frozen):
    """Output-length prediction (engine/core/length_predictor.py): each request's output length is predicted
    from the lengths of finished requests like it, and the scheduler budgets KV and orders admissions by it.
    Predictions never change an output, only when it is computed."""

    _renamed: ClassVar[dict[str, str]] = {"predict": "estimate", "confidence": "tail_quantile"}

    estimate: bool = Field(True, description="estimate every request's output length from finished requests' "
                           "(CPU microseconds per request): reported (stats, heartbeats, ETAs) and, when budget_kv or "
                           "ordering below say so, scheduled by; off: no estimate, those ignored (was predict)")
    budget_kv: bool = Field(False, description="admit a waiting request only while the running and swapped "
                            "requests' predicted peak KV still fits the device pool (each running for its mean "
                            "remaining length, plus a margin for the set's tail; long admissions paced, shorter work "
                            "backfilled), so the running set rarely outgrows the pool and preempts; off: admit while "
                            "the next chunk fits. Off by default: on a CPU, where a swap is a memory copy, it cost "
                            "~4% tokens/s in ops/bench/length.py for no preemptions; on where preempting is dear")
    tail_quantile: float = Field(0.9, gt=0.5, lt=1.0, description="the normal quantile of the KV budget's tail "
                                 "margin: how sure it is to cover the running set's excess over its predicted mean (a "
                                 "few of many requests run long, not all: the margin is this quantile of the set's "
                                 "summed length variance, at least the largest request's own tail past its mean at "
                                 "this quantile) (was confidence)")
    ordering: Literal["fcfs", "shortest", "longest", "auto"] = Field(
        "fcfs", description="order of waiting requests inside one priority level (aging still applies): fcfs: "
        "arrival; shortest: shortest predicted output first (lower mean completion time in a backlog); longest: "
        "longest first (a shorter makespan for one bulk job); auto: longest while every waiting request is of one "
        "job (length group), else shortest")
    min_samples: int = Field(5, ge=1, description="finished requests, longer than what the one predicted generated, "
                             "a history key needs before it predicts (fewer: a coarser key predicts); running ones "
                             "refine its estimate, and min_samples of them running past a request's age tell the "
                             "coarser keys it is longer")
    samples_per_key: int = Field(256, ge=8, description="most recent finished lengths kept per history key")
    max_keys: int = Field(4096, ge=16, description="history keys kept (least recently used forgotten first)")


class FleetCacheConfig(_Frozen):
    """KV blocks shared across the fleet (engine/core/fleet_cache.py): full prompt blocks a worker computes are
    published to a block store (the fleet's Redis), and a worker that misses locally fetches them when fetching
    beats computing them again. Greedy outputs are the same with it on or off."""

    enabled: bool = Field(False, description="publish computed prompt blocks and fetch missing ones from the fleet's "
                          "block store (the worker's Redis); off: prefix caching stays local to each worker")
    max_bytes: ByteSize = Field("4GiB", description="the store's byte cap: least recently used blocks are dropped "
                                 "past it (the queues' Redis never evicts on its own)")
    ttl_s: float = Field(3600.0, gt=0, description="a stored block is dropped this long after it was last used")
    min_blocks: int = Field(2, ge=1, description="look up only prompts with at least this many full blocks "
                            "beyond the local cache (a round trip costs more than a block or two)")
    max_wait_s: float = Field(5.0, gt=0, description="a request waits for its blocks at most this long, then "
                              "computes them (counted as a fallback)")
    publish: Literal["reused", "all"] = Field(
        "reused", description="which computed prompt blocks go to the store: reused = once a second request on "
        "this worker uses them (shared prefixes travel, unique documents never do); all = every full prompt block "
        "(a prefill worker always publishes all: its decode pool needs them)")

    @property
    def max_store_bytes(self) -> int:
        return parse_bytes(self.max_bytes)


class StructuredOutputConfig(_Frozen):
    """Limits on compiling structured-output grammars (a small spec can take minutes and gigabytes)."""

    isolate_compiles: bool = Field(
        True, description="compile each spec in a child process under the limits below; off: in the worker's "
        "preparation thread, unbounded"
    )
    compile_timeout_s: float = Field(10.0, gt=0, description="a spec still compiling after this is refused "
                                     "(validation error) and its compiler process killed")
    compile_memory: ByteSize = Field("2GiB", description="memory one compilation may use beyond the compiler "
                                      "process's own; past it the spec is refused")
    warm_at_start: bool = Field(
        True, description="a worker starts the compiler (its child process) when it starts, off the engine thread, "
        "so the first structured request waits only for its own compile; off: on the first one (saves the child's "
        "memory where none comes)"
    )

    @property
    def compile_memory_bytes(self) -> int:
        return parse_bytes(self.compile_memory)


class EngineConfig(_Frozen):
    """Everything needed to build an :class:`engine.Engine`: one section per part.

    ``model`` also takes a plain string, the model's name: ``EngineConfig(model="smollm2-135m")``.
    """

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    structured_output: StructuredOutputConfig = Field(default_factory=StructuredOutputConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    length: LengthConfig = Field(default_factory=LengthConfig)
    fleet_cache: FleetCacheConfig = Field(default_factory=FleetCacheConfig)

    @field_validator("model", mode="before")
    @classmethod
    def _model_by_name(cls, value: object) -> object:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_fleet_cache(self) -> EngineConfig:
        if self.fleet_cache.enabled and not self.cache.enable_prefix_caching:
            raise ValueError("[engine.fleet_cache] enabled needs [engine.cache] enable_prefix_caching: fetched blocks "
                             "join the local prefix cache")
        return self

    @model_validator(mode="after")
    def _check_length_ordering(self) -> EngineConfig:
        # NOTE: ordering by predicted length inside a level is starvation-free only because waiting ages a request
        # into a better level (engine/core/scheduler_policy.py); without aging a long request could wait forever.
        is_reordered = self.length.estimate and self.length.ordering != "fcfs"
        if is_reordered and self.scheduler.aging_interval_s <= 0:
            raise ValueError(f"[engine.length] ordering {self.length.ordering!r} needs aging "
                             "([engine.scheduler] aging_interval_s > 0): without it a long request could wait "
                             "forever behind shorter ones")
        return self
