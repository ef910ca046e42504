"""``tokenmill redis start|status|stop``: the embedded Redis (protocol.embedded_redis). Never imports the worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from tokenmill.cli.common import app, fail
from tokenmill.protocol import embedded_redis
from tokenmill.protocol.errors import RedisUnavailable

redis_app = typer.Typer(help="Start, inspect or stop the embedded Redis (unix socket, persisted).",
                        no_args_is_help=True)
app.add_typer(redis_app, name="redis")

DirOption = Annotated[Path | None, typer.Option("--dir", help="data dir (default $TOKENMILL_HOME/redis)")]


def _show(current: embedded_redis.EmbeddedStatus, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"running": current.is_running, "pid": current.pid, "version": current.version,
                               "url": current.url, "data_dir": str(current.data_dir)}))
    elif current.is_running:
        typer.echo(f"running: Redis {current.version} pid {current.pid}\nurl: {current.url}")
    else:
        typer.echo(f"not running (data dir {current.data_dir})")


@redis_app.command("start")
def start(directory: DirOption = None,
          as_json: Annotated[bool, typer.Option("--json", help="print the server's state as JSON")] = False) -> None:
    """Start the embedded Redis (or reuse the running one) and print its URL."""
    try:
        _show(embedded_redis.start(directory), as_json)
    except RedisUnavailable as exc:
        raise fail(f"error: {exc}") from None


@redis_app.command("status")
def status(directory: DirOption = None,
           as_json: Annotated[bool, typer.Option("--json", help="print the server's state as JSON")] = False) -> None:
    """Whether the embedded Redis runs (exit 1 if not)."""
    current = embedded_redis.status(directory)
    _show(current, as_json)
    if not current.is_running:
        raise typer.Exit(code=1)


@redis_app.command("stop")
def stop(directory: DirOption = None) -> None:
    """Stop the embedded Redis after saving its data."""
    try:
        was_running = embedded_redis.stop(directory)
    except RedisUnavailable as exc:
        raise fail(f"error: {exc}") from None
    typer.echo("stopped" if was_running else "was not running")
