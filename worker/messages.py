"""Plain records passed between the worker's threads.

Standard library and protocol/ (schema, outcomes) only; never imports the engine or redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.protocol.outcomes import AbortReason
from tokenmill.protocol.schema import GenerationRequest, GenerationResult


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
    is_handed_off: bool = False  # read from a decode pool's lane: a prefill worker published its prompt's KV


@dataclass
class Prepared:
    """Tokenizer thread -> engine thread: an admitted request, tokenized (or why it could not be)."""

    admit: Admit
    prompt_token_ids: list[int] | None  # None when tokenizing failed
    error: Exception | None = None


@dataclass
class AdmitBatch:
    """Reader -> engine thread: the admits of one read, in one hand-off (a queue put wakes the other thread)."""

    admits: list[Admit]


@dataclass
class PreparedBatch:
    """Tokenizer thread -> engine thread: the admits one preparation job prepared, in one hand-off."""

    prepared: list[Prepared]


@dataclass
class Abort:
    """Reader -> engine thread: stop a request; its result gets ``status``."""

    request_id: str
    status: AbortReason


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
class Handoff:
    """Engine thread -> writer: move ``entry`` (its fields as they are) to its lane's decode pool stream and ack
    it, atomically; the prompt's KV blocks are in the fleet's store. Nothing is moved when the request was
    answered meanwhile."""

    entry: Entry
    request_id: str


@dataclass
class DeadLetter:
    """Any thread -> writer: move ``entry`` to the dead-letter stream and ack it.

    With ``result`` set (the id is known), the error result is written in the same atomic step.
    """

    entry: Entry
    reason: str
    result: GenerationResult | None = None


Outgoing = TokenDelta | Finish | DeadLetter | Handoff
Outbound = Outgoing | list[Outgoing]  # what the outbox holds: an item, or the items of one engine step in one put
Incoming = AdmitBatch | PreparedBatch | Abort
