"""The web dashboard of ``tokenmill serve`` (``/dashboard``) and of ``tokenmill dashboard``: lanes, workers, jobs,
requests and dead letters, read from Redis only (docs/design.md, "The dashboard").

Imports fastapi, redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from tokenmill.producer.config import ServeSettings
from tokenmill.serve.dashboard import reads, routes
from tokenmill.serve.dashboard.state import DashboardState
from tokenmill.serve.dashboard.views import HERE


def mount(app: FastAPI, settings: ServeSettings) -> None:
    """Add the dashboard to ``app``: its routes, its static files, and its state opened and closed with the app
    (around the app's own lifespan)."""
    app.include_router(routes.router)
    app.mount("/dashboard/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with inner(app):
            app.state.dashboard = state = await DashboardState.open(settings, reads.sample_lanes)
            try:
                yield
            finally:
                await state.close()

    app.router.lifespan_context = lifespan
