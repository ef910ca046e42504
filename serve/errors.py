"""Errors of the HTTP front in OpenAI's error shape, and the handlers that render them: every
failure a route can meet is answered ``{"error": {"message", "type", "param", "code"}}``, a
server bug too (a catch-all 500), never a plain-text page. Redis gone (refused, timed out, failing
over) is one answer on every route, here and nowhere else: 503 ``redis_unavailable``.

Imports fastapi, redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.producer.errors import SubmitUncertain
from tokenmill.producer.openai_compat import BodyError, error_object
from tokenmill.protocol.connection import CLUSTER_TRANSIENT_ERRORS
from tokenmill.protocol.errors import ProducerError, RedisUnavailable, SchemaError

REQUEST_ID_HEADER = "X-Request-Id"
# What a route meets when Redis is gone, stalls or fails over: each is a 503 (redis_unavailable), never a 500.
REDIS_GONE_ERRORS: tuple[type[Exception], ...] = (
    RedisUnavailable, redis.ConnectionError, redis.TimeoutError, *CLUSTER_TRANSIENT_ERRORS)
log = logging.getLogger("tokenmill.serve")


class APIError(Exception):
    """An answer other than success: an HTTP status and OpenAI's error body."""

    def __init__(self, status_code: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, is_final: bool = False) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = error_object(message, type_=type_, param=param, code=code)
        # NOTE: OpenAI's SDKs retry a 5xx twice with backoff unless told not to (x-should-retry): an
        # error that a retry within seconds cannot mend says so, and the client fails at once.
        self.is_final = is_final

    @classmethod
    def from_body(cls, status_code: int, body: dict[str, Any]) -> APIError:
        """An error from a ready OpenAI error body (e.g. a failed result's)."""
        error = body["error"]
        return cls(status_code, error["message"], type_=error["type"], param=error.get("param"), code=error["code"])

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = {**(headers or {}), **({"x-should-retry": "false"} if self.is_final else {})}
        return JSONResponse(self.body, status_code=self.status_code, headers=headers or None)


def not_found(what: str, object_id: str) -> APIError:
    return APIError(404, f"No {what} found with id {object_id!r}.", code=f"{what}_not_found")


def found_or_404(found: dict[str, Any] | None, what: str, object_id: str) -> dict[str, Any]:
    """``found``, the object a store returned for ``object_id``.

    Raises:
        APIError: 404 (:func:`not_found`) when it is None: no such ``what``, or another account's.
    """
    if found is None:
        raise not_found(what, object_id)
    return found


def redis_unavailable(exc: BaseException) -> APIError:
    """The 503 of a request Redis could not serve (``exc``: what the client raised); the one
    answer every route gives while Redis is gone, ``/health`` included."""
    return APIError(503, f"the queue's Redis does not answer ({type(exc).__name__}); retry later",
                    type_="server_error", code="redis_unavailable")


def first_invalid(errors: Sequence[Any], *, skip: int = 0) -> APIError:
    """A 400 naming the first of pydantic's ``errors``: its message, and its location as ``param``
    (less ``skip`` leading parts, e.g. FastAPI's ``body``)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    return APIError(400, str(first["msg"]), param=".".join(str(part) for part in first["loc"][skip:]) or None)


def install_handlers(app: FastAPI) -> None:
    """Render every error the routes raise as OpenAI's error body (the guard adds ``X-Request-Id``)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(BodyError)
    async def body_error(request: Request, exc: BodyError) -> JSONResponse:
        return APIError(400, exc.message, param=exc.param).response()

    @app.exception_handler(SubmitUncertain)
    async def uncertain(request: Request, exc: SubmitUncertain) -> JSONResponse:
        """Redis failed during the enqueue: the 503 of Redis gone, saying whether a resubmit is safe."""
        return APIError(503, str(exc), type_="server_error", code="redis_unavailable").response()

    @app.exception_handler(SchemaError)
    async def schema_error(request: Request, exc: SchemaError) -> JSONResponse:
        return APIError(400, exc.message, code=exc.code).response()

    async def redis_gone(request: Request, exc: Exception) -> JSONResponse:
        return redis_unavailable(exc).response()

    for error_class in REDIS_GONE_ERRORS:
        app.add_exception_handler(error_class, redis_gone)

    @app.exception_handler(ProducerError)
    async def producer_error(request: Request, exc: ProducerError) -> JSONResponse:
        return APIError(503, str(exc), type_="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return first_invalid(exc.errors(), skip=1).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), code=None).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        """The catch-all: a bug, never the client's fault. NOTE: this one runs outside the guard (in
        Starlette's outermost middleware, which re-raises so uvicorn logs the traceback), so it
        names the request id itself."""
        request_id = getattr(request.state, "request_id", None)
        log.error("request %s (%s %s) failed: %s: %s", request_id, request.method, request.url.path,
                  type(exc).__name__, exc)
        error = APIError(500, f"internal error ({type(exc).__name__}); request id {request_id}",
                         type_="server_error", code="internal_error")
        return error.response({REQUEST_ID_HEADER: request_id} if request_id else None)
