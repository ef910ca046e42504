"""Plain dataclasses where "decide" (scheduler) and "execute" (model runner) meet: what one step runs
(SchedulerOutput of ScheduledChunks), what it returns (ModelOutput), and who runs it (StepRunner).
Standard library and pydantic only. What the engine hands back is engine/output/request_output.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.protocol.sampling import SamplingParams


@dataclass(slots=True)
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
    # Speculative decoding: the last this many of token_ids are draft tokens; the runner samples after
    # each of the last 1 + num_draft_tokens tokens and keeps what engine.spec.verification.accept_drafts says.
    num_draft_tokens: int = 0
    # Planned ahead (Scheduler.schedule_ahead) while the step before still ran: token_ids is one placeholder, the
    # token that step samples for this request; the engine writes it in on its device thread before the forward.
    takes_last_token: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Logits rows the runner samples for this chunk: 0 (a prefill chunk short of the end), 1, or
        one per draft token plus one."""
        return 1 + self.num_draft_tokens if self.needs_sample else 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:] if self.num_draft_tokens else []


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

    @property
    def is_decode_only(self) -> bool:
        """Whether the step runs decodes only (with or without draft tokens): no prefill chunk."""
        return bool(self.chunks) and all(c.num_sample_rows == c.num_tokens for c in self.chunks)


@dataclass
class ModelOutput:
    """What the runner returns: one sampled token per chunk that asked for one; for a chunk with draft
    tokens, the tokens it keeps (1 to num_draft_tokens + 1: the accepted drafts, then the model's own)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request_id -> new tokens
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # request_id -> top logprobs per token
    # How the step ran, each way at its own cost (the speculator's step cost model): "flat", the flattened batch;
    # "static", a static shape (engine/model/static_decode.py: a replayed CUDA graph).
    path: str = "flat"


class StepRunner(Protocol):
    """Executes one step: the real ``ModelRunner``, or a scripted one in tests."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput: ...
