"""Exceptions of the producer side. Imports pydantic and protocol.errors only (whose ``ProducerError`` is the base
of all of them, and of the wire's ``SchemaError``, ``ConfigError`` and ``RedisUnavailable``); never torch or the
engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from tokenmill.protocol.errors import ProducerError


class ResultTimeout(ProducerError, TimeoutError):
    """A wait for a result ran out before the result landed."""


class JobFailed(ProducerError):
    """The remote generation finished with a non-ok status; carries the remote reason.

    Args:
        result: the failed ``GenerationResult``, or its JSON dict (so the exception survives
            pickling and Celery's JSON result backend, which rebuild it as ``JobFailed(*exc.args)``).

    Attributes:
        result: the result as its JSON dict.
    """

    def __init__(self, result: BaseModel | Mapping[str, Any]) -> None:
        self.result = result.model_dump(mode="json") if isinstance(result, BaseModel) else dict(result)
        status, error = self.result["status"], self.result.get("error")
        self.code: str = error["code"] if error else status
        self.reason: str = error["message"] if error else status
        self.message = f"request {self.result['id']} {status}: [{self.code}] {self.reason}"
        super().__init__(self.result)

    def __str__(self) -> str:
        return self.message


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
