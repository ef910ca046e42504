"""``tokenmill dashboard``: the web dashboard alone (``tokenmill serve`` has it at ``/dashboard`` too), for a fleet
without the HTTP front. A thin command over :func:`serve.dashboard.standalone.run_dashboard`; the server (fastapi,
uvicorn) is imported inside the command only, so ``--help`` and the other commands never pay for it.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from tokenmill.cli.common import CliState, QueueOption, app, fail, or_exit, with_queue
from tokenmill.producer.config import ServeSettings
from tokenmill.protocol.errors import ProducerError, RedisUnavailable

REDIS_UNREACHABLE_EXIT = 2  # Redis cannot be reached at start (any other failure: 1)


@app.command()
def dashboard(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option(help="address to bind (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8000)")] = None,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", help="key that may look (repeatable; default: the serve section's api_keys)")] = None,
    admin_api_key: Annotated[list[str] | None, typer.Option(
        "--admin-api-key", help="key that may also replay, discard and cancel (repeatable; default: the serve "
        "section's admin_api_keys)")] = None,
    dashboard_public: Annotated[bool | None, typer.Option(
        "--dashboard-public/--dashboard-private", help="let anyone look without a key (changes still need an "
        "admin key)")] = None,
    log_level: Annotated[str | None, typer.Option(help="critical, error, warning, info or debug")] = None,
    queue: QueueOption = None,
) -> None:
    """Serve the web dashboard of the queue at http://HOST:PORT/dashboard (lanes, workers, jobs, requests, dead
    letters), read from Redis only. Without any key configured everyone may look and change things."""
    try:
        from tokenmill.serve.dashboard.standalone import run_dashboard  # noqa: PLC0415 - keeps --help light
    except ImportError as exc:
        raise fail(f"error: tokenmill dashboard needs the serve extra: pip install 'tokenmill[serve]' ({exc})"
                   ) from None
    with_queue(ctx, queue)
    state: CliState = ctx.obj
    overrides: dict[str, Any] = {**state.overrides, "serve": {
        "host": host, "port": port, "api_keys": api_key, "admin_api_keys": admin_api_key,
        "dashboard_public": dashboard_public, "log_level": log_level}}
    settings = or_exit(lambda: ServeSettings.load(state.config_file, overrides), ServeSettings)
    try:
        run_dashboard(settings)
    except RedisUnavailable as exc:
        typer.echo(f"error: {exc} (is Redis running there? set REDIS_URL or --redis-url)", err=True)
        raise typer.Exit(code=REDIS_UNREACHABLE_EXIT) from None
    except ProducerError as exc:
        raise fail(f"error: {exc}") from None
