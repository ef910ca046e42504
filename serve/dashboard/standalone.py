"""``tokenmill dashboard``: the dashboard alone, for a fleet without the HTTP front. The same routes, keys and
settings (``[serve]``) as under ``tokenmill serve``; no OpenAI API. ``/health`` answers 200 while Redis answers.

Imports fastapi, uvicorn and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.producer.config import ServeSettings
from tokenmill.protocol.connection import connect
from tokenmill.serve.dashboard import mount
from tokenmill.serve.dashboard.state import dashboard_of
from tokenmill.serve.guard import Guard
from tokenmill.serve.logs import setup_logging

HEALTH_TIMEOUT_S = 2.0


def create_app(settings: ServeSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield

    app = FastAPI(title="tokenmill dashboard", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health(request: Request) -> Response:
        try:
            await asyncio.wait_for(dashboard_of(request).client.ping(), HEALTH_TIMEOUT_S)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    mount(app, settings)
    app.add_middleware(Guard, config=settings.serve)  # NOTE: request ids and body limits; /dashboard checks keys itself
    return app


def server_config(settings: ServeSettings) -> uvicorn.Config:
    config = settings.serve
    return uvicorn.Config(create_app(settings), host=config.host, port=config.port, log_level=config.log_level,
                          log_config=None, access_log=False, timeout_keep_alive=config.keep_alive_timeout_s,
                          limit_concurrency=config.max_connections)


def run_dashboard(settings: ServeSettings) -> None:
    """Check that Redis answers, then serve the dashboard until interrupted.

    Raises:
        RedisUnavailable: Redis cannot be reached, before the server starts.
    """
    setup_logging(settings.serve)
    connect(settings.producer_config.redis).close()
    uvicorn.Server(server_config(settings)).run()
