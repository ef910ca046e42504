"""Client commands of ``tokenmill``: submit, result, cancel, status, dead (thin, over the producer).

Imports producer only; never the worker or the engine.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cli.common import app, fail, open_producer
from producer import dead_letters
from producer.common import as_chat
from producer.errors import ResultTimeout, SchemaError
from producer.schema import GenerationResult

EXIT_NOT_READY = 2  # result: not landed (yet), or the wait ran out


def _print_result(result: GenerationResult, as_json: bool) -> None:
    if as_json:
        typer.echo(result.model_dump_json())
    elif result.ok:
        typer.echo(result.text)
    if not result.ok:
        reason = f"[{result.error.code}] {result.error.message}" if result.error else result.status
        typer.echo(f"request {result.id} {result.status}: {reason}", err=True)
        raise typer.Exit(code=1)


def _read_prompt(prompt: str | None, messages: str | None) -> dict[str, Any]:
    if messages is not None:
        try:
            parsed = json.loads(messages)
        except json.JSONDecodeError as exc:
            raise fail(f"error: --messages is not JSON: {exc}") from None
        return {"messages": parsed}
    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            raise fail("error: give a PROMPT argument, --messages JSON, or pipe the prompt on stdin")
        prompt = sys.stdin.read()
    return {"prompt": prompt}


@app.command()
def submit(
    ctx: typer.Context,
    prompt: Annotated[str | None, typer.Argument(help="the prompt; '-' or nothing reads stdin")] = None,
    messages: Annotated[str | None, typer.Option(help='chat messages as JSON: [{"role": "user", "content": ...}]')] = None,
    system: Annotated[str | None, typer.Option(help="a system message before the prompt")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="send the prompt as raw text, without the chat template")] = False,
    max_tokens: Annotated[int | None, typer.Option(help="most tokens to generate")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy")] = None,
    top_p: Annotated[float | None, typer.Option()] = None,
    top_k: Annotated[int | None, typer.Option()] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    priority: Annotated[str, typer.Option(help="high, normal, low or a lane number")] = "normal",
    request_id: Annotated[str | None, typer.Option("--id", help="request id (idempotency key)")] = None,
    stream: Annotated[bool, typer.Option(help="print tokens as they are generated")] = False,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="print the request id and return")] = False,
    timeout: Annotated[float | None, typer.Option(help="seconds to wait for the result")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the whole result as JSON")] = False,
) -> None:
    """Submit one prompt and print its completion (or its id with --no-wait).

    The prompt goes to the model as a user message (its chat template applies); --raw sends it as is.
    """
    if system is not None and (raw or messages is not None):
        raise fail("error: --system goes with a plain prompt (not --raw, and inside --messages otherwise)")
    given = _read_prompt(prompt, messages)
    options: dict[str, Any] = {**(given if raw else as_chat(given, system)), "max_tokens": max_tokens,
                               "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                               "stop": stop or None, "request_id": request_id, "stream_tokens": stream or None,
                               "priority": int(priority) if priority.isdigit() else priority}
    with open_producer(ctx) as producer:
        try:
            rid = producer.submit(**options)
        except SchemaError as exc:
            raise fail(f"invalid request: {exc.message}") from None
        if no_wait:
            typer.echo(rid)
            return
        try:
            if stream:
                for delta in producer.stream(rid, timeout=timeout):
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                sys.stdout.write("\n")
            result = producer.result(rid, timeout=timeout)
        except ResultTimeout as exc:
            typer.echo(f"{exc} (the request stays queued; `tokenmill result {rid}` later)", err=True)
            raise typer.Exit(code=EXIT_NOT_READY) from None
    if stream and result.ok and not as_json:
        return
    _print_result(result, as_json)


@app.command()
def result(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(help="request id")],
    wait: Annotated[float | None, typer.Option(help="seconds to wait for it to land; default: do not wait")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the whole result as JSON")] = False,
) -> None:
    """Print the result of a request (exit 2 if it has not landed)."""
    with open_producer(ctx) as producer:
        try:
            found = producer.result(request_id, timeout=wait) if wait else producer.get(request_id)
        except ResultTimeout as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(code=EXIT_NOT_READY) from None
    if found is None:
        typer.echo(f"no result for {request_id} (not finished, unknown, or expired)", err=True)
        raise typer.Exit(code=EXIT_NOT_READY)
    _print_result(found, as_json)


@app.command()
def cancel(
    ctx: typer.Context,
    request_ids: Annotated[list[str], typer.Argument(help="request id(s)")],
) -> None:
    """Cancel requests: queued ones are answered 'cancelled', running ones are aborted."""
    with open_producer(ctx) as producer:
        for request_id in request_ids:
            producer.cancel(request_id)
            typer.echo(f"cancel requested: {request_id}")


@app.command()
def status(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="print the stats as JSON")] = False,
    stale_after: Annotated[float, typer.Option(help="heartbeat age (s) after which a worker is stale")] = 30.0,
) -> None:
    """Lane depths, pending, dead letters and workers (heartbeat age, tokens/s)."""
    with open_producer(ctx) as producer:
        stats = producer.stats(stale_after_s=stale_after)
    if as_json:
        typer.echo(json.dumps(stats, default=str, indent=2))
        return
    console = Console()
    lanes = Table(title=f"queue {stats['queue']}", title_justify="left")
    for column in ("lane", "depth", "pending", "lag"):
        lanes.add_column(column, justify="right")
    for lane in stats["lanes"]:
        lanes.add_row(str(lane["lane"]), str(lane["depth"]), str(lane["pending"]),
                      "-" if lane["lag"] is None else str(lane["lag"]))
    console.print(lanes)
    console.print(f"dead letters: {stats['dead']}   cancel marks: {stats['cancelled']}   "
                  f"live workers: {stats['num_live_workers']}")
    console.print(_workers_table(stats))


def _workers_table(stats: dict[str, Any]) -> Table:
    table = Table(title="workers", title_justify="left")
    for column in ("name", "state", "model", "age s", "running", "waiting", "tok/s", "finished", "prefix hit"):
        table.add_column(column, justify="left" if column in ("name", "state", "model") else "right")
    now = time.time()
    rows = [(name, info, "live") for name, info in stats["workers"].items()]
    rows += [(name, info, "gone") for name, info in stats["stale_workers"].items()]
    for name, info, liveness in rows:
        age = f"{now - float(info.get('ts', 0)):.1f}" if info.get("ts") else "-"
        state = f"{info.get('state', '?')} ({liveness})"
        table.add_row(name, state, str(info.get("model", "")), age, str(info.get("running", "")),
                      str(info.get("waiting", "")), f"{float(info.get('tokens_per_s', 0.0)):.1f}",
                      str(info.get("num_finished", "")), f"{float(info.get('prefix_hit_ratio', 0.0)):.0%}")
    return table


@app.command()
def dead(
    ctx: typer.Context,
    ids: Annotated[list[str] | None, typer.Argument(help="dead-letter entry ids or request ids to requeue")] = None,
    do_requeue: Annotated[bool, typer.Option("--requeue", help="move the given (or --all) dead letters back")] = False,
    requeue_all: Annotated[bool, typer.Option("--all", help="with --requeue: every dead letter")] = False,
    limit: Annotated[int, typer.Option(help="most dead letters to list")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="print as JSON")] = False,
) -> None:
    """List dead letters with their reason; --requeue [ID...] | --all moves them back to their lane."""
    if (ids or requeue_all) and not do_requeue:
        raise fail("error: IDs and --all need --requeue")
    if do_requeue and not ids and not requeue_all:
        raise fail("error: --requeue needs dead-letter/request IDs or --all")
    with open_producer(ctx) as producer:
        letters = dead_letters.read(producer.client, producer.keys, None if do_requeue else limit)
        if not do_requeue:
            _print_letters(letters, as_json)
            return
        chosen, missing = dead_letters.select(letters, None if requeue_all else ids)
        for letter in chosen:
            try:
                new_id = dead_letters.requeue(producer.client, producer.keys, letter)
            except ValueError as exc:
                typer.echo(f"skipped {letter.dead_id}: {exc}", err=True)
                continue
            typer.echo(f"requeued {letter.request_id or letter.dead_id} -> {letter.stream} {new_id}")
    if missing:
        raise fail(f"not in the dead-letter stream: {', '.join(sorted(missing))}")


def _print_letters(letters: list[dead_letters.DeadLetter], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps([d.as_dict() for d in letters], indent=2))
        return
    table = Table(title=f"dead letters ({len(letters)})", title_justify="left")
    for column in ("dead id", "request id", "lane", "reason"):
        table.add_column(column)
    for letter in letters:
        table.add_row(letter.dead_id, letter.request_id or "-", letter.stream, letter.reason)
    Console(width=200).print(table)
