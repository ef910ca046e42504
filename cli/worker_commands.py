"""``tokenmill worker`` and ``tokenmill demo``: thin commands over :mod:`worker.runtime` and
:func:`cli.demo.run_demo`.

The worker (and through it the engine) is imported inside the commands only, so ``--help``
and the client commands never pay for it.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

from tokenmill.cli.common import CliState, QueueOption, app, client_settings, fail, or_exit, with_queue
from tokenmill.cli.engine_flags import NO_FLAGS, EngineFlags, load_worker_settings, merge, with_engine_flags


@app.command()
@with_engine_flags
def worker(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(help="model alias, HF id, path, or 'echo'")] = None,
    name: Annotated[str | None, typer.Option(help="consumer name (default host-pid-random)")] = None,
    max_waiting: Annotated[int | None, typer.Option(help="backpressure high-water mark")] = None,
    drain_timeout: Annotated[float | None, typer.Option("--drain-timeout", help="seconds to drain on SIGTERM")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="serve /metrics, /health and /ready on this port")] = None,
    log_json: Annotated[bool | None, typer.Option("--log-json/--log-text", help="JSON log lines")] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING or ERROR")] = None,
    burst: Annotated[bool, typer.Option(help="exit when every lane is empty and nothing is in flight")] = False,
    role: Annotated[str | None, typer.Option(help="both, prefill or decode: prefill workers compute prompts and "
                                             "hand requests to decode workers (needs --fleet-cache)")] = None,
    fleet_cache: Annotated[bool | None, typer.Option("--fleet-cache/--no-fleet-cache",
                                                     help="share prompt KV blocks across the fleet through Redis")
                           ] = None,
    queue: QueueOption = None,
    engine_flags: EngineFlags = NO_FLAGS,
) -> None:
    """Serve one queue: read requests, run them on the engine, write results."""
    from tokenmill.worker.errors import StartupError  # noqa: PLC0415 - as above
    from tokenmill.worker.runtime import run_worker  # noqa: PLC0415 - as above: loads the engine

    with_queue(ctx, queue)
    state: CliState = ctx.obj
    overrides: dict[str, Any] = {
        **state.overrides,
        "worker": {"name": name, "max_waiting": max_waiting, "drain_timeout_s": drain_timeout,
                   "metrics_port": metrics_port, "log_json": log_json, "log_level": log_level, "role": role},
        "engine": {"model": {"name": model}, "fleet_cache": {"enabled": fleet_cache}},
    }
    settings = load_worker_settings(state.config_file, merge(overrides, engine_flags.overrides()))
    try:
        code = or_exit(lambda: run_worker(settings, burst=burst))
    except StartupError as exc:
        raise fail(f"error: {exc}") from None
    raise typer.Exit(code=code)


@app.command()
def demo(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="model alias, HF id, local dir, or 'echo'")] = "smollm2-135m",
    num_prompts: Annotated[int, typer.Option(min=1, max=64, help="how many prompts to send")] = 8,
    max_tokens: Annotated[int, typer.Option(min=1, help="most tokens per completion")] = 64,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    timeout: Annotated[float, typer.Option(help="seconds to wait for all results")] = 600.0,
) -> None:
    """Run a worker on a demo queue and send it a few chat prompts (embedded Redis if none is set)."""
    from tokenmill.cli.demo import run_demo  # noqa: PLC0415 - keeps --help and the client commands light

    settings = client_settings(ctx)
    report = or_exit(lambda: run_demo(Console(highlight=False), redis_url=settings.redis.url, model=model,
                                      num_prompts=num_prompts, max_tokens=max_tokens, device=device,
                                      prefix=settings.queue.prefix, timeout_s=timeout))
    if report.num_ok < report.num_requests:
        raise typer.Exit(code=1)
