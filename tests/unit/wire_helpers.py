"""Wire fields as a worker reads them, for the schema and intake tests."""

from __future__ import annotations

from typing import Any


def as_redis_returns(fields: dict[str, Any]) -> dict[bytes, bytes]:
    """Stream fields the way redis-py hands them to a worker: bytes keys and values."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}
