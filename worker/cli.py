"""The ``tokenmill`` command line (typer ``app``): global options and the ``worker`` command;
the other commands live in ``worker/cli_*.py`` and ``worker/demo.py`` and are registered here.

Thin commands over :func:`worker.config.load_settings` and the producer; imports the engine
only through the worker, lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from worker import cli_bulk, cli_client, cli_dead, demo
from worker.cli_common import CliState, fail, state_of
from worker.cli_redis import redis_app
from worker.config import Settings, load_settings
from worker.errors import ConfigError, WorkerError
from worker.logs import setup_logging

app = typer.Typer(help="tokenmill: Redis Streams in, continuous batching, results out.", no_args_is_help=True)

__all__ = ["app", "fail", "settings_or_exit"]


@app.callback()
def main(
    ctx: typer.Context,
    redis_url: Annotated[str | None, typer.Option(
        "--redis-url", envvar=["TOKENMILL_REDIS_URL", "REDIS_URL"],
        help="redis://, rediss:// or unix:// URL (default: the embedded Redis)")] = None,
    prefix: Annotated[str | None, typer.Option(envvar="TOKENMILL_PREFIX", help="key prefix [default: tokenmill]")] = None,
    queue: Annotated[str | None, typer.Option(envvar="TOKENMILL_QUEUE", help="queue name [default: default]")] = None,
    lanes: Annotated[int | None, typer.Option(envvar="TOKENMILL_LANES", help="priority lanes [default: 3]")] = None,
) -> None:
    """tokenmill: Redis Streams in, continuous batching, results out."""
    ctx.obj = CliState(redis_url=redis_url, prefix=prefix, queue=queue, num_lanes=lanes)


app.command("submit")(cli_client.submit)
app.command("result")(cli_client.result)
app.command("cancel")(cli_client.cancel)
app.command("status")(cli_client.status)
app.command("dead")(cli_dead.dead)
app.command("bulk")(cli_bulk.bulk_command)
app.command("demo")(demo.demo)
app.add_typer(redis_app, name="redis")


def settings_or_exit(config: Path | None, overrides: dict[str, dict[str, Any]]) -> Settings:
    """Load settings, or print every invalid field on its own line and exit with code 1."""
    try:
        return load_settings(config, overrides)
    except ConfigError as exc:
        raise fail(f"error: {exc}") from None
    except ValidationError as exc:
        lines = [f"invalid configuration ({exc.error_count()} error(s)):"]
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            lines.append(f"  {where}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err else ""))
        raise fail("\n".join(lines)) from None


@app.command()
def worker(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file")] = None,
    model: Annotated[str | None, typer.Option(help="model alias, HF id, path, or 'echo'")] = None,
    queue: Annotated[str | None, typer.Option(help="queue name")] = None,
    prefix: Annotated[str | None, typer.Option(help="key prefix")] = None,
    redis_url: Annotated[str | None, typer.Option("--redis-url", help="redis://, rediss:// or unix:// URL")] = None,
    name: Annotated[str | None, typer.Option(help="consumer name (default host-pid-random)")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda")] = None,
    max_waiting: Annotated[int | None, typer.Option(help="backpressure high-water mark")] = None,
    drain_timeout: Annotated[float | None, typer.Option("--drain-timeout", help="seconds to drain on SIGTERM")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="serve Prometheus metrics on this port")] = None,
    log_json: Annotated[bool | None, typer.Option("--log-json/--log-text", help="JSON log lines")] = None,
    burst: Annotated[bool, typer.Option(help="exit when every lane is empty and nothing is in flight")] = False,
) -> None:
    """Serve one queue: read requests, run them on the engine, write results."""
    state = state_of(ctx)
    overrides: dict[str, dict[str, Any]] = {
        "worker": {"queue": queue or state.queue, "prefix": prefix or state.prefix, "num_lanes": state.num_lanes,
                   "name": name, "max_waiting": max_waiting,
                   "drain_timeout_s": drain_timeout, "metrics_port": metrics_port, "log_json": log_json},
        "engine": {"model": model, "device": device},
        "redis": {"url": redis_url or state.redis_url},
    }
    settings = settings_or_exit(config, overrides)
    setup_logging(settings.worker.log_level, settings.worker.log_json)
    from worker.runtime import Worker  # noqa: PLC0415 - keeps --help fast

    try:
        code = Worker(settings, burst=burst).run()
    except WorkerError as exc:
        raise fail(f"error: {exc}") from None
    raise typer.Exit(code=code)
