"""What every route needs: the process's shared state, the caller's account, and the per-call
context (request id, priority lane, deadline) read from headers and the body.

Imports fastapi and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tokenmill.producer.aio import AsyncProducer
from tokenmill.protocol.config import ServeConfig
from tokenmill.serve.errors import APIError
from tokenmill.serve.live_models import LiveModels

PRIORITY_HEADER = "X-Tokenmill-Priority"
# Client timeouts, in seconds: ours, then the one the openai SDK sends with every request.
TIMEOUT_HEADERS = ("X-Tokenmill-Timeout", "X-Stainless-Read-Timeout")


@dataclass
class ServeState:
    """Shared by every request of one server process."""

    config: ServeConfig
    producer: AsyncProducer
    live_models: LiveModels  # the models live workers serve (requests naming another are refused)


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


def account_of(request: Request) -> str:
    """The account that owns what this call creates and sees: the guard's hash of the caller's key."""
    account: str = request.state.account
    return account


def call_context(request: Request, body: dict[str, Any]) -> CallContext:
    """The context of one completion call; its request id is the guard's (``X-Request-Id``).

    Priority: the body's ``priority`` (a tokenmill extension, as in vLLM) > the
    ``X-Tokenmill-Priority`` header > ``serve.priority``; a number (digits, in the header) is
    a lane, a string a lane's name. The timeout is the client's (``X-Tokenmill-Timeout``, else the
    openai SDK's ``X-Stainless-Read-Timeout``), at most ``serve.request_timeout_s``.

    Raises:
        APIError: 400 for a priority that is neither a name nor a lane number, or a malformed
            timeout header (an unknown name or lane is the submit's 400).
    """
    config = state_of(request).config
    priority = body.pop("priority", None)
    if priority is None:
        header = request.headers.get(PRIORITY_HEADER)
        priority = _header_priority(header) if header else config.priority
    elif isinstance(priority, bool) or not isinstance(priority, (str, int)):
        raise APIError(400, f"priority must be a lane name or number, got a {type(priority).__name__}",
                       param="priority")
    request_id: str = request.state.request_id
    return CallContext(request_id, priority, min(config.request_timeout_s, _client_timeout_s(request)), time.time())


def _header_priority(header: str) -> str | int:
    """A lane number when the header is digits, else a lane name (checked by the submit)."""
    try:
        return int(header) if header.isdigit() else header
    except ValueError:  # NOTE: "²".isdigit() is True, yet int("²") raises; so does int() past 4300 digits
        return header


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
