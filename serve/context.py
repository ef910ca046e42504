"""What every route needs: the process's shared state, authentication, and the per-call context
(request id, priority lane, deadline) read from headers and the body.

Imports fastapi and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import hmac
import math
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from producer.aio import AsyncProducer
from producer.config import ServeConfig
from producer.schema import new_request_id
from serve.errors import APIError

PRIORITY_HEADER = "X-Tokenmill-Priority"
# Client timeouts, in seconds: ours, then the one the openai SDK sends with every request.
TIMEOUT_HEADERS = ("X-Tokenmill-Timeout", "X-Stainless-Read-Timeout")


@dataclass
class ServeState:
    """Shared by every request of one server process."""

    config: ServeConfig
    producer: AsyncProducer


@dataclass(frozen=True)
class CallContext:
    """One API call: its id, lane and how long it may take."""

    request_id: str  # the tokenmill request id; OpenAI ids and X-Request-Id are built from it
    priority: str | int  # lane name or number
    timeout_s: float  # the client's timeout (capped by serve.request_timeout_s)
    received_at: float  # unix time the call arrived

    @property
    def created(self) -> int:
        """Unix seconds, the response objects' ``created``."""
        return int(self.received_at)

    @property
    def deadline(self) -> float:
        """Unix time after which the queue answers ``expired`` instead of starting the work."""
        return self.received_at + self.timeout_s


def state_of(request: Request) -> ServeState:
    state: ServeState = request.app.state.serve
    return state


async def authorize(request: Request) -> None:
    """Check ``Authorization: Bearer KEY`` against ``serve.api_keys`` (none configured: open).

    NOTE: ``async`` although it awaits nothing: FastAPI runs a plain ``def`` dependency in its
    thread pool, a thread hand-off on every call (about 1 ms of each request's latency).

    Raises:
        APIError: 401 with OpenAI's ``invalid_api_key``.
    """
    keys = state_of(request).config.api_keys
    if not keys:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(given.strip(), key) for key in keys):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def call_context(request: Request, body: dict[str, Any]) -> CallContext:
    """The context of one completion call; the request id is also kept on ``request.state``.

    Priority: the body's ``priority`` (a tokenmill extension, as in vLLM) > the
    ``X-Tokenmill-Priority`` header > ``serve.priority``. The timeout is the client's
    (``X-Tokenmill-Timeout``, else the openai SDK's ``X-Stainless-Read-Timeout``), at most
    ``serve.request_timeout_s``.

    Raises:
        APIError: 400 for a malformed priority or timeout header.
    """
    config = state_of(request).config
    request.state.request_id = request_id = new_request_id()
    priority = body.pop("priority", None)
    if priority is None:
        header = request.headers.get(PRIORITY_HEADER)
        priority = (int(header) if header.isdigit() else header) if header else config.priority
    return CallContext(request_id, priority, min(config.request_timeout_s, _client_timeout_s(request)), time.time())


def _client_timeout_s(request: Request) -> float:
    for name in TIMEOUT_HEADERS:
        value = request.headers.get(name)
        if value is None:
            continue
        try:
            timeout_s = float(value)
        except ValueError:
            raise APIError(400, f"{name} must be a number of seconds, got {value!r}") from None
        if math.isfinite(timeout_s) and timeout_s > 0:
            return timeout_s
    return math.inf
