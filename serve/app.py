"""The ASGI app of ``tokenmill serve`` and the uvicorn server that runs it.

Imports fastapi, uvicorn and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI

from tokenmill.producer.aio import AsyncProducer
from tokenmill.producer.client import Producer
from tokenmill.producer.config import ServeSettings
from tokenmill.serve import batches, completions, files, models, ops
from tokenmill.serve.batch_runner import BatchRunner
from tokenmill.serve.batch_store import BatchStore
from tokenmill.serve.context import ServeState
from tokenmill.serve.errors import install_handlers
from tokenmill.serve.files import FileStore
from tokenmill.serve.guard import Guard
from tokenmill.serve.live_models import LiveModels
from tokenmill.serve.metrics import MetricsMiddleware, ServeMetrics
from tokenmill.serve.protocol import with_header_timeout


def create_app(settings: ServeSettings) -> FastAPI:
    """The OpenAI-compatible app over the queue of ``settings``; it connects to Redis at start-up.

    Raises (at start-up):
        RedisUnavailable: Redis cannot be reached.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        config = settings.producer_config
        async with AsyncProducer.from_config(config) as producer:
            sync_producer = await asyncio.to_thread(Producer.from_config, config)
            client = await producer.connect()
            live_models = LiveModels(client, config.keys, settings.worker.stale_after_s)
            app.state.serve = ServeState(settings.serve, producer, live_models)
            app.state.files = file_store = FileStore(client, config.keys, settings.serve.file_ttl_s)
            app.state.batches = batch_store = BatchStore(client, config.keys, settings.serve.file_ttl_s)
            owner = f"serve-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
            app.state.batch_runner = runner = BatchRunner(batch_store, file_store, sync_producer, live_models,
                                                          settings.serve, owner)
            orphans = asyncio.get_running_loop().create_task(runner.adopt_orphans())
            try:
                yield
            finally:
                orphans.cancel()
                await runner.close()
                sync_producer.close()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    for module in (completions, models, files, batches, ops):
        app.include_router(module.router)
    app.state.metrics = metrics = ServeMetrics()
    # NOTE: the last added runs first: metrics count what the guard refuses too.
    app.add_middleware(Guard, config=settings.serve)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def server_config(settings: ServeSettings) -> uvicorn.Config:
    """uvicorn's settings for the app: h11 with the header timeout, keep-alive, connection cap."""
    config = settings.serve
    return uvicorn.Config(create_app(settings), host=config.host, port=config.port, log_level=config.log_level,
                          access_log=config.log_level == "debug", http=with_header_timeout(config.header_timeout_s),
                          timeout_keep_alive=config.keep_alive_timeout_s, limit_concurrency=config.max_connections)


def run_server(settings: ServeSettings) -> None:
    """Serve until interrupted (uvicorn handles SIGINT / SIGTERM)."""
    uvicorn.Server(server_config(settings)).run()
