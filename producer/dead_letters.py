"""Dead letters of a queue: read them, and requeue them onto their lane as fresh deliveries.

Each shard of a queue has its dead-letter stream (the worker writes it in the same script as the answer);
reading goes over every shard's. Imports redis and protocol (keys, shards, schema) only; never the engine
or the worker.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, cast

import redis

from tokenmill.protocol.keys import Keys
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.schema import decode_result, peek_request_id
from tokenmill.protocol.shards import QueueLayout

# Fields the worker adds when it dead-letters an entry; the rest are the original entry's.
_DEAD_FIELDS = (b"reason", b"stream", b"entry_id")


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the dead-letter stream."""

    dead_id: str  # entry id in the dead stream
    request_id: str | None  # when the payload still decodes far enough
    reason: str
    stream: str  # the lane it came from
    fields: dict[bytes, bytes]  # the original entry's fields (d, v)
    dead_stream: str = ""  # the dead-letter stream holding it (its shard's)

    def as_dict(self) -> dict[str, Any]:
        return {"dead_id": self.dead_id, "request_id": self.request_id, "reason": self.reason, "stream": self.stream}


def _layout(keys: Keys | QueueLayout) -> QueueLayout:
    return keys if isinstance(keys, QueueLayout) else QueueLayout.single(keys)


def read(client: redis.Redis, keys: Keys | QueueLayout, limit: int | None = None) -> list[DeadLetter]:
    """Dead letters, oldest first (at most ``limit``; of every shard, shard by shard)."""
    letters: list[DeadLetter] = []
    for shard in _layout(keys).shards:
        count = None if limit is None else limit - len(letters)
        if count is not None and count <= 0:
            break
        entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(shard.dead, count=count))
        letters += [parse(entry_id, fields, shard.dead) for entry_id, fields in entries]
    return letters


def parse(entry_id: bytes | str, fields: dict[bytes, bytes], dead_stream: str) -> DeadLetter:
    """One entry (an XRANGE reply's) of the dead-letter stream ``dead_stream``."""
    original = {name: value for name, value in fields.items() if name not in _DEAD_FIELDS}
    return DeadLetter(entry_id.decode() if isinstance(entry_id, bytes) else entry_id, peek_request_id(original),
                      fields.get(b"reason", b"").decode(errors="replace"),
                      fields.get(b"stream", b"").decode(errors="replace"), original, dead_stream)


def select(letters: list[DeadLetter], ids: Collection[str] | None) -> tuple[list[DeadLetter], set[str]]:
    """The letters named by ``ids`` (dead-letter entry ids or request ids; None = all of them).

    Returns:
        The chosen letters, and the ids that named none of them.
    """
    if ids is None:
        return letters, set()
    wanted = set(ids)
    chosen = [d for d in letters if d.dead_id in wanted or d.request_id in wanted]
    missing = wanted - {d.dead_id for d in chosen} - {d.request_id for d in chosen if d.request_id}
    return chosen, missing


def requeue(client: redis.Redis, keys: Keys | QueueLayout, letter: DeadLetter) -> str:
    """Move one dead letter back to its lane (a fresh entry, delivery count 0): the shared lane or the
    model's it came from (the model is registered again, as a submit does).

    A stored ``max_deliveries`` answer is removed in the same MULTI, so the re-run can answer.

    Returns:
        The new entry id in the lane.

    Raises:
        ValueError: the letter's stream is not a lane of this queue.
    """
    layout = _layout(keys)
    shard = layout.shard_of_stream(letter.stream)
    lane = None if shard is None else layout.shards[shard].parse_lane(letter.stream)
    if shard is None or lane is None:
        raise ValueError(f"stream {letter.stream!r} is not a lane of queue {layout.home.base}")
    keys = layout.shards[shard]  # NOTE: the lane's shard holds its dead letters and its requests' answers
    pipe = client.pipeline(transaction=True)
    if letter.request_id is not None and _has_dead_answer(client, keys, letter.request_id):
        pipe.delete(keys.result(letter.request_id), keys.done(letter.request_id))
    if lane.model is not None:
        pipe.sadd(keys.models, lane.model)
    pipe.xadd(letter.stream, letter.fields)  # type: ignore[arg-type]
    pipe.xdel(letter.dead_stream or keys.dead, letter.dead_id)
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
