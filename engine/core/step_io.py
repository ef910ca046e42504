"""Plain dataclasses where "decide" (scheduler) and "execute" (model runner) meet, and what
the engine hands back to callers. Standard library and pydantic only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from protocol.outcomes import TokenLogprob
from protocol.outcomes import ErrorCode, FinishReason
from protocol.sampling import SamplingParams
from engine.sampling_state import SamplingState


@dataclass
class ScheduledChunk:
    """Tokens of one request to run through the model this step.

    The runner writes their KV at positions ``start_position .. start_position + len(token_ids) - 1``
    into the device blocks ``block_ids`` (the request's whole block table) and, if
    ``needs_sample``, samples the request's next token from the logits of the last one, with
    ``sampling_params``: everything the runner needs is here, it reads no request table.
    """

    request_id: str
    token_ids: list[int]  # the tokens to compute (a prefill chunk, or the newest token when decoding)
    start_position: int  # position of token_ids[0] in the sequence == num_computed_tokens before the step
    block_ids: list[int]  # device block table; covers start_position + len(token_ids) tokens
    needs_sample: bool  # True when this chunk reaches the end of the known tokens
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated so far == index of the token to sample (min_tokens, seeds)
    sampling_state: SamplingState | None = None  # the request's penalty / grammar state (the sampler's)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What one engine step does. The runner executes swap_out, copy_blocks, swap_in, then the forward."""

    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device_block_id, host_block_id) copies
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host_block_id, device_block_id) copies
    # (source, destination) device-block copies: a shared block a request is about to write into
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)  # lost their device blocks this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class ModelOutput:
    """What the runner returns: one sampled token per chunk that asked for one."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request_id -> new tokens
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # request_id -> top logprobs per token


class StepRunner(Protocol):
    """Executes one step: the real ``ModelRunner``, or a scripted one in tests."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput: ...


@dataclass
class RequestMetrics:
    """Timings of one request, in clock seconds (the engine's clock)."""

    arrival_time_s: float
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    finished_time_s: float | None = None
    num_preemptions: int = 0
    num_output_tokens: int = 0

    @property
    def queue_s(self) -> float | None:
        if self.first_scheduled_time_s is None:
            return None
        return self.first_scheduled_time_s - self.arrival_time_s

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time_s is None:
            return None
        return self.first_token_time_s - self.arrival_time_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finished_time_s is None or self.first_token_time_s is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time_s - self.first_token_time_s) / (self.num_output_tokens - 1)

    @property
    def total_s(self) -> float | None:
        if self.finished_time_s is None:
            return None
        return self.finished_time_s - self.arrival_time_s


@dataclass
class SampleOutput:
    """One sample of an n > 1 request, once finished."""

    index: int  # 0 .. n-1
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[dict[int, float]] | None = None
    token_logprobs: list[TokenLogprob] | None = None  # OpenAI's shape, when logprobs were asked for


@dataclass
class RequestOutput:
    """One request's progress in one engine step (streaming) or its final state."""

    request_id: str
    new_token_ids: list[int]  # tokens generated this step
    text_delta: str  # text that became final this step (held back while a stop string may be forming)
    token_ids: list[int]  # all generated tokens so far
    text: str  # all generated text so far (stop string cut)
    finished: bool
    finish_reason: FinishReason | None  # set once finished
    prompt_token_count: int
    metrics: RequestMetrics
    error: str | None = None  # human-readable reason when finish_reason is ERROR
    error_code: ErrorCode | None = None  # machine-readable, when finish_reason is ERROR
    logprobs: list[dict[int, float]] | None = None  # raw: per token, {token_id: logprob} (sampled first)
    token_logprobs: list[TokenLogprob] | None = None  # OpenAI's shape; on final outputs that asked for logprobs
    # n > 1: every sample, by index (the fields above are sample 0's); only final outputs carry them
    samples: list[SampleOutput] | None = None
