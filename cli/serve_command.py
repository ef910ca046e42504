"""``tokenmill serve``: the OpenAI-compatible HTTP front, a thin command over :func:`serve.app.run_server`; with
``--model M`` (or ``serve M``, as ``vllm serve M``) it also runs a worker of its own (cli/local_worker.py).

The server (fastapi, uvicorn) is imported inside the command only, so ``--help`` and the other
commands never pay for it; without ``--model`` it never imports the worker or the engine.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tokenmill.cli.common import CliState, QueueOption, app, fail, or_exit, with_queue
from tokenmill.cli.engine_flags import NO_FLAGS, EngineFlags, with_engine_flags
from tokenmill.cli.local_worker import (
    LocalWorker,
    local_worker_settings,
    refuse_engine_flags_without_model,
    use_embedded_redis_if_unset,
)
from tokenmill.producer.client import Producer
from tokenmill.producer.config import ServeSettings
from tokenmill.protocol.errors import ProducerError, RedisUnavailable

if TYPE_CHECKING:
    import uvicorn

    from tokenmill.worker.config import Settings

REDIS_UNREACHABLE_EXIT = 2  # Redis cannot be reached at start (any other failure: 1)
STOP_GRACE_S = 5  # --model: the worker failed; the open requests' grace before they are cut
HEARTBEAT_WAIT_S = 60.0  # --model: the port opens once the worker's heartbeat is in Redis, or after this
# uvicorn's levels -> the worker's (serve --model --log-level sets both)
WORKER_LOG_LEVELS = {"critical": "ERROR", "error": "ERROR", "warning": "WARNING", "info": "INFO", "debug": "DEBUG",
                     "trace": "DEBUG"}

log = logging.getLogger("tokenmill.cli")


@app.command()
@with_engine_flags
def serve(
    ctx: typer.Context,
    model_tag: Annotated[str | None, typer.Argument(
        metavar="[MODEL]", show_default=False, help="the same as --model (vllm serve MODEL)")] = None,
    model: Annotated[str | None, typer.Option(help="also run a worker of this model in this process (alias, HF "
                                              "id, path or 'echo'); the embedded Redis if none is set")] = None,
    host: Annotated[str | None, typer.Option(help="address to bind (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8000)")] = None,
    api_key: Annotated[list[str] | None, typer.Option(
        "--api-key", help="accepted Bearer key (repeatable; default: the serve section's api_keys, else none)")] = None,
    log_level: Annotated[str | None, typer.Option(
        help="critical, error, warning, info (a line per request) or debug")] = None,
    log_json: Annotated[bool | None, typer.Option("--log-json/--log-text", help="JSON log lines")] = None,
    dashboard_public: Annotated[bool | None, typer.Option(
        "--dashboard-public/--dashboard-private", help="let anyone look at /dashboard without a key (replay, discard "
        "and cancel still need an admin key; default: the serve section's dashboard_public, else private)")] = None,
    queue: QueueOption = None,
    engine_flags: EngineFlags = NO_FLAGS,
) -> None:
    """Serve the OpenAI API (chat, completions, streaming, models, files, batches) over the queue.

    Without --model it sends to the workers serving the queue; with --model (or MODEL) it runs one of its own
    too, in this process, and opens the port once the model is loaded: one command, as vllm serve.
    """
    with_queue(ctx, queue)
    if model_tag is not None and model is not None and model_tag != model:
        raise fail(f"error: two models: {model_tag!r} and --model {model!r}; give one")
    model = model or model_tag
    serve_overrides = {"host": host, "port": port, "api_keys": api_key, "log_level": log_level, "log_json": log_json,
                       "dashboard_public": dashboard_public}
    if model is None:
        refuse_engine_flags_without_model(engine_flags, "tokenmill serve")
        _serve(ctx, serve_overrides, None)
        return
    worker = {"log_json": log_json, "log_level": WORKER_LOG_LEVELS.get((log_level or "").lower())}
    settings = local_worker_settings(ctx, model, engine_flags, worker)
    _serve(ctx, serve_overrides, settings)


def _serve(ctx: typer.Context, serve_overrides: dict[str, Any], worker_settings: Settings | None) -> None:
    """Run the server (with a worker of its own when ``worker_settings`` are given); exit 2 when Redis cannot
    be reached at start, 1 on any other failure."""
    try:
        from tokenmill.serve.app import run_server  # noqa: PLC0415 - keeps --help and the other commands light
    except ImportError as exc:
        raise fail(f"error: tokenmill serve needs the serve extra: pip install 'tokenmill[serve]' ({exc})") from None
    try:
        if worker_settings is None:
            run_server(_serve_settings(ctx, serve_overrides))
        else:
            _serve_with_worker(ctx, serve_overrides, worker_settings)
    except RedisUnavailable as exc:
        typer.echo(f"error: {exc} (is Redis running there? set REDIS_URL or --redis-url)", err=True)
        raise typer.Exit(code=REDIS_UNREACHABLE_EXIT) from None
    except ProducerError as exc:
        raise fail(f"error: {exc}") from None


def _serve_settings(ctx: typer.Context, serve_overrides: dict[str, Any]) -> ServeSettings:
    state: CliState = ctx.obj
    overrides: dict[str, Any] = {**state.overrides, "serve": serve_overrides}
    return or_exit(lambda: ServeSettings.load(state.config_file, overrides), ServeSettings)


def _serve_with_worker(ctx: typer.Context, serve_overrides: dict[str, Any], worker_settings: Settings) -> None:
    """Load the model, start the worker, open the port once its heartbeat is in Redis; on SIGTERM / SIGINT the
    server stops first (its open requests still answered), then the worker drains; a second signal stops the
    worker at once. The worker's failure stops the server (its open requests cut after :data:`STOP_GRACE_S`) and
    exits 1 with one line.

    Raises:
        RedisUnavailable: Redis cannot be reached (or the embedded one would not start).
    """
    from tokenmill.serve.app import run_server  # noqa: PLC0415 - as above
    from tokenmill.worker.errors import StartupError  # noqa: PLC0415 - the worker is loaded here anyway
    from tokenmill.worker.logs import setup_logging  # noqa: PLC0415 - as above

    setup_logging(worker_settings.worker.log_level, worker_settings.worker.log_json)
    settings = _serve_settings(ctx, serve_overrides)
    _check_port(settings.serve.host, settings.serve.port)
    if worker_settings.redis.url is None:
        worker_settings = use_embedded_redis_if_unset(ctx, worker_settings)
        settings = _serve_settings(ctx, serve_overrides)  # NOTE: with the embedded Redis's URL
    server = _ServerStop()
    try:
        local = LocalWorker(worker_settings, on_failure=server.stop_now)
    except StartupError as exc:
        raise fail(f"error: {exc}") from None

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        # NOTE: active outside uvicorn's run only: before it (the worker starting), and after it, when uvicorn
        # raises again each signal it stopped on (a second one: the worker stops at once)
        log.info("signal", extra={"event": "signal", "signal": signal.Signals(signum).name})
        server.stop_now()
        local.stop()

    is_main = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)} if is_main \
        else {}
    try:
        local.start()
        with Producer.from_config(settings.producer_config, check_workers=False) as producer:
            if not local.wait_serving(producer, HEARTBEAT_WAIT_S) and local.failure is None:
                log.warning("the worker's heartbeat is not in Redis yet; serving anyway",
                            extra={"event": "heartbeat_late"})
        if local.failure is None and not local.is_stopping:
            run_server(settings, on_server=server.attach)
    finally:
        local.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if local.failure is not None:
        raise fail(f"error: {local.failure}; tokenmill serve stopped")


def _check_port(host: str, port: int) -> None:
    """Exit 1 at once when ``host:port`` cannot be bound, rather than after the model has loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # NOTE: as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise fail(f"error: cannot listen on {host}:{port}: {exc.strerror or exc} (another server? choose "
                       "another with --port)") from None


class _ServerStop:
    """Stops the uvicorn server from any thread (its open requests cut after :data:`STOP_GRACE_S`), also before it
    exists: the worker may fail while the server starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._is_asked = False

    def attach(self, server: uvicorn.Server) -> None:
        with self._lock:
            self._server, is_asked = server, self._is_asked
        if is_asked:
            self._stop(server)

    def stop_now(self) -> None:
        with self._lock:
            self._is_asked, server = True, self._server
        if server is not None:
            self._stop(server)

    @staticmethod
    def _stop(server: uvicorn.Server) -> None:
        # NOTE: not force_exit, which skips the app's shutdown (a traceback in the log): the open requests get
        # STOP_GRACE_S, then are cancelled (no worker answers them any more)
        server.config.timeout_graceful_shutdown = STOP_GRACE_S
        server.should_exit = True
