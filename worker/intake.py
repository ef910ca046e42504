"""Triage of raw stream entries: decode, validate and sort each into run / answer now / dead-letter.

Pure functions over producer.schema; no Redis, no engine, no threads.
"""

from __future__ import annotations

from typing import Any

import msgpack

from producer.errors import SchemaError
from producer.schema import ErrorCode, GenerationRequest, GenerationResult, decode_request, peek_request_id
from worker.messages import Admit, DeadLetter, Entry, Finish


def triage(entry: Entry, now_s: float, model_name: str, worker: str) -> Admit | Finish | DeadLetter:
    """Decide what to do with one entry read from a lane.

    Args:
        entry: the raw entry.
        now_s: unix time of the read (deadlines are compared with it).
        model_name: the model this worker serves; a request naming another is refused.
        worker: this worker's name, recorded in immediate answers.

    Returns:
        ``Admit`` to run it, ``Finish`` with an error / expired result, or ``DeadLetter`` when no
        request id can be recovered to address an answer to.
    """
    try:
        request = decode_request(entry.fields)
    except SchemaError as exc:
        return _refuse_undecodable(entry, exc, worker)
    if request.model is not None and request.model != model_name:
        message = f"this worker serves {model_name!r}, not {request.model!r}"
        return answer(request, entry, ErrorCode.MODEL_NOT_SERVED.value, message, worker)
    if request.deadline is not None and request.deadline <= now_s:
        return answer(request, entry, "expired", "deadline passed before the request started", worker,
                      status="expired")
    return Admit(request, entry, now_s)


def answer(request: GenerationRequest, entry: Entry, code: str, message: str, worker: str,
           status: str = "error") -> Finish:
    """An immediate answer (error, expired, cancelled) to a decoded request that will not run."""
    result = GenerationResult.failure(request.id, code, message, status=status,  # type: ignore[arg-type]
                                      worker=worker, metadata=request.metadata)
    return Finish(result, entry, request.reply_to, request.stream_tokens)


def _refuse_undecodable(entry: Entry, exc: SchemaError, worker: str) -> Finish | DeadLetter:
    request_id = peek_request_id(entry.fields)
    if request_id is None:
        return DeadLetter(entry, reason=f"{exc.code}: {exc.message}")
    result = GenerationResult.failure(request_id, exc.code, exc.message, worker=worker)
    return Finish(result, entry, reply_to=_peek_reply_to(entry.fields))


def _peek_reply_to(fields: dict[Any, Any]) -> str | None:
    """Best-effort reply stream of a request that failed validation, so bulk jobs still hear of it."""
    try:
        data = msgpack.unpackb(fields.get(b"d", b""), raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - garbage has no reply stream
        return None
    reply_to = data.get("reply_to") if isinstance(data, dict) else None
    return reply_to if isinstance(reply_to, str) and reply_to else None
