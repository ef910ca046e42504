"""``tokenmill dead``: list dead letters, and requeue them onto their lane as fresh deliveries.

Imports redis and producer (keys, schema) only; never the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, cast

import redis
import typer
from rich.console import Console
from rich.table import Table

from producer.keys import Keys
from producer.schema import ErrorCode, decode_result, peek_request_id
from worker.cli_common import fail, open_producer

# Fields the worker adds when it dead-letters an entry; the rest are the original entry's.
_DEAD_FIELDS = (b"reason", b"stream", b"entry_id")


@dataclass
class DeadLetter:
    """One entry of the dead-letter stream."""

    dead_id: str  # entry id in the dead stream
    request_id: str | None  # when the payload still decodes far enough
    reason: str
    stream: str  # the lane it came from
    fields: dict[bytes, bytes]  # the original entry's fields (d, v)

    def as_dict(self) -> dict[str, Any]:
        return {"dead_id": self.dead_id, "request_id": self.request_id, "reason": self.reason, "stream": self.stream}


def read_dead(client: redis.Redis, keys: Keys, limit: int | None = None) -> list[DeadLetter]:
    """Dead letters, oldest first (at most ``limit``)."""
    entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(keys.dead, count=limit))
    letters = []
    for entry_id, fields in entries:
        original = {name: value for name, value in fields.items() if name not in _DEAD_FIELDS}
        letters.append(DeadLetter(entry_id.decode(), peek_request_id(original),
                                  fields.get(b"reason", b"").decode(errors="replace"),
                                  fields.get(b"stream", b"").decode(errors="replace"), original))
    return letters


def requeue(client: redis.Redis, keys: Keys, letter: DeadLetter) -> str:
    """Move one dead letter back to its lane (a fresh entry, delivery count 0).

    A stored ``max_deliveries`` answer is removed in the same MULTI, so the re-run can answer.

    Returns:
        The new entry id in the lane.

    Raises:
        ValueError: the letter's stream is not a lane of this queue.
    """
    if letter.stream not in keys.lanes:
        raise ValueError(f"stream {letter.stream!r} is not a lane of queue {keys.base}")
    pipe = client.pipeline(transaction=True)
    if letter.request_id is not None and _has_dead_answer(client, keys, letter.request_id):
        pipe.delete(keys.result(letter.request_id), keys.done(letter.request_id))
    pipe.xadd(letter.stream, letter.fields)  # type: ignore[arg-type]
    pipe.xdel(keys.dead, letter.dead_id)
    replies = pipe.execute()
    new_id = replies[-2]
    return new_id.decode() if isinstance(new_id, bytes) else str(new_id)


def _has_dead_answer(client: redis.Redis, keys: Keys, request_id: str) -> bool:
    raw = cast("bytes | None", client.get(keys.result(request_id)))
    if raw is None:
        return False
    try:
        stored = decode_result(raw)
    except Exception:  # noqa: BLE001 - an unreadable answer is not one we may delete
        return False
    return stored.error is not None and stored.error.code == ErrorCode.MAX_DELIVERIES.value


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
        letters = read_dead(producer.client, producer.keys, None if do_requeue else limit)
        if not do_requeue:
            _print_letters(letters, as_json)
            return
        wanted = set(ids or [])
        chosen = [d for d in letters if requeue_all or d.dead_id in wanted or d.request_id in wanted]
        missing = wanted - {d.dead_id for d in chosen} - {d.request_id for d in chosen if d.request_id}
        for letter in chosen:
            try:
                new_id = requeue(producer.client, producer.keys, letter)
            except ValueError as exc:
                typer.echo(f"skipped {letter.dead_id}: {exc}", err=True)
                continue
            typer.echo(f"requeued {letter.request_id or letter.dead_id} -> {letter.stream} {new_id}")
    if missing:
        raise fail(f"not in the dead-letter stream: {', '.join(sorted(missing))}")


def _print_letters(letters: list[DeadLetter], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps([d.as_dict() for d in letters], indent=2))
        return
    table = Table(title=f"dead letters ({len(letters)})", title_justify="left")
    for column in ("dead id", "request id", "lane", "reason"):
        table.add_column(column)
    for letter in letters:
        table.add_row(letter.dead_id, letter.request_id or "-", letter.stream, letter.reason)
    Console(width=200).print(table)
