"""The ``tokenmill`` app object, its global options and the plumbing its commands share: settings
loaded from ``--config`` > env > defaults with flags on top, errors printed field by field.

Imports producer only; never the worker or the engine.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from tokenmill.producer.client import Producer
from tokenmill.producer.config import ClientSettings
from tokenmill.protocol.errors import ProducerError
from tokenmill.protocol.version import package_version

T = TypeVar("T")

app = typer.Typer(help="tokenmill: Redis Streams in, continuous batching, results out.\n\n"
                  "Settings: flags > env (TOKENMILL_<SECTION>__<KEY>, REDIS_URL) > --config file > defaults.",
                  no_args_is_help=True)


@dataclass(frozen=True)
class CliState:
    """The global options: a settings file and the flags that override it (None = not given)."""

    config_file: Path | None = None
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)


def _print_version(is_asked: bool) -> None:
    if is_asked:
        typer.echo(f"tokenmill {package_version()}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    _version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="print tokenmill's version and exit")] = False,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="TOML settings file; one file serves workers and clients")] = None,
    redis_url: Annotated[str | None, typer.Option(
        "--redis-url", help="redis://, rediss:// or unix:// URL (else REDIS_URL, else the embedded Redis)")] = None,
    prefix: Annotated[str | None, typer.Option(help="key prefix (default tokenmill)")] = None,
    queue: Annotated[str | None, typer.Option(
        help="queue name (default: default); also taken after the command")] = None,
    lanes: Annotated[int | None, typer.Option(help="priority lanes (default 3)")] = None,
) -> None:
    """The global options, kept for the command that runs."""
    ctx.obj = CliState(config, {"redis": {"url": redis_url},
                                "queue": {"prefix": prefix, "name": queue, "num_lanes": lanes}})


# ``--queue`` after the command (``tokenmill status --queue q``) as well as before it.
QueueOption = Annotated[str | None, typer.Option(
    "--queue", help="queue name (the global --queue, given after the command; this one wins)")]


def with_queue(ctx: typer.Context, queue: str | None) -> None:
    """Put a command's own ``--queue`` into the global options (it wins over one given before the command)."""
    if queue is None:
        return
    state: CliState = ctx.obj
    overrides = {**state.overrides, "queue": {**state.overrides.get("queue", {}), "name": queue}}
    ctx.obj = replace(state, overrides=overrides)


def fail(message: str) -> typer.Exit:
    """Print ``message`` to stderr; the returned ``Exit`` (code 1) is for the caller to raise."""
    typer.echo(message, err=True)
    return typer.Exit(code=1)


def validation_exit(exc: ValidationError, what: str = "configuration",
                    model: type[BaseModel] | None = None, flags: Mapping[str, str] | None = None) -> typer.Exit:
    """Every invalid field on its own line (a single one: one line in all); an unknown key of
    ``model`` with the nearest known key; a field a flag sets, with the flag (``flags``: dotted
    field -> flag); exit code 1."""
    clauses = [_describe(err, what, model, flags or {}) for err in exc.errors()]
    if len(clauses) == 1:
        return fail(f"invalid {what}: {clauses[0]}")
    return fail("\n".join([f"invalid {what} ({len(clauses)} errors):", *(f"  {clause}" for clause in clauses)]))


def _describe(err: ErrorDetails, what: str, model: type[BaseModel] | None, flags: Mapping[str, str]) -> str:
    where = ".".join(str(p) for p in err["loc"]) or what
    where = f"{where} ({flags[where]})" if where in flags else where
    clause = f"{where}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err else "")
    nearest = _nearest_key(model, err["loc"]) if model is not None and err["type"] == "extra_forbidden" else None
    return clause if nearest is None else f"{clause}; did you mean {nearest!r}?"


def _nearest_key(model: type[BaseModel], loc: tuple[int | str, ...]) -> str | None:
    """The known key (dotted, as ``loc``) closest to the unknown one at ``loc``, or None."""
    for part in loc[:-1]:
        info = model.model_fields.get(str(part))
        annotation = info.annotation if info is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    matches = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return ".".join([*(str(p) for p in loc[:-1]), matches[0]]) if matches else None


def or_exit(call: Callable[[], T], model: type[BaseModel] | None = None) -> T:
    """``call()``, or exit 1 saying why: a producer-side error (an unreadable settings file,
    Redis unreachable, a wait that ran out) or every invalid field on its own line (an unknown
    key of ``model``, the settings ``call`` loads, with the nearest known key)."""
    try:
        return call()
    except ProducerError as exc:
        raise fail(f"error: {exc}") from None
    except ValidationError as exc:
        raise validation_exit(exc, model=model) from None


def client_settings(ctx: typer.Context) -> ClientSettings:
    """The ``[redis]`` and ``[queue]`` settings of the global options, once the whole deployment's
    settings pass :func:`check_deployment_settings`."""
    state: CliState = ctx.obj
    check_deployment_settings(state)
    return or_exit(lambda: ClientSettings.load(state.config_file, state.overrides), ClientSettings)


def check_deployment_settings(state: CliState) -> None:
    """Exit 1 as the worker would on these settings (file, env and flags): every section checked
    against the worker's schema, an unknown key with the nearest known one.

    NOTE: a client reads only ``[redis]``, ``[queue]`` (and ``[worker] stale_after_s``), but a file
    one command accepts must not be refused by the next one (a worker) on a typo the first let by.
    ``worker.config`` is pydantic only (it loads the engine's config models, never torch: measured
    with ``python -X importtime``, ~60 ms), imported here so ``--help`` and ``tokenmill redis`` pay nothing.
    """
    from tokenmill.worker.config import Settings  # noqa: PLC0415 - the worker's schema; loads no torch

    or_exit(lambda: Settings.load(state.config_file, state.overrides), Settings)


@contextmanager
def open_producer(ctx: typer.Context) -> Iterator[Producer]:
    """A connected producer for the global options; Redis problems exit 1 with the reason."""
    config = client_settings(ctx).producer_config
    # NOTE: the commands warn on stderr themselves (warn_without_workers), not through the producer's log
    producer = or_exit(lambda: Producer.from_config(config, check_workers=False))
    try:
        yield producer
    finally:
        producer.close()


def warn_without_workers(ctx: typer.Context, producer: Producer, model: str | None = None) -> None:
    """One line on stderr when no live worker serves the producer's queue, or ``model`` on it (the
    requests wait for one)."""
    stale_after_s = client_settings(ctx).worker.stale_after_s
    stats = or_exit(lambda: producer.stats(stale_after_s=stale_after_s))
    if stats["num_live_workers"] == 0:
        typer.echo(f"warning: no live worker serves queue {producer.keys.base}; requests wait until one starts "
                   "(tokenmill worker)", err=True)
    elif model is not None and all(model not in beat["model_names"] for beat in stats["workers"].values()):
        typer.echo(f"warning: no live worker serves model {model!r} on queue {producer.keys.base}; the request "
                   "waits until one starts", err=True)
