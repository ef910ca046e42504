"""What the engine hands back to callers: one request's progress in a step or its final state
(RequestOutput), its samples when n > 1 and its timings. Standard library and pydantic only."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from tokenmill.protocol.outcomes import ErrorCode, FinishReason, TokenLogprob

T = TypeVar("T")


class SoFar(Sequence[T]):
    """The first ``length`` items of one of a request's own lists (its output tokens, their logprobs), read in
    place: what a progress output holds as "all so far". Copying the list into every step's output cost the step
    O(output) per streamed request (9 us for 4,000 tokens, more than the rest of the step); a request's lists only
    grow (a stop string cuts only tokens past what was reported), so the first ``length`` items stay as they were.
    Equal to any sequence of the same items; ``list()`` of it is a copy to keep."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[T], length: int) -> None:
        self._items, self._length = items, length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return self._items[:self._length][index] if index.step not in (None, 1) else \
                self._items[slice(*index.indices(self._length))]
        if not -self._length <= index < self._length:
            raise IndexError("index out of range")
        return self._items[index % self._length]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._length)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == self._length and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        raise TypeError("unhashable type: 'SoFar'")

    def __repr__(self) -> str:
        return repr(list(self))

    def __add__(self, other: Any) -> list[T]:
        return list(self) + list(other)


@dataclass(slots=True)
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
        return self._since_arrival_s(self.first_scheduled_time_s)

    @property
    def ttft_s(self) -> float | None:
        return self._since_arrival_s(self.first_token_time_s)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finished_time_s is None or self.first_token_time_s is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time_s - self.first_token_time_s) / (self.num_output_tokens - 1)

    @property
    def total_s(self) -> float | None:
        return self._since_arrival_s(self.finished_time_s)

    def _since_arrival_s(self, time_s: float | None) -> float | None:
        """Seconds from arrival to ``time_s``; None while that moment has not come."""
        return None if time_s is None else time_s - self.arrival_time_s


@dataclass
class SampleOutput:
    """One sample of an n > 1 request, once finished."""

    index: int  # 0 .. n-1
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[dict[int, float]] | None = None
    token_logprobs: list[TokenLogprob] | None = None  # OpenAI's shape, when logprobs were asked for


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one engine step (streaming) or its final state (slotted: one is made per streamed
    request per step)."""

    request_id: str
    new_token_ids: list[int]  # tokens generated this step
    text_delta: str  # text that became final this step (held back while a stop string may be forming)
    token_ids: Sequence[int]  # all generated tokens so far (a progress output's: read in place, :class:`SoFar`)
    text: str  # all generated text so far (stop string cut)
    finished: bool
    finish_reason: FinishReason | None  # set once finished
    prompt_token_count: int
    metrics: RequestMetrics
    error: str | None = None  # human-readable reason when finish_reason is ERROR
    error_code: ErrorCode | None = None  # machine-readable, when finish_reason is ERROR
    logprobs: Sequence[dict[int, float]] | None = None  # raw: per token, {token_id: logprob} (sampled first)
    token_logprobs: list[TokenLogprob] | None = None  # OpenAI's shape; on final outputs that asked for logprobs
    # n > 1: every sample, by index (the fields above are sample 0's); only final outputs carry them
    samples: list[SampleOutput] | None = None
