"""Plain records passed between the worker's threads, and the engine interface the worker drives.

Standard library and producer.schema only; never imports engine.engine (torch) or redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.outputs import RequestOutput
from engine.prompts import Prompt
from protocol.sampling import SamplingParams as EngineSamplingParams
from engine.stats import EngineStats
from producer.schema import GenerationRequest, GenerationResult


class EngineLike(Protocol):
    """What the worker needs of an engine: ``engine.Engine`` and ``EchoEngine`` both fit."""

    @property
    def model_name(self) -> str: ...

    def tokenize(self, prompt: Prompt) -> list[int]: ...

    def compile_grammar(self, params: EngineSamplingParams) -> None: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: EngineSamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...


@dataclass(frozen=True)
class Entry:
    """Where a request came from: acking it needs the stream and the entry id."""

    stream: str  # the lane stream the entry lives in
    entry_id: str  # Redis stream entry id, e.g. "1712345678901-0"
    lane: int  # priority lane of the stream (0 = most urgent)
    fields: dict[bytes, bytes] = field(default_factory=dict, compare=False)  # raw fields, for dead-lettering


@dataclass
class Admit:
    """Reader -> engine thread: a decoded, valid request to run."""

    request: GenerationRequest
    entry: Entry
    intake_time_s: float  # unix time the worker read (or reclaimed) the entry


@dataclass
class Prepared:
    """Tokenizer thread -> engine thread: an admitted request, tokenized (or why it could not be)."""

    admit: Admit
    prompt_token_ids: list[int] | None  # None when tokenizing failed
    error: Exception | None = None


@dataclass
class Abort:
    """Reader -> engine thread: stop a request; its result gets ``status``."""

    request_id: str
    status: str  # "cancelled" or "expired"


@dataclass
class TokenDelta:
    """Engine thread -> writer: text generated this step for a ``stream_tokens`` request."""

    request_id: str
    text: str


@dataclass
class Finish:
    """Any thread -> writer: persist ``result`` for ``entry`` and ack it, atomically."""

    result: GenerationResult
    entry: Entry
    reply_to: str | None = None  # stream that also receives the result
    stream_tokens: bool = False  # also close the token stream with an end marker


@dataclass
class DeadLetter:
    """Any thread -> writer: move ``entry`` to the dead-letter stream and ack it.

    With ``result`` set (the id is known), the error result is written in the same atomic step.
    """

    entry: Entry
    reason: str
    result: GenerationResult | None = None


Outgoing = TokenDelta | Finish | DeadLetter
Incoming = Admit | Prepared | Abort
