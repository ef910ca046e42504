"""The dashboard's changes: replay a dead letter (back to its lane as a fresh delivery, ``producer.dead_letters.
requeue``), discard one, cancel a request (``AsyncProducer.cancel``). Each is logged (the process's log) and kept
in the queue's change log (``Keys.audit``, a capped stream every replica shows). Callers check the role and CSRF
first (auth.py).

Imports redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, cast

from tokenmill.producer import dead_letters
from tokenmill.serve.dashboard.auth import Viewer
from tokenmill.serve.dashboard.reads import DEAD_SCAN
from tokenmill.serve.dashboard.state import DashboardState

log = logging.getLogger("tokenmill.serve.dashboard")

MAX_PER_CALL = 1000  # dead letters one replay or discard call handles (a filter matching more: call again)
AUDIT_MAX = 10_000  # change-log entries kept (approximately)
AUDIT_SHOWN = 20


async def _letters(state: DashboardState, dead_ids: Sequence[str], reason: str | None) -> list[dead_letters.DeadLetter]:
    """The dead letters named by ``dead_ids`` (any shard), or those of ``reason`` among the newest of each shard."""
    pipe = state.client.pipeline(transaction=False)
    shards = state.layout.shards
    if reason is not None:
        for keys in shards:
            pipe.xrevrange(keys.dead, count=DEAD_SCAN)
    else:
        for dead_id in dead_ids[:MAX_PER_CALL]:
            for keys in shards:
                pipe.xrange(keys.dead, min=dead_id, max=dead_id, count=1)
    replies = await pipe.execute(raise_on_error=False)
    letters = []
    for position, entries in enumerate(replies):
        keys = shards[position % len(shards)]
        for entry_id, fields in entries if isinstance(entries, list) else []:
            letter = dead_letters.parse(entry_id, fields, keys.dead)
            if reason is None or letter.reason == reason:
                letters.append(letter)
    return letters[:MAX_PER_CALL]


async def replay(state: DashboardState, viewer: Viewer, dead_ids: Sequence[str], reason: str | None,
                 *, where: str) -> dict[str, Any]:
    """Requeue the letters as new attempts; those whose stream is no lane of the queue are reported, left alone."""
    replayed, refused = [], []
    for letter in await _letters(state, dead_ids, reason):
        try:
            new_id = await asyncio.to_thread(dead_letters.requeue, state.sync_client, state.layout, letter)
        except ValueError as exc:
            refused.append({"dead_id": letter.dead_id, "error": str(exc)})
            continue
        replayed.append({"dead_id": letter.dead_id, "request_id": letter.request_id, "entry_id": new_id})
    await record(state, viewer, "replay", [str(r["dead_id"]) for r in replayed], where=where, reason=reason)
    return {"replayed": replayed, "refused": refused}


async def discard(state: DashboardState, viewer: Viewer, dead_ids: Sequence[str], reason: str | None,
                  *, where: str) -> dict[str, Any]:
    letters = await _letters(state, dead_ids, reason)
    pipe = state.client.pipeline(transaction=False)
    for letter in letters:
        pipe.xdel(letter.dead_stream, letter.dead_id)
    removed = sum(int(n) for n in await pipe.execute()) if letters else 0
    await record(state, viewer, "discard", [letter.dead_id for letter in letters], where=where, reason=reason)
    return {"discarded": removed}


async def cancel(state: DashboardState, viewer: Viewer, request_id: str, *, where: str) -> dict[str, Any]:
    await state.producer.cancel(request_id)
    await record(state, viewer, "cancel", [request_id], where=where)
    return {"cancelled": request_id}


async def record(state: DashboardState, viewer: Viewer, action: str, targets: Sequence[str], *, where: str,
                 reason: str | None = None) -> None:
    """Log a change and add it to the queue's change log."""
    shown = ",".join(targets[:20]) + (f",+{len(targets) - 20}" if len(targets) > 20 else "")
    entry = {"ts": f"{time.time():.3f}", "actor": viewer.actor, "role": viewer.role, "via": viewer.via,
             "action": action, "count": str(len(targets)), "targets": shown, "reason": reason or "", "from": where}
    log.info("dashboard change", extra={"event": "dashboard_change", **entry})
    await state.client.xadd(state.layout.home.audit, entry, maxlen=AUDIT_MAX, approximate=True)  # type: ignore[arg-type]


async def recent(state: DashboardState) -> list[dict[str, str]]:
    entries = cast("list[tuple[bytes, dict[bytes, bytes]]]",
                   await state.client.xrevrange(state.layout.home.audit, count=AUDIT_SHOWN))
    return [{k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()}
            for _, fields in entries]
