"""Exceptions of the producer side. Never imports torch or the engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from producer.schema import GenerationResult


class ProducerError(Exception):
    """Base class of every error the producer raises on purpose."""


class SchemaError(ProducerError):
    """A message could not be decoded or validated.

    Attributes:
        code: one of :class:`producer.schema.ErrorCode`'s values, e.g. ``"undecodable"``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ResultTimeout(ProducerError, TimeoutError):
    """A wait for a result ran out before the result landed."""


class JobFailed(ProducerError):
    """The remote generation finished with a non-ok status; carries the remote reason.

    Args:
        result: the failed result, or its JSON dict (so the exception survives pickling and
            Celery's JSON result backend, which rebuild it as ``JobFailed(*exc.args)``).
    """

    def __init__(self, result: GenerationResult | Mapping[str, Any]) -> None:
        from producer.schema import GenerationResult as Result  # noqa: PLC0415 - schema imports this module

        if not isinstance(result, Result):
            result = Result.model_validate(dict(result))
        reason = result.error.message if result.error else result.status
        code = result.error.code if result.error else result.status
        self.message = f"request {result.id} {result.status}: [{code}] {reason}"
        super().__init__(result.model_dump(mode="json"))
        self.result = result
        self.code = code
        self.reason = reason

    def __str__(self) -> str:
        return self.message


class RedisUnavailable(ProducerError, ConnectionError):
    """Redis could not be reached (after retries) or the embedded server would not start."""


class SubmitUncertain(ProducerError):
    """Redis failed or timed out while requests were being enqueued: each may or may not be queued.

    Resubmitting the same requests with the same ids is safe: one id, one result.

    Attributes:
        request_ids: the ids whose enqueue is uncertain.
    """

    def __init__(self, request_ids: Sequence[str], cause: Exception) -> None:
        shown = ", ".join(repr(i) for i in request_ids[:3]) + (", ..." if len(request_ids) > 3 else "")
        super().__init__(
            f"enqueue of {len(request_ids)} request(s) ({shown}) is uncertain after {type(cause).__name__}: {cause}; "
            "resubmitting with the same request_id is safe (one id, one result)"
        )
        self.request_ids = list(request_ids)
