"""The edge every HTTP request passes before any route runs: its request id, its API key, and the
limits on its body. An ASGI middleware, so it acts on the headers alone, before a byte of the body
is read:

- every request gets an id (``request.state.request_id``, answered as ``X-Request-Id``);
- outside :data:`PUBLIC_PATHS` and the dashboard (which checks keys and its session cookie itself), a missing
  or wrong ``Authorization: Bearer`` key is a 401 at once;
  the caller's account (a hash of its key, never the key) lands on ``request.state.account``;
- a ``Content-Length`` above the route's limit is a 413 at once; a body sent without one (chunked)
  is counted as it streams in and refused (413) the moment it passes the limit;
- a body that has not fully arrived ``serve.body_timeout_s`` after the request's head is a 408.

NOTE: authentication cannot be a FastAPI dependency: FastAPI parses declared body and form
parameters before it runs dependencies, so a 300 MB upload would be read before its 401.

Imports starlette (through fastapi) and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.protocol.config import ServeConfig
from tokenmill.protocol.schema import new_request_id
from tokenmill.serve.errors import REQUEST_ID_HEADER, APIError
from tokenmill.serve.middleware import HttpMiddleware

PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics"})  # probes and scrapers carry no API key
# The dashboard checks its callers itself (a Bearer key or its sign-in cookie: serve/dashboard/auth.py).
DASHBOARD_PATH = "/dashboard"
UPLOAD_PATH = "/v1/files"
ANONYMOUS = "anonymous"  # the one account of a server without api_keys


def account_of_key(key: str) -> str:
    """The account an API key owns files and batches as: its SHA-256, so Redis never holds a key."""
    return hashlib.sha256(key.encode()).hexdigest()


class Guard(HttpMiddleware):
    """The ASGI middleware described in the module docstring.

    Args:
        app: the app behind it.
        config: the ``[serve]`` settings (keys, body limits, body timeout).
    """

    def __init__(self, app: ASGIApp, config: ServeConfig) -> None:
        super().__init__(app)
        self.config = config

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.setdefault("state", {})
        state["request_id"] = request_id = new_request_id()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        headers = Headers(scope=scope)
        try:
            if scope["path"] not in PUBLIC_PATHS and not is_dashboard_path(scope["path"]):
                state["account"] = self._account(headers)
            body = LimitedBody(receive, *self._limit(scope, headers), self.config.body_timeout_s)
        except APIError as exc:
            await exc.response()(scope, receive, send_with_id)
            return
        await self.app(scope, body, send_with_id)

    def _account(self, headers: Headers) -> str:
        """The caller's account.

        Raises:
            APIError: 401 with OpenAI's ``invalid_api_key``.
        """
        keys = [*self.config.api_keys, *self.config.admin_api_keys]
        if not keys:
            return ANONYMOUS
        scheme, _, given = headers.get("authorization", "").partition(" ")
        given = given.strip()
        # NOTE: compare_digest against every key, not a set lookup: the time taken says nothing of a key.
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, key) for key in keys):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return account_of_key(given)

    def _limit(self, scope: Scope, headers: Headers) -> tuple[int, str]:
        """The route's body limit and the setting that sets it.

        Raises:
            APIError: 413 when ``Content-Length`` already says more.
        """
        is_upload = scope["method"] == "POST" and scope["path"] == UPLOAD_PATH
        limit, setting = ((self.config.max_upload_bytes, "max_upload_bytes") if is_upload
                          else (self.config.max_body_bytes, "max_body_bytes"))
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit, setting)
        return limit, setting


def is_dashboard_path(path: str) -> bool:
    return path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


def too_large(limit: int, setting: str) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (serve.{setting})",
                    code="request_too_large")


class LimitedBody:
    """``receive`` of one request, refusing a body past ``limit`` bytes or ``timeout_s`` after the head.

    Once the body is complete, messages (the disconnect) pass through with no time limit.
    """

    def __init__(self, receive: Receive, limit: int, setting: str, timeout_s: float) -> None:
        self._receive, self._limit, self._setting, self._timeout_s = receive, limit, setting, timeout_s
        self._deadline = asyncio.get_running_loop().time() + timeout_s
        self._received = 0
        self._is_complete = False

    async def __call__(self) -> Message:
        """The next message.

        Raises:
            APIError: 413 past the limit, 408 past the deadline.
        """
        if self._is_complete:
            return await self._receive()
        remaining_s = self._deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), timeout=max(remaining_s, 0.0))
        except asyncio.TimeoutError:  # NOTE: not the builtin TimeoutError before Python 3.11
            raise APIError(408, f"the request body did not arrive within {self._timeout_s:g} s "
                           "(serve.body_timeout_s)", type_="timeout_error", code="request_timeout") from None
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limit:
                raise too_large(self._limit, self._setting)
            self._is_complete = not message.get("more_body", False)
        else:  # the client went away: nothing more will come
            self._is_complete = True
        return message
