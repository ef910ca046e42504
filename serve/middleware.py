"""What the server's ASGI middlewares (serve/guard.py, serve/logs.py, serve/metrics.py) share: a base that
passes every scope but an HTTP request (the lifespan) straight through, and a ``send`` that notes the
status of the response it passes on.

Imports starlette (through fastapi) only; never torch, the engine or the worker.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HttpMiddleware:
    """An ASGI middleware that acts on HTTP requests alone (:meth:`handle`); other scopes reach ``app`` untouched.

    Args:
        app: the app behind it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One HTTP request, on its way to ``self.app``."""
        raise NotImplementedError


class StatusNoted:
    """``send`` of one request that notes the status its response starts with.

    Args:
        send: the server's ``send``.
    """

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 500  # what Starlette answers when the app raises before responding

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)
