"""Client commands of ``tokenmill``: submit, result, cancel, status, dead (thin, over the producer).

Imports producer only; never the worker or the engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from tokenmill.cli.common import (
    QueueOption,
    app,
    client_settings,
    fail,
    open_producer,
    warn_without_workers,
    with_queue,
)
from tokenmill.cli.tables import print_line, print_rows
from tokenmill.producer import dead_letters
from tokenmill.producer.errors import ResultTimeout
from tokenmill.producer.eta import format_duration
from tokenmill.producer.submit_options import build_request
from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.heartbeat import STALE_AFTER_S
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.protocol.schema import GenerationRequest, GenerationResult

EXIT_NOT_READY = 2  # result: not landed (yet), or the wait ran out
LANE_COLUMNS = ("lane", "model", "depth", "pending", "lag")  # model: "-" for the shared lanes
SHARD_COLUMNS = ("shard", "keys", "depth", "pending", "lag")
WORKER_COLUMNS = ("name", "state", "model", "age s", "running", "waiting", "tok/s", "finished", "prefix hit",
                  "backlog tok", "spec acc")


def _print_result(result: GenerationResult, as_json: bool) -> None:
    if as_json:
        typer.echo(result.model_dump_json())
    elif result.ok and result.samples:  # n > 1: each sample under a header line
        for sample in result.samples:
            typer.echo(f"--- sample {sample.index} ({sample.finish_reason}) ---")
            typer.echo(sample.text)
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


def _read_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise fail(f"error: {what} is not JSON: {exc}") from None


def _response_format(response_format: str | None, json_schema: Path | None, regex: str | None) -> Any:
    """The request's response_format from the one structured-output option given (None: free text)."""
    given = [name for name, value in (("--response-format", response_format), ("--json-schema", json_schema),
                                      ("--regex", regex)) if value is not None]
    if len(given) > 1:
        raise fail(f"error: give one of {', '.join(given)}")
    if response_format is not None:
        return _read_json(response_format, "--response-format")
    if regex is not None:
        return {"type": "regex", "regex": regex}
    if json_schema is None:
        return None
    try:
        text = json_schema.read_text()
    except OSError as exc:
        raise fail(f"error: cannot read --json-schema {json_schema}: {exc.strerror or exc}") from None
    schema = _read_json(text, f"--json-schema {json_schema}")
    return {"type": "json_schema", "json_schema": {"name": json_schema.stem or "schema", "schema": schema}}


def _build_request(ctx: typer.Context, options: dict[str, Any]) -> GenerationRequest:
    """The request of ``options`` (None = not given), validated before Redis is reached; exit 1 if invalid."""
    keys = client_settings(ctx).producer_config.keys
    try:
        return build_request(keys, {name: value for name, value in options.items() if value is not None})
    except SchemaError as exc:
        raise fail(f"invalid request: {exc.message}") from None


@app.command()
def submit(
    ctx: typer.Context,
    prompt: Annotated[str | None, typer.Argument(help="the prompt; '-' or nothing reads stdin")] = None,
    messages: Annotated[str | None, typer.Option(
        help='chat messages as JSON: [{"role": "user", "content": ...}]')] = None,
    system: Annotated[str | None, typer.Option(help="a system message before the prompt")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="send the prompt as raw text, without the chat template")] = False,
    model: Annotated[str | None, typer.Option(help="the model the request is for: it waits in that model's lanes, "
                                                    "for a worker serving it")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        help=f"most tokens to generate (default {SamplingParams.model_fields['max_tokens'].default})")] = None,
    n: Annotated[int | None, typer.Option("--n", help="parallel samples of the prompt (default 1)")] = None,
    min_tokens: Annotated[int | None, typer.Option(help="fewest tokens to generate before EOS or a stop")] = None,
    temperature: Annotated[float | None, typer.Option(help="0 = greedy (the default)")] = None,
    top_p: Annotated[float | None, typer.Option(help="nucleus sampling: keep the most likely tokens up to this "
                                                     "probability mass (0-1]")] = None,
    top_k: Annotated[int | None, typer.Option(help="keep only the k most likely tokens (0 = off)")] = None,
    seed: Annotated[int | None, typer.Option(help="random seed of the sampler (reproducible sampling)")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    stop_token_id: Annotated[list[int] | None, typer.Option(help="stop token id (repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="generate past end-of-sequence tokens")] = False,
    speculative: Annotated[bool, typer.Option(help="--no-speculative: never draft tokens for this request "
                                                   "(the text is the same either way)")] = True,
    repetition_penalty: Annotated[float | None, typer.Option(
        help="Hugging Face's repetition penalty over prompt and output (> 1 repeats less)")] = None,
    presence_penalty: Annotated[float | None, typer.Option(help="OpenAI's presence penalty [-2, 2]")] = None,
    frequency_penalty: Annotated[float | None, typer.Option(help="OpenAI's frequency penalty [-2, 2]")] = None,
    json_schema: Annotated[Path | None, typer.Option(
        help="a JSON Schema file: the output is JSON that follows it")] = None,
    regex: Annotated[str | None, typer.Option(help="the output matches this regular expression")] = None,
    response_format: Annotated[str | None, typer.Option(
        help='the request\'s response_format as JSON, e.g. \'{"type": "json_object"}\'')] = None,
    logprobs: Annotated[int | None, typer.Option(
        help="log-probabilities of each token and of its N most likely alternatives (0-20); prints the result "
             "as JSON (token_logprobs)")] = None,
    priority: Annotated[str, typer.Option(help="high, normal, low or a lane number")] = "normal",
    request_id: Annotated[str | None, typer.Option("--id", help="request id (idempotency key)")] = None,
    stream: Annotated[bool, typer.Option(help="print tokens as they are generated")] = False,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="print the request id and return")] = False,
    timeout: Annotated[float | None, typer.Option(help="seconds to wait for the result (default: no limit)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the whole result as JSON")] = False,
    queue: QueueOption = None,
) -> None:
    """Submit one prompt and print its completion (or its id with --no-wait).

    The prompt goes to the model as a user message (its chat template applies); --raw sends it as is.
    Warns (stderr) when no live worker serves the queue: the request then waits for one.
    """
    with_queue(ctx, queue)
    options: dict[str, Any] = {**_read_prompt(prompt, messages), "raw": raw, "system": system, "model": model,
                               "max_tokens": max_tokens, "min_tokens": min_tokens, "temperature": temperature,
                               "top_p": top_p, "top_k": top_k, "seed": seed, "stop": stop or None, "n": n,
                               "stop_token_ids": stop_token_id or None, "ignore_eos": ignore_eos or None,
                               "speculative": None if speculative else False,
                               "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
                               "frequency_penalty": frequency_penalty, "logprobs": logprobs,
                               "response_format": _response_format(response_format, json_schema, regex),
                               "request_id": request_id, "stream_tokens": stream or None,
                               "priority": int(priority) if priority.isdigit() else priority}
    as_json = as_json or logprobs is not None
    request = _build_request(ctx, options)
    with open_producer(ctx) as producer:
        warn_without_workers(ctx, producer, request.model)
        [rid] = producer.submit_many([request])
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
    timeout: Annotated[float | None, typer.Option(help="seconds to wait for it to land (default: do not wait)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the whole result as JSON")] = False,
    queue: QueueOption = None,
) -> None:
    """Print the result of a request (exit 2 if it has not landed)."""
    with_queue(ctx, queue)
    with open_producer(ctx) as producer:
        try:
            found = producer.result(request_id, timeout=timeout) if timeout else producer.get(request_id)
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
    queue: QueueOption = None,
) -> None:
    """Cancel requests: queued ones are answered 'cancelled', running ones are aborted.

    An id the queue does not hold (never submitted, or finished and expired) is an error (exit 1);
    a finished one keeps its result.
    """
    with_queue(ctx, queue)
    with open_producer(ctx) as producer:
        states = producer.locate(request_ids)
        queued = [request_id for request_id, state in states.items() if state == "queued"]
        producer.cancel_many(queued)
        base = producer.keys.base
    for request_id, state in states.items():
        if state == "queued":
            typer.echo(f"cancel requested: {request_id}")
        elif state == "finished":
            typer.echo(f"already finished: {request_id} (its result stays; nothing to cancel)")
    unknown = [request_id for request_id, state in states.items() if state == "unknown"]
    if unknown:
        raise fail(f"error: no request {', '.join(unknown)} in queue {base} (never submitted, or finished and "
                   "its result expired)")


@app.command()
def status(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="print the stats as JSON")] = False,
    stale_after: Annotated[float | None, typer.Option(
        help=f"heartbeat age (s) after which a worker is stale (default: [worker] stale_after_s, "
             f"as the workers judge it: {STALE_AFTER_S:g})")] = None,
    per_shard: Annotated[bool, typer.Option("--shards", help="also a table of each shard's depth, pending and "
                                                             "lag (a queue with [queue] shards > 1)")] = False,
    queue: QueueOption = None,
) -> None:
    """Lane depths (shared and per model, summed over the queue's shards), pending, dead letters, the predicted
    backlog in tokens and its ETA, and workers (heartbeat age by the Redis server's clock, tokens/s, predicted backlog,
    speculation)."""
    with_queue(ctx, queue)
    stale_after_s = stale_after if stale_after is not None else client_settings(ctx).worker.stale_after_s
    with open_producer(ctx) as producer:
        stats = producer.stats(stale_after_s=stale_after_s)
    if as_json:
        typer.echo(json.dumps(stats, default=str, indent=2))
        return
    console = Console()
    print_rows(console, f"queue {stats['queue']}", LANE_COLUMNS,
               [[str(lane["lane"]) + (" decode" if lane["pool"] == "decode" else ""), lane["model"] or "-",
                 str(lane["depth"]), str(lane["pending"]),
                 "-" if lane["lag"] is None else str(lane["lag"])] for lane in _summed_lanes(stats["lanes"])],
               right_aligned=("lane", "depth", "pending", "lag"))
    if per_shard:
        print_rows(console, f"shards ({len(stats['shards'])})", SHARD_COLUMNS,
                   [[str(shard["shard"]), shard["base"], str(shard["depth"]), str(shard["pending"]),
                     "-" if shard["lag"] is None else str(shard["lag"])] for shard in stats["shards"]],
                   right_aligned=("shard", "depth", "pending", "lag"))
    print_line(console, f"dead letters: {stats['dead']}   cancel marks: {stats['cancelled']}   "
                        f"live workers: {stats['num_live_workers']}")
    print_line(console, f"backlog tok: {_tokens_cell(stats['backlog_tokens'])}   "
                        f"ETA: {format_duration(stats['eta_s'])}")
    print_rows(console, "workers", WORKER_COLUMNS, _worker_rows(stats), right_aligned=WORKER_COLUMNS[3:])


def _summed_lanes(lanes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lanes of every shard added up per (pool, lane, model), in their order; a lag is unknown (None) once
    any shard's is."""
    summed: dict[tuple[str, int, str | None], dict[str, Any]] = {}
    for lane in lanes:
        key = (lane["pool"], lane["lane"], lane["model"])
        if key not in summed:
            summed[key] = {**lane, "depth": 0, "pending": 0, "lag": 0}
        total = summed[key]
        total["depth"] += lane["depth"]
        total["pending"] += lane["pending"]
        total["lag"] = None if total["lag"] is None or lane["lag"] is None else total["lag"] + int(lane["lag"])
    return list(summed.values())


def _worker_rows(stats: dict[str, Any]) -> list[list[str]]:
    rows = [(name, info, "live") for name, info in stats["workers"].items()]
    rows += [(name, info, "gone") for name, info in stats["stale_workers"].items()]
    return [[name, f"{info.get('state', '?')} ({liveness})", str(info.get("model", "")),
             _age_cell(info), str(info.get("running", "")),
             str(info.get("waiting", "")), f"{float(info.get('tokens_per_s', 0.0)):.1f}",
             str(info.get("num_finished", "")), f"{float(info.get('prefix_hit_ratio', 0.0)):.0%}",
             _tokens_cell(info.get("backlog_tokens")), _speculation_cell(info)]
            for name, info, liveness in rows]


def _age_cell(info: dict[str, Any]) -> str:
    """Seconds since the beat by the Redis server's clock (stats' ``age_s``: never this machine's); ``future``
    for a beat stamped ahead of it (forged, or an older release's worker clock: stale), ``-`` for no beat."""
    if "ts" not in info:
        return "-"
    age_s = info.get("age_s")
    return "future" if age_s is None else f"{float(age_s):.1f}"


def _tokens_cell(tokens: float | None) -> str:
    """Predicted completion tokens; ``-`` when unknown (prediction off, a worker of an older release)."""
    return "-" if tokens is None else f"{float(tokens):.0f}"


def _speculation_cell(info: dict[str, Any]) -> str:
    """Speculative decoding as ``acceptance xmean-accepted-length`` (``0.92 x3.1``); ``-`` before any draft,
    with speculation off, or from a worker of an older release."""
    rate, length = info.get("spec_acceptance_rate"), info.get("spec_mean_accepted_length")
    if rate is None or length is None:
        return "-"
    return f"{float(rate):.2f} x{float(length):.1f}"


@app.command()
def dead(
    ctx: typer.Context,
    ids: Annotated[list[str] | None, typer.Argument(help="dead-letter entry ids or request ids to requeue")] = None,
    do_requeue: Annotated[bool, typer.Option("--requeue", help="move the given (or --all) dead letters back")] = False,
    requeue_all: Annotated[bool, typer.Option("--all", help="with --requeue: every dead letter")] = False,
    limit: Annotated[int, typer.Option(help="most dead letters to list")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="print as JSON")] = False,
    queue: QueueOption = None,
) -> None:
    """List dead letters with their reason; --requeue [ID...] | --all moves them back to their lane."""
    with_queue(ctx, queue)
    if (ids or requeue_all) and not do_requeue:
        raise fail("error: IDs and --all need --requeue")
    if do_requeue and not ids and not requeue_all:
        raise fail("error: --requeue needs dead-letter/request IDs or --all")
    with open_producer(ctx) as producer:
        letters = dead_letters.read(producer.client, producer.layout, None if do_requeue else limit)
        if not do_requeue:
            _print_letters(letters, as_json)
            return
        chosen, missing = dead_letters.select(letters, None if requeue_all else ids)
        for letter in chosen:
            try:
                new_id = dead_letters.requeue(producer.client, producer.layout, letter)
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
    print_rows(Console(), f"dead letters ({len(letters)})", ("dead id", "request id", "lane", "reason"),
               [[letter.dead_id, letter.request_id or "-", letter.stream, letter.reason] for letter in letters])
