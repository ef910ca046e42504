"""The ``tokenmill`` app object, its global options and the plumbing its commands share: settings
loaded from ``--config`` > env > defaults with flags on top, errors printed field by field.

Imports producer only; never the worker or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from producer.client import Producer
from producer.config import ClientSettings
from producer.errors import ProducerError

T = TypeVar("T")

app = typer.Typer(help="tokenmill: Redis Streams in, continuous batching, results out.\n\n"
                  "Settings: flags > env (TOKENMILL_<SECTION>__<KEY>, REDIS_URL) > --config file > defaults.",
                  no_args_is_help=True)


@dataclass(frozen=True)
class CliState:
    """The global options: a settings file and the flags that override it (None = not given)."""

    config_file: Path | None = None
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)


@app.callback()
def main(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="TOML settings file; one file serves workers and clients")] = None,
    redis_url: Annotated[str | None, typer.Option(
        "--redis-url", help="redis://, rediss:// or unix:// URL (else REDIS_URL, else the embedded Redis)")] = None,
    prefix: Annotated[str | None, typer.Option(help="key prefix (default tokenmill)")] = None,
    queue: Annotated[str | None, typer.Option(help="queue name (default: default)")] = None,
    lanes: Annotated[int | None, typer.Option(help="priority lanes (default 3)")] = None,
) -> None:
    """The global options, kept for the command that runs."""
    ctx.obj = CliState(config, {"redis": {"url": redis_url},
                                "queue": {"prefix": prefix, "name": queue, "num_lanes": lanes}})


def fail(message: str) -> typer.Exit:
    """Print ``message`` to stderr; the returned ``Exit`` (code 1) is for the caller to raise."""
    typer.echo(message, err=True)
    return typer.Exit(code=1)


def validation_exit(exc: ValidationError, what: str = "configuration") -> typer.Exit:
    """Every invalid field on its own line; exit code 1."""
    lines = [f"invalid {what} ({exc.error_count()} error(s)):"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or what
        lines.append(f"  {where}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err else ""))
    return fail("\n".join(lines))


def or_exit(call: Callable[[], T]) -> T:
    """``call()``, or exit 1 saying why: a producer-side error (an unreadable settings file,
    Redis unreachable, a wait that ran out) or every invalid field on its own line."""
    try:
        return call()
    except ProducerError as exc:
        raise fail(f"error: {exc}") from None
    except ValidationError as exc:
        raise validation_exit(exc) from None


def client_settings(ctx: typer.Context) -> ClientSettings:
    """The ``[redis]`` and ``[queue]`` settings of the global options."""
    state: CliState = ctx.obj
    return or_exit(lambda: ClientSettings.load(state.config_file, state.overrides))


@contextmanager
def open_producer(ctx: typer.Context) -> Iterator[Producer]:
    """A connected producer for the global options; Redis problems exit 1 with the reason."""
    config = client_settings(ctx).producer_config
    producer = or_exit(lambda: Producer.from_config(config))
    try:
        yield producer
    finally:
        producer.close()
