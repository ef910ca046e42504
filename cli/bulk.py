"""``tokenmill bulk``: a thin command over :func:`producer.bulk.run`. Never imports the worker or the engine."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

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
from tokenmill.producer import bulk
from tokenmill.producer.bulk.report import render_summary
from tokenmill.producer.errors import ProducerError

EXIT_INTERRUPTED = 130
EXIT_INCOMPLETE = 3  # some records failed or were invalid, in this run or an earlier one (see the errors file)


def _sigterm_as_interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@app.command("bulk")
def bulk_command(
    ctx: typer.Context,
    input_path: Annotated[Path, typer.Argument(help="JSONL, OpenAI Batch JSONL, CSV or Parquet")],
    output_path: Annotated[Path, typer.Argument(
        help="results JSONL, or Parquet if named .parquet (the parquet extra); re-run with the same path to resume")],
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
    errors: Annotated[Path | None, typer.Option(help="errors file (default OUTPUT.errors.jsonl)")] = None,
    input_format: Annotated[str, typer.Option("--format", help="auto, jsonl, openai, csv or parquet")] = "auto",
    prompt_column: Annotated[str, typer.Option(help="CSV/Parquet prompt column")] = "prompt",
    id_column: Annotated[str, typer.Option(help="CSV/Parquet id column (optional)")] = "id",
    progress: Annotated[bool, typer.Option(
        "--progress/--no-progress", help="progress on stderr: a bar on a terminal, else a line every 10 s")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
    queue: QueueOption = None,
) -> None:
    """Generate completions for every record of INPUT into OUTPUT (resumable; Ctrl-C is safe).

    Plain prompts (JSONL "prompt", CSV/Parquet) go to the model as user messages; --raw sends them as is.
    Records may carry any request param (JSONL fields or "params", OpenAI Batch bodies): response_format,
    logprobs, penalties. Warns (stderr) when no live worker serves the queue.

    Exit status:
    0 every record succeeded;
    1 the job could not run (bad options, unreadable input, Redis unreachable);
    3 the errors file holds failed or invalid records (from this run or an earlier one);
    130 interrupted (re-run the same command to finish).
    """
    with_queue(ctx, queue)
    options: dict[str, Any] = {"priority": int(priority) if priority.isdigit() else priority,
                               "max_in_flight": max_in_flight, "max_tokens": max_tokens, "temperature": temperature,
                               "top_p": top_p, "top_k": top_k, "seed": seed, "stop": stop or None,
                               "retries": retries, "errors_path": errors,
                               "raw": raw, "system": system, "cancel_on_interrupt": cancel_on_interrupt,
                               "format": input_format, "prompt_column": prompt_column, "id_column": id_column}
    # NOTE: SIGTERM stops like Ctrl-C (valid files, exit 130); handlers need the main thread.
    is_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt) if is_main else None
    try:
        with open_producer(ctx) as producer:
            warn_without_workers(ctx, producer)
            summary = bulk.run(input_path, output_path, producer=producer, show_progress=progress, **options)
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
