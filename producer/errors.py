"""Exceptions of the producer side. Never imports torch or the engine."""

from __future__ import annotations

from collections.abc import Mapping
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
