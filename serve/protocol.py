"""uvicorn's h11 HTTP protocol with the one timeout uvicorn lacks: the request head's.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) and caps headers at h11's
16 KiB, but a connection that sends its head slowly, or nothing at all, is held forever (and a byte
after a response disarms the keep-alive timer). Here every connection waiting for a request head
(just opened, or its previous response ended) is closed when that head is not complete within
``serve.header_timeout_s``. The body's timeout is the guard's (:mod:`serve.guard`): the app sees
the body, not the head.

Imports uvicorn and h11; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutProtocol(H11Protocol):
    """:class:`H11Protocol` closing a connection whose request head takes over :attr:`header_timeout_s`."""

    header_timeout_s: ClassVar[float] = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_header()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in: the request runs
            self._stop_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request at once
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_header()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _await_header(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn's ``http=`` (uvicorn builds it with a fixed signature)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})
