"""One generation request's state inside the engine. Standard library and pydantic only."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle state. Ordered so that ``status >= FINISHED_STOPPED`` means finished."""

    WAITING = 0  # queued, no KV on the device (new, or preempted by recompute)
    RUNNING = 1  # holds device blocks, scheduled every step it fits
    SWAPPED = 2  # its KV sits in the host pool, waiting to be swapped back in
    FINISHED_STOPPED = 3  # EOS, stop token id or stop string
    FINISHED_LENGTH = 4  # reached max_tokens
    FINISHED_ABORTED = 5  # aborted by the caller (cancel, deadline)
    FINISHED_ERROR = 6  # rejected or failed (e.g. can never fit in the KV cache)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# The one table from internal state to the user-facing finish reason.
FINISH_REASON: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class PreemptionCause(str, enum.Enum):
    """Why a running request lost its device blocks."""

    MEMORY = "memory"  # the device pool ran out of blocks
    PRIORITY = "priority"  # a more urgent request needed the room
    STARVATION = "starvation"  # long-output limit: it decoded too long while others waited


@dataclass
class Request:
    """A request as the scheduler and engine see it.

    The KV cache holds ``num_computed_tokens`` of ``all_token_ids``; the scheduler
    schedules the rest (a prefill chunk, or the one newest token when decoding).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float  # clock time when the request entered the engine
    priority: int = 0  # lower is more urgent
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (device, or host if swapped)
    seq_no: int = -1  # tie-breaker assigned by the scheduler on admission to its queues
    num_preemptions: int = 0
    num_steps_since_admitted: int = 0  # decode steps since last (re)admission, for the starvation limit
    is_demoted: bool = False  # hit the long-output limit: preferred victim until it is preempted
    waiting_since_s: float = 0.0  # clock time aging counts from: arrival, reset when demoted (starvation limit)
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    finished_time_s: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """Most tokens this request can ever hold in the cache."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
