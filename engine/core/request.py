"""One generation request's state inside the engine, and when it stops.

Standard library and pydantic only. The engine's one registry of live requests holds these
objects (the scheduler's queues); everything known about a request lives on it: what scheduling
needs on the request itself, each feature's own state in a small object its code owns (output-length
prediction, the fleet cache, speculative decoding, the output side).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from tokenmill.engine.core.fleet_state import FleetState
from tokenmill.engine.core.length_state import LengthState
from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.engine.errors import InvariantError
from tokenmill.protocol.outcomes import ErrorCode, FinishReason
from tokenmill.protocol.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle state. Ordered so that ``status >= FINISHED_STOPPED`` means finished."""

    WAITING = 0  # queued, no KV on the device (new, or preempted by recompute)
    RUNNING = 1  # holds device blocks, scheduled every step it fits
    SWAPPED = 2  # its KV sits in the host pool, waiting to be swapped back in
    FINISHED_STOPPED = 3  # EOS, stop token id or stop string
    FINISHED_LENGTH = 4  # reached max_tokens or the model's context
    FINISHED_ABORTED = 5  # aborted by the caller (cancel, deadline)
    FINISHED_ERROR = 6  # rejected or failed (e.g. can never fit in the KV cache)

    @property
    def is_finished(self) -> bool:
        return self >= FIRST_FINISHED


# NOTE: an enum member read off its class costs a Python call in 3.11 (~65 ns); the finished test runs for every
# request several times a step, so it compares with this module constant
FIRST_FINISHED = RequestStatus.FINISHED_STOPPED

# The one table from internal state to the user-facing finish reason.
FINISH_REASON: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class PreemptionCause(str, enum.Enum):
    """Why a running request lost its device blocks."""

    MEMORY = "memory"  # the device pool ran out of blocks
    PRIORITY = "priority"  # a more urgent request needed the room
    STARVATION = "starvation"  # long-output limit: it decoded too long while others waited


@dataclass(slots=True, eq=False)
class Request:
    """A request as the scheduler and engine see it.

    The KV cache holds ``num_computed_tokens`` of ``all_token_ids``; the scheduler
    schedules the rest (a prefill chunk, or the one newest token when decoding).

    Two requests are equal only if they are the same object (``eq=False``): a request is one live thing, and
    a queue's removal compares it with every request before it (a field-by-field ``__eq__`` built two tuples
    of every field for each).
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
    stop_token_id: int | None = None  # the EOS / stop id that finished it (kept in the ids, not in the text)
    error_code: ErrorCode | None = None  # set with FINISHED_ERROR
    error_message: str | None = None  # why, for a person (set with FINISHED_ERROR)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, when asked for
    prefix_entry_ids: list[int] = field(default_factory=list)  # prefix-cache entries of its leading full blocks
    num_cached_prompt_tokens: int = 0  # prompt tokens its latest admission found in the prefix cache
    # its prompt blocks are being fetched from the fleet's store: it waits to be admitted until they are in
    is_fetching_kv: bool = False
    # Speculative decoding: tokens proposed for this step only (never in output_token_ids until the model verified
    # them). NOTE: on the request, not in the speculator's state: the scheduler plans them into every decode chunk
    # (engine/core/step_plan.py) and clears them after each step, in the per-step loops.
    draft_token_ids: list[int] = field(default_factory=list)
    group: ParallelGroup | None = None  # the n > 1 request this one is a sample of
    sample_index: int = 0  # which sample of its group
    # Whether the caller reads its progress (False: its first output, that it started, and its final one are made,
    # and its text is decoded when it finishes, or each step only where stop strings need the text).
    streams: bool = True
    # Each feature's own state, owned by its code:
    length_state: LengthState = field(default_factory=LengthState, repr=False)  # engine/core/length_predictor.py
    fleet_state: FleetState | None = field(default=None, repr=False)  # engine/core/fleet_cache.py, made there
    # the speculator's (engine/spec/speculator.py ``DraftState``) and the output processor's
    # (engine/output/output_state.py ``OutputState``), each made on first use by its owner (core imports neither)
    draft_state: object | None = field(default=None, repr=False)
    output_state: object | None = field(default=None, repr=False)
    # Penalty counts and grammar matcher over this request's own token lists (filled by the sampler).
    sampling_state: SamplingState = field(init=False, repr=False)
    # Prompt and output as one read-only sequence, without copying either (the speculator's lookups); made once, as
    # a request's two lists are never replaced (they only grow).
    token_view: TokenView = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.sampling_state = SamplingState(self.prompt_token_ids, self.output_token_ids)
        self.token_view = TokenView(self.prompt_token_ids, self.output_token_ids)

    def fail_finished(self, code: ErrorCode, message: str) -> None:
        """Turn a request that already left the scheduler's queues this step into an error (its
        output is not out yet); live requests fail through ``Scheduler.finish_request``."""
        self.status, self.error_code, self.error_message = RequestStatus.FINISHED_ERROR, code, message

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
        """Prompt and output in one new list: O(context); the step's hot path uses :meth:`token_slice`."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a decode step's cost must not grow
        with the context)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def max_tokens(self) -> int:
        """Most tokens it may generate: ``max_tokens``, as the engine resolved it at admission."""
        max_tokens = self.sampling_params.max_tokens
        if max_tokens is None:
            raise InvariantError(f"{self.request_id}: max_tokens was not resolved at admission")
        return max_tokens

    @property
    def max_total_tokens(self) -> int:
        """Most tokens this request can ever hold in the cache."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= FIRST_FINISHED  # RequestStatus.is_finished, without the second property call

    @property
    def is_fork_pending(self) -> bool:
        """An n > 1 request before its samples split off: it computes its prompt but the last
        token (each sample computes that one itself and samples its own first token)."""
        return self.sampling_params.n > 1 and self.group is None

    @property
    def num_seats(self) -> int:
        """Running slots (``max_num_seqs``) it takes: its samples' once it forks."""
        return self.sampling_params.n if self.is_fork_pending else 1

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens the cache must hold before the next sample: all, or the prompt but one."""
        return self.num_prompt_tokens - 1 if self.is_fork_pending else self.num_tokens


class TokenView(Sequence[int]):
    """A request's prompt followed by its output, read without concatenating them: slicing costs the slice, not
    the context. It reflects the lists as they are (the output grows)."""

    __slots__ = ("_output", "_prompt")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt, self._output = prompt, output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self._prompt, self._output)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        num_prompt = len(self._prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            if stop <= start:
                return []
            if stop <= num_prompt:
                return self._prompt[start:stop]
            if start >= num_prompt:
                return self._output[start - num_prompt:stop - num_prompt]
            return self._prompt[start:] + self._output[:stop - num_prompt]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self._prompt[index] if index < num_prompt else self._output[index - num_prompt]


@dataclass
class ParallelGroup:
    """The samples of one n > 1 request, once it forked (each sample is a Request of its own)."""

    request_id: str  # the request as the caller named it
    num_samples: int
    finished: list[Request] = field(default_factory=list)  # samples that finished, in finishing order

    @property
    def is_finished(self) -> bool:
        return len(self.finished) == self.num_samples

    @staticmethod
    def sample_id(request_id: str, index: int) -> str:
        """A sample's request id: the caller's id, a space and ``#index`` (wire ids hold no spaces)."""
        return f"{request_id} #{index}"


def find_stop(request: Request, new_token_ids: list[int], eos_token_ids: frozenset[int],
              max_model_len: int | None) -> tuple[int, RequestStatus] | None:
    """Which of the tokens about to be appended to the request ends it, as if they came one at a time; the one
    place stopping on tokens is decided.

    Stop *strings* need text: the output processor finds them and finishes the request then.

    Args:
        request: a running request, before ``new_token_ids`` are appended to its output.
        new_token_ids: its step's new tokens (one, or a verified draft and its bonus token).
        eos_token_ids: the model's end-of-sequence ids (ignored with ``ignore_eos``).
        max_model_len: the model's context length; None = unbounded.

    Returns:
        ``(index, status)`` of the first new token that ends it -- FINISHED_STOPPED (EOS or a stop id, once
        ``min_tokens`` are out; sets ``stop_token_id``) or FINISHED_LENGTH (``max_tokens`` reached or the context
        full) -- or None to go on after all of them.
    """
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    # the token that brings the output to max_tokens or the context to max_model_len (the first token, if either
    # is reached already)
    num_left = request.max_tokens - num_output
    # NOTE: comparisons, not min() and max(): this runs for every request every step
    if max_model_len is not None:
        context_left = max_model_len - len(request.prompt_token_ids) - num_output
        if context_left < num_left:
            num_left = context_left
    length_index = num_left - 1 if num_left > 1 else 0
    stop_token_ids = params.stop_token_ids
    checks_eos = not params.ignore_eos and bool(eos_token_ids)
    # NOTE: a step's tokens are first looked through for a stopping id in C (set operations), token by token below
    # only when one is there; past ``length_index`` none can end the request
    if (checks_eos and not eos_token_ids.isdisjoint(new_token_ids)) or \
            (stop_token_ids and not frozenset(stop_token_ids).isdisjoint(new_token_ids)):
        for index in range(min(len(new_token_ids), length_index + 1)):
            token_id = new_token_ids[index]
            if ((checks_eos and token_id in eos_token_ids) or token_id in stop_token_ids) and \
                    not params.is_min_tokens_active(num_output + index):
                request.stop_token_id = token_id
                return index, RequestStatus.FINISHED_STOPPED
    if length_index < len(new_token_ids):
        return length_index, RequestStatus.FINISHED_LENGTH
    return None
