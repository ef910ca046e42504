"""Triage of raw stream entries: decode, validate and sort each into run / answer now / dead-letter.

Pure functions over protocol.schema; no Redis, no engine, no threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.outcomes import AbortReason, ErrorCode
from tokenmill.protocol.schema import (
    GenerationRequest,
    GenerationResult,
    ResultStatus,
    check_reply_to,
    decode_request,
    peek_reply_to,
    peek_request_id,
)
from tokenmill.worker.messages import Admit, DeadLetter, Entry, Finish


@dataclass(frozen=True)
class IntakePolicy:
    """What a worker accepts."""

    keys: Keys  # the served queue: reply streams must live in its reply namespace
    model_names: frozenset[str]  # the served name and the configured one; a request naming another is refused
    worker: str  # this worker's name, recorded in immediate answers
    max_request_bytes: int  # larger entries are refused before they are decoded or tokenized
    # NOTE: stream -> whether it is a decode pool's lane, parsed once per stream (a worker reads a few)
    _decode_lanes: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    def is_decode_lane(self, stream: str) -> bool:
        """Whether ``stream`` is a decode pool's lane of the queue (its requests were handed off by a prefill)."""
        is_decode = self._decode_lanes.get(stream)
        if is_decode is None:
            lane = self.keys.parse_lane(stream)
            is_decode = self._decode_lanes[stream] = lane is not None and lane.is_decode
        return is_decode


def triage(entry: Entry, now_s: float, policy: IntakePolicy) -> Admit | Finish | DeadLetter:
    """Decide what to do with one entry read from a lane.

    Args:
        entry: the raw entry.
        now_s: unix time of the read (deadlines are compared with it).
        policy: what this worker accepts.

    Returns:
        ``Admit`` to run it, ``Finish`` with an error / expired result, or ``DeadLetter`` when no
        request id can be recovered to address an answer to (also when the entry has none: the
        schema's default id would answer it where nobody waits).
    """
    size = sum(len(value) for value in entry.fields.values() if isinstance(value, (bytes, str)))
    if size > policy.max_request_bytes:
        message = f"the request is {size} bytes; this worker accepts at most {policy.max_request_bytes}"
        return _refuse_undecodable(entry, SchemaError(ErrorCode.PROMPT_TOO_LONG.value, message), policy)
    try:
        request = decode_request(entry.fields)
    except SchemaError as exc:
        return _refuse_undecodable(entry, exc, policy)
    if not _starts_with_id(entry.fields, request.id) and peek_request_id(entry.fields) != request.id:
        return DeadLetter(entry, reason=f"{ErrorCode.VALIDATION.value}: the request has no id to answer it under")
    reply_error = check_reply_to(request, policy.keys)
    if reply_error is not None:
        return answer(request.model_copy(update={"reply_to": None}), entry, ErrorCode.VALIDATION.value, reply_error,
                      policy.worker)
    # NOTE: a guard: producers route a request naming a model to that model's lanes, which only workers
    # serving it read; only an entry written to another lane by hand (or an older producer) meets it.
    if request.model is not None and request.model not in policy.model_names:
        message = f"this worker serves {' / '.join(sorted(map(repr, policy.model_names)))}, not {request.model!r}"
        return answer(request, entry, ErrorCode.MODEL_NOT_SERVED.value, message, policy.worker)
    if request.deadline is not None and request.deadline <= now_s:
        return answer(request, entry, AbortReason.EXPIRED, "deadline passed before the request started",
                      policy.worker, status=AbortReason.EXPIRED)
    return Admit(request, entry, now_s, is_handed_off=policy.is_decode_lane(entry.stream))


def _starts_with_id(fields: dict[Any, Any], request_id: str) -> bool:
    """Whether the request's map begins with the key ``id`` holding ``request_id`` (as producers write it): then
    :func:`peek_request_id` finds ``request_id`` too. A byte comparison, instead of the peek's walk and second
    check of the id (a fifth of a triage); False sends the caller to the peek.

    NOTE: only the shortest encodings (msgpack's own) match; anything else is peeked.
    """
    payload = fields.get("d", fields.get(b"d"))  # NOTE: the field decode_request read (protocol.schema._field)
    if not isinstance(payload, bytes) or not payload:
        return False
    start = _MAP_HEADER_SIZES.get(payload[0], 0)
    encoded = request_id.encode()
    size = len(encoded)
    if not start or size >= 1 << 16:
        return False
    if size < 32:
        header = bytes((0xA0 | size,))
    elif size < 256:
        header = bytes((0xD9, size))
    else:
        header = b"\xda" + size.to_bytes(2, "big")
    return payload.startswith(b"\xa2id" + header + encoded, start)


# msgpack map type byte -> size of the map's header: fixmap (1 to 15 pairs), map16, map32
_MAP_HEADER_SIZES = {**dict.fromkeys(range(0x81, 0x90), 1), 0xDE: 3, 0xDF: 5}


def answer(request: GenerationRequest, entry: Entry, code: AbortReason | str, message: str, worker: str,
           status: ResultStatus | AbortReason = "error") -> Finish:
    """An immediate answer (error, expired, cancelled) to a decoded request that will not run."""
    result = GenerationResult.failure(request.id, code, message, status=status, worker=worker,
                                      metadata=request.metadata)
    return Finish(result, entry, request.reply_to, request.stream_tokens)


def _refuse_undecodable(entry: Entry, exc: SchemaError, policy: IntakePolicy) -> Finish | DeadLetter:
    request_id = peek_request_id(entry.fields)
    if request_id is None:
        return DeadLetter(entry, reason=f"{exc.code}: {exc.message}")
    result = GenerationResult.failure(request_id, exc.code, exc.message, worker=policy.worker)
    reply_to = peek_reply_to(entry.fields)
    if reply_to is not None and not policy.keys.is_reply_stream(reply_to):
        reply_to = None
    return Finish(result, entry, reply_to=reply_to)

