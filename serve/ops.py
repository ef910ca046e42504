"""What operators and their tools ask a ``serve`` process, without an API key: ``GET /health``
(200 while Redis answers, else 503), ``GET /version`` and ``GET /metrics`` (Prometheus text).

Imports fastapi, redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

import redis.asyncio
from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill.serve.context import state_of
from tokenmill.serve.errors import redis_unavailable
from tokenmill.serve.metrics import ServeMetrics

HEALTH_TIMEOUT_S = 2.0  # a PING slower than this counts as no answer (a stalled Redis)
router = APIRouter()


def _version() -> str:
    try:
        return importlib.metadata.version("tokenmill")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


VERSION = _version()


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    """200 when the queue's Redis answers a PING within :data:`HEALTH_TIMEOUT_S`, else 503."""
    try:
        client = await state_of(request).producer.connect()
        await asyncio.wait_for(client.ping(), HEALTH_TIMEOUT_S)
    except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
        raise redis_unavailable(exc) from None
    return {"status": "ok"}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": VERSION}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry: ServeMetrics = request.app.state.metrics
    return Response(registry.render(), media_type=CONTENT_TYPE_LATEST)
