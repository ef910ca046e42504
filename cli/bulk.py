"""``tokenmill bulk``: a thin command over :func:`producer.bulk.run`. Never imports the worker or the engine."""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console

from tokenmill.cli.common import (
    QueueOption,
    app,
    fail,
    open_producer,
    validation_exit,
    warn_without_workers,
    with_queue,
)
from tokenmill.cli.engine_flags import NO_FLAGS, EngineFlags, with_engine_flags
from tokenmill.cli.local_worker import (
    LocalWorker,
    local_worker_settings,
    refuse_engine_flags_without_model,
    served_names,
    use_embedded_redis_if_unset,
)
from tokenmill.producer import bulk
from tokenmill.producer.bulk import BulkInputError, BulkJob, BulkOptions, BulkSummary
from tokenmill.producer.bulk.report import render_summary
from tokenmill.protocol.errors import ProducerError

if TYPE_CHECKING:
    from tokenmill.worker.config import Settings

EXIT_INTERRUPTED = 130
EXIT_INCOMPLETE = 3  # some records failed or were invalid, in this run or an earlier one (see the errors file)


def _sigterm_as_interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@app.command("bulk")
@with_engine_flags
def bulk_command(
    ctx: typer.Context,
    input_path: Annotated[Path, typer.Argument(help="JSONL, OpenAI Batch JSONL, CSV or Parquet")],
    output_path: Annotated[Path, typer.Argument(
        help="results JSONL, or Parquet if named .parquet (the parquet extra); re-run with the same path to resume")],
    model: Annotated[str | None, typer.Option(help="run the job on a worker of this model of its own, in this "
                                              "process, stopped when the job ends (alias, HF id, path or 'echo'); "
                                              "the embedded Redis if none is set")] = None,
    priority: Annotated[str, typer.Option(help="high, normal, low or a lane number")] = "low",
    max_in_flight: Annotated[int, typer.Option(help="most requests outstanding at once")] = 256,
    max_tokens: Annotated[int | None, typer.Option(help="default max_tokens (items may override)")] = None,
    temperature: Annotated[float | None, typer.Option(help="default temperature (items may override)")] = None,
    top_p: Annotated[float | None, typer.Option(help="default top_p (items may override)")] = None,
    top_k: Annotated[int | None, typer.Option(help="default top_k, 0 = off (items may override)")] = None,
    seed: Annotated[int | None, typer.Option(help="default seed (items may override)")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="default stop string, repeatable (items may override)")] = None,
    retries: Annotated[int, typer.Option(help="extra attempts for retryable failures")] = 2,
    raw: Annotated[bool, typer.Option("--raw", help="send plain prompts as raw text, not as a user message")] = False,
    system: Annotated[str | None, typer.Option(help="a system message before each plain prompt")] = None,
    cancel_on_interrupt: Annotated[bool, typer.Option(
        "--cancel-on-interrupt", help="on Ctrl-C, cancel the requests this run queued (else they run on)")] = False,
    retry_cancelled: Annotated[bool, typer.Option(
        "--retry-cancelled/--no-retry-cancelled",
        help="run again the rows an earlier run cancelled (--cancel-on-interrupt); --no-retry-cancelled "
             "leaves them in the errors file as cancelled")] = True,
    errors: Annotated[Path | None, typer.Option(help="errors file (default OUTPUT.errors.jsonl)")] = None,
    input_format: Annotated[str, typer.Option("--format", help="auto, jsonl, openai, csv or parquet")] = "auto",
    prompt_column: Annotated[str, typer.Option(help="CSV/Parquet prompt column")] = "prompt",
    id_column: Annotated[str, typer.Option(help="CSV/Parquet id column (optional)")] = "id",
    progress: Annotated[bool, typer.Option(
        "--progress/--no-progress", help="progress on stderr: a bar on a terminal, else a line every 10 s")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
    log_level: Annotated[str | None, typer.Option(
        help="with --model, its worker's log level: DEBUG (two lines per record), INFO (failed records, and "
             "a throughput line a minute), WARNING (the default here) or ERROR")] = None,
    queue: QueueOption = None,
    engine_flags: EngineFlags = NO_FLAGS,
) -> None:
    """Generate completions for every record of INPUT into OUTPUT (resumable; Ctrl-C is safe).

    Plain prompts (JSONL "prompt", CSV/Parquet) go to the model as user messages; --raw sends them as is.
    Records may carry any request param (JSONL fields or "params", OpenAI Batch bodies): response_format,
    logprobs, penalties. Warns (stderr) when no live worker serves the queue. With --model the job brings its
    own worker (one command, as vllm run-batch); records naming another model go to the errors file.

    Exit status:
    0 every record succeeded;
    1 the job could not run (bad options, unreadable input, Redis unreachable, --model's worker failed);
    3 the errors file holds failed or invalid records (from this run or an earlier one);
    130 interrupted (re-run the same command to finish; rows --cancel-on-interrupt cancelled run again
    unless --no-retry-cancelled).
    """
    with_queue(ctx, queue)
    options: dict[str, Any] = {"priority": int(priority) if priority.isdigit() else priority,
                               "max_in_flight": max_in_flight, "max_tokens": max_tokens, "temperature": temperature,
                               "top_p": top_p, "top_k": top_k, "seed": seed, "stop": stop or None,
                               "retries": retries, "errors_path": errors,
                               "raw": raw, "system": system, "cancel_on_interrupt": cancel_on_interrupt,
                               "retry_cancelled": retry_cancelled,
                               "format": input_format, "prompt_column": prompt_column, "id_column": id_column}
    settings = None
    if model is None:
        refuse_engine_flags_without_model(engine_flags, "tokenmill bulk")
        if log_level is not None:
            raise fail("error: --log-level is the log level of the worker --model runs; give --model too")
    else:
        settings = local_worker_settings(ctx, model, engine_flags, {"log_level": log_level or "WARNING"})
    # NOTE: SIGTERM stops like Ctrl-C (valid files, exit 130); handlers need the main thread.
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt) if is_main else None
    try:
        if settings is None:
            with open_producer(ctx) as producer:
                warn_without_workers(ctx, producer)
                summary = bulk.run(input_path, output_path, producer=producer, show_progress=progress, **options)
        else:
            summary = _run_with_own_worker(ctx, settings, input_path, output_path, progress, options)
    except ValidationError as exc:
        raise validation_exit(exc, "bulk options") from None
    except ProducerError as exc:
        raise fail(f"error: {exc}") from None
    finally:
        if is_main:
            signal.signal(signal.SIGTERM, previous)
    if as_json:
        typer.echo(json.dumps(summary.as_dict()))
    else:
        render_summary(summary, Console())
    if summary.is_interrupted:
        raise typer.Exit(code=EXIT_INTERRUPTED)
    if summary.has_errors:
        raise typer.Exit(code=EXIT_INCOMPLETE)


def _run_with_own_worker(ctx: typer.Context, settings: Settings, input_path: Path, output_path: Path,
                         progress: bool, options: dict[str, Any]) -> BulkSummary:
    """The job on a worker of its own (cli/local_worker.py), built after the input and options are checked and
    stopped when the job ends: at once after an interrupt (what it started stays pending for the re-run's
    worker), else once it has written every result. Exit 1 when the worker fails (the job stops as on Ctrl-C,
    its files valid: re-run to finish), 130 when interrupted while the model loads.

    Raises:
        ProducerError: Redis cannot be reached; the input or the output cannot be used.
        pydantic.ValidationError: invalid options.
    """
    from tokenmill.worker.errors import StartupError  # noqa: PLC0415 - loads no torch; the worker comes next
    from tokenmill.worker.logs import setup_logging  # noqa: PLC0415 - as above

    job_options = BulkOptions.model_validate({**options, "served_models": served_names(settings)})
    if not input_path.is_file():
        raise BulkInputError(f"input file {input_path} does not exist")
    setup_logging(settings.worker.log_level, settings.worker.log_json)
    if logging.getLogger("tokenmill.cli").getEffectiveLevel() > logging.INFO:
        logging.getLogger("tokenmill.cli").setLevel(logging.INFO)  # NOTE: this command's few lines: where Redis is
    settings = use_embedded_redis_if_unset(ctx, settings)
    with open_producer(ctx) as producer:
        job = BulkJob(producer, input_path, output_path, job_options, show_progress=progress)
        try:
            local = LocalWorker(settings, on_failure=job.stopping.set)
        except StartupError as exc:
            raise fail(f"error: {exc}") from None
        except KeyboardInterrupt:
            raise typer.Exit(code=EXIT_INTERRUPTED) from None
        summary: BulkSummary | None = None
        try:
            local.start()
            summary = job.run()
        finally:
            local.close(force=summary is None or summary.is_interrupted)
    if local.failure is not None:
        render_summary(summary, Console(stderr=True))
        raise fail(f"error: {local.failure}; the job stopped (re-run the same command to finish)")
    return summary
