"""The ASGI app of ``tokenmill serve`` and the uvicorn server that runs it.

Imports fastapi, uvicorn and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI

from tokenmill.producer.aio import AsyncProducer
from tokenmill.producer.client import Producer
from tokenmill.producer.config import ServeSettings
from tokenmill.protocol.connection import connect
from tokenmill.serve import batches, completions, dashboard, files, models, ops
from tokenmill.serve.batch_runner import BatchRunner
from tokenmill.serve.batch_store import BatchStore
from tokenmill.serve.context import ServeState
from tokenmill.serve.errors import install_handlers
from tokenmill.serve.files import FileStore
from tokenmill.serve.guard import Guard
from tokenmill.serve.live_models import LiveModels
from tokenmill.serve.logs import AccessLog, Traffic, setup_logging
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
            loop = asyncio.get_running_loop()
            background = [loop.create_task(runner.adopt_orphans())]
            if settings.serve.throughput_log_s > 0:
                background.append(loop.create_task(traffic.report_every(settings.serve.throughput_log_s)))
            try:
                yield
            finally:
                for task in background:
                    task.cancel()
                await runner.close()
                sync_producer.close()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    for module in (completions, models, files, batches, ops):
        app.include_router(module.router)
    dashboard.mount(app, settings)  # /dashboard (serve/dashboard/)
    app.state.metrics = metrics = ServeMetrics()
    app.state.traffic = traffic = Traffic()
    # NOTE: the last added runs first: metrics count and the access log logs what the guard refuses too.
    app.add_middleware(Guard, config=settings.serve)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(AccessLog, traffic=traffic)
    return app


def server_config(settings: ServeSettings) -> uvicorn.Config:
    """uvicorn's settings for the app: h11 with the header timeout, keep-alive, connection cap. Its
    loggers keep the process's handlers (serve/logs.py), and the access log is the app's own."""
    config = settings.serve
    return uvicorn.Config(create_app(settings), host=config.host, port=config.port, log_level=config.log_level,
                          log_config=None, access_log=False, http=with_header_timeout(config.header_timeout_s),
                          timeout_keep_alive=config.keep_alive_timeout_s, limit_concurrency=config.max_connections)


def run_server(settings: ServeSettings, *, on_server: Callable[[uvicorn.Server], None] | None = None) -> None:
    """Log as ``[serve]`` says, check that Redis answers, then serve until interrupted (uvicorn
    handles SIGINT / SIGTERM).

    Args:
        on_server: given the server before it runs (``tokenmill serve --model`` stops it from another
            thread when its in-process worker fails).

    Raises:
        RedisUnavailable: Redis cannot be reached (after ``[redis] connect_retries``), before the
            server starts: nothing else is printed.
    """
    setup_logging(settings.serve)
    connect(settings.producer_config.redis).close()  # NOTE: uvicorn would print its traceback, three deep
    server = uvicorn.Server(server_config(settings))
    if on_server is not None:
        on_server(server)
    server.run()
