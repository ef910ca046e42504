"""``tokenmill serve``: the OpenAI-compatible HTTP front, a thin command over :func:`serve.app.run_server`.

The server (fastapi, uvicorn) is imported inside the command only, so ``--help`` and the other
commands never pay for it; it never imports the worker or the engine.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from tokenmill.cli.common import CliState, QueueOption, app, fail, or_exit, with_queue
from tokenmill.producer.config import ServeSettings


@app.command()
def serve(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option(help="address to bind (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8000)")] = None,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", help="accepted Bearer key (repeatable; default: the serve section's api_keys, else none)")] = None,
    log_level: Annotated[str | None, typer.Option(help="uvicorn log level")] = None,
    queue: QueueOption = None,
) -> None:
    """Serve the OpenAI API (chat, completions, streaming, models, files, batches) over the queue."""
    try:
        from tokenmill.serve.app import run_server  # noqa: PLC0415 - keeps --help and the other commands light
    except ImportError as exc:
        raise fail(f"error: tokenmill serve needs the serve extra: pip install 'tokenmill[serve]' ({exc})") from None
    with_queue(ctx, queue)
    state: CliState = ctx.obj
    overrides: dict[str, Any] = {**state.overrides,
                                 "serve": {"host": host, "port": port, "api_keys": api_key, "log_level": log_level}}
    settings = or_exit(lambda: ServeSettings.load(state.config_file, overrides), ServeSettings)
    or_exit(lambda: run_server(settings))
