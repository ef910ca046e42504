"""Keys under serve's namespaces that hold something serve never wrote (a string where a file's hash
belongs, written by hand or by another program): read as no object, so the caller gets a 404,
never a Redis ``WRONGTYPE`` error.

Imports redis; never torch, the engine or the worker.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import redis

T = TypeVar("T")


async def absent_if_stray(call: Awaitable[T]) -> T | None:
    """``await call``, or None when Redis answers that the key holds another type."""
    try:
        return await call
    except redis.ResponseError as exc:
        if str(exc).startswith("WRONGTYPE"):
            return None
        raise
