"""Shared plumbing of the ``tokenmill`` commands: global options, config errors, producers.

Imports producer (client, config) only; never the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import typer
from pydantic import ValidationError

from producer.client import Producer
from producer.config import ProducerConfig, RedisConfig
from producer.errors import ProducerError


@dataclass(frozen=True)
class CliState:
    """Global options (``tokenmill --redis-url ... --prefix ... --queue ... COMMAND``); None = default."""

    redis_url: str | None = None  # else REDIS_URL, else the embedded Redis
    prefix: str | None = None
    queue: str | None = None
    num_lanes: int | None = None


def state_of(ctx: typer.Context) -> CliState:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, CliState) else CliState()


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


def producer_config(state: CliState) -> ProducerConfig:
    """The producer settings of the global options, field by field on error (exit 1)."""
    values: dict[str, object] = {"redis": {"url": state.redis_url}}
    for name in ("prefix", "queue", "num_lanes"):
        value = getattr(state, name)
        if value is not None:
            values[name] = value
    try:
        return ProducerConfig.model_validate(values)
    except ValidationError as exc:
        raise validation_exit(exc) from None


@contextmanager
def open_producer(ctx: typer.Context) -> Iterator[Producer]:
    """A connected producer for the global options; Redis problems exit 1 with the reason."""
    config = producer_config(state_of(ctx))
    try:
        producer = Producer.from_config(config)
    except ProducerError as exc:
        raise fail(f"error: {exc}") from None
    try:
        yield producer
    finally:
        producer.close()


def redis_config(state: CliState) -> RedisConfig:
    try:
        return RedisConfig(url=state.redis_url)
    except ValidationError as exc:
        raise validation_exit(exc) from None
