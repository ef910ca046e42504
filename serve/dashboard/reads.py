"""What the dashboard's pages show, read from Redis with a bounded number of commands per view: ``XLEN``,
``XINFO``, ``XPENDING`` summaries, the workers hash with the server's time, the per-minute rate hashes, and
ranges of a fixed size (the front of a lane, the newest dead letters); never a scan of a whole stream.

The layouts are the producer's: lanes from ``producer.queue_stats.all_lanes`` (every shard, every model), lane stats and
the queue's ETA from ``producer.queue_stats.shape_stats``, heartbeats judged by the server's clock
(``protocol.heartbeat``), dead letters parsed by ``producer.dead_letters``.

Imports redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from tokenmill.producer import dead_letters, locate, queue_stats, token_stream
from tokenmill.protocol.heartbeat import READ_WORKERS_LUA, split_workers_reply
from tokenmill.protocol.keys import CONSUMER_GROUP, Lane
from tokenmill.protocol.rates import OUT, TOKENS
from tokenmill.protocol.schema import decode_request, decode_result
from tokenmill.serve.dashboard import series
from tokenmill.serve.dashboard.state import DashboardState

MAX_JOBS = 50  # jobs and batches listed (the newest)
MAX_FAILURES_SHOWN = 200  # failed rows a job's page lists
LANE_FRONT = 200  # entries read from the front of each lane to find a request (running ones are there)
DEEP_SEARCH = 20_000  # ... and on request ("search deeper"), per lane, in pages
DEAD_PAGE = 50  # dead letters per page
DEAD_SCAN = 2000  # newest dead letters a reason filter and the reason counts look at, per shard
TOKEN_ENTRIES = 4096  # token-stream entries a request's page reads
PREVIEW_BYTES = 64
STALLED_AFTER_S = 60.0  # a running job whose record has not changed this long is shown as stalled


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _entry_ms(entry_id: Any) -> int | None:
    try:
        return int(_text(entry_id).partition("-")[0])
    except ValueError:
        return None


async def _lanes(state: DashboardState) -> list[Lane]:
    pipe = state.client.pipeline(transaction=False)
    for keys in state.layout.shards:
        pipe.smembers(keys.models)
    registered: set[bytes] = set().union(*await pipe.execute())
    return queue_stats.all_lanes(state.layout, registered)


def _lane_info(reply: Any, now_s: float) -> tuple[float | None, int | None]:
    """The age of a lane's oldest entry and its ``entries-added`` (Redis >= 7), from an XINFO STREAM reply."""
    if not isinstance(reply, Mapping):
        return None, None
    first = reply.get("first-entry")
    first_ms = _entry_ms(first[0]) if first else None
    age_s = None if first_ms is None else max(0.0, now_s - first_ms / 1000)
    added = reply.get("entries-added")
    return age_s, int(added) if isinstance(added, int) else None


async def sample_lanes(state: DashboardState) -> None:
    """Write this minute's ``entries-added`` sample of every lane (the sampler's round; overview does it too)."""
    lanes = await _lanes(state)
    pipe = state.client.pipeline(transaction=False)
    pipe.execute_command("EVAL", READ_WORKERS_LUA, 1, state.layout.home.workers)
    for lane in lanes:
        pipe.xinfo_stream(lane.stream)
    replies = await pipe.execute(raise_on_error=False)
    _, now_s = split_workers_reply(replies[0])
    added = {lane.stream: count for lane, reply in zip(lanes, replies[1:])
             if (count := _lane_info(reply, now_s)[1]) is not None}
    pipe = state.client.pipeline(transaction=False)
    series.queue_added_samples(pipe, state.layout.home, now_s, added)
    await pipe.execute()


def worker_row(name: str, beat: Mapping[str, Any], *, is_stale: bool) -> dict[str, Any]:
    """One worker's row from its (decoded) heartbeat as ``shape_stats`` gives it."""
    if beat.get("undecodable"):
        return {"name": name, "status": "unreadable", "is_stale": True}
    status = "stale" if is_stale and beat.get("state") != "stopped" else str(beat.get("state", "running"))
    shards = beat.get("shards")
    return {"name": name, "model": beat.get("served_model_name") or beat.get("model") or "-",
            "role": beat.get("role") or "both", "shards": "all" if not shards or shards == 1 else f"all {shards}",
            "status": status, "is_stale": is_stale, "running": beat.get("running", 0),
            "waiting": beat.get("waiting", 0), "kv_usage": beat.get("kv_usage"),
            "tokens_per_s": beat.get("tokens_per_s", 0.0), "spec_acceptance": beat.get("spec_acceptance_rate"),
            "age_s": beat.get("age_s"), "version": beat.get("version") or "-", "host": beat.get("host"),
            "pid": beat.get("pid"), "num_finished": beat.get("num_finished", 0),
            "prefix_hit_ratio": beat.get("prefix_hit_ratio"), "backlog_tokens": beat.get("backlog_tokens"),
            "mean_length": beat.get("mean_length"), "model_names": beat.get("model_names", [])}


def _worker_rows(stats: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = [worker_row(name, beat, is_stale=False) for name, beat in stats["workers"].items()]
    rows += [worker_row(name, beat, is_stale=True) for name, beat in stats["stale_workers"].items()]
    return sorted(rows, key=lambda row: (row["is_stale"], row["name"]))


async def overview(state: DashboardState) -> dict[str, Any]:
    """Lanes (depth, pending, oldest entry, rates), totals, the fleet's backlog and ETA, the hour's charts, the
    workers. Three round trips, ``~5 * lanes + 66`` commands, whatever the depth or the number of workers."""
    lanes = await _lanes(state)
    layout = state.layout
    pipe = state.client.pipeline(transaction=False)
    queue_stats.queue_stats_commands(pipe, layout, lanes)
    num_stats = 3 * len(lanes) + 2 * len(layout.shards) + 1
    for lane in lanes:
        pipe.xinfo_stream(lane.stream)
    replies = await pipe.execute(raise_on_error=False)
    stats = queue_stats.shape_stats(layout, lanes, replies[:num_stats], stale_after_s=state.stale_after_s)
    _, now_s = split_workers_reply(replies[num_stats - 1])
    infos = {lane.stream: _lane_info(reply, now_s) for lane, reply in zip(lanes, replies[num_stats:])}
    now_ms = int(now_s * 1000)
    live_added = {stream: (now_ms, added) for stream, (_, added) in infos.items() if added is not None}
    minutes = series.window(now_s)
    pipe = state.client.pipeline(transaction=False)
    series.queue_bucket_reads(pipe, layout.home, minutes)
    series.queue_added_samples(pipe, layout.home, now_s, {s: added for s, (_, added) in live_added.items()})
    replies = await pipe.execute(raise_on_error=False)
    buckets = series.Buckets(minutes, replies[:len(minutes)], now_s, live_added)
    lane_rows = []
    for lane in stats["lanes"]:
        stream = lane["stream"]
        age_s, added = infos.get(stream, (None, None))
        ins, outs, toks = buckets.in_rate([stream]), buckets.rate(OUT, [stream]), buckets.rate(TOKENS, [stream])
        is_busy = bool(lane["depth"] or lane["pending"] or any(outs) or any(v for v in ins if v))
        lane_rows.append({**lane, "is_busy": is_busy, "oldest_age_s": age_s, "entries_added": added,
                          "in_per_s": buckets.latest(ins),
                          "out_per_s": buckets.latest(outs), "tokens_per_s": buckets.latest(toks),
                          "out_series": buckets.charted(outs),
                          "in_series": ins})
    models: dict[str, dict[str, Any]] = {}
    for row in lane_rows:
        model = models.setdefault(row["model"] or "(any)", {"model": row["model"] or "(any)", "depth": 0,
                                                            "pending": 0, "streams": []})
        model["depth"] += row["depth"] if isinstance(row["depth"], int) else 0
        model["pending"] += row["pending"]
        model["streams"].append(row["stream"])
    for model in models.values():
        streams = model.pop("streams")
        model["in_per_s"] = buckets.latest(buckets.in_rate(streams))
        model["out_per_s"] = buckets.latest(buckets.rate(OUT, streams))
        model["tokens_per_s"] = buckets.latest(buckets.rate(TOKENS, streams))
    ins, outs, toks = buckets.in_rate(), buckets.rate(OUT), buckets.rate(TOKENS)
    eta_s = stats["eta_s"]
    return {
        "queue": stats["queue"], "now_s": now_s, "shards": len(layout.shards),
        "totals": {"depth": stats["depth"], "pending": stats["pending"], "dead": stats["dead"],
                   "cancelled": stats["cancelled"], "live_workers": stats["num_live_workers"],
                   "stale_workers": len(stats["stale_workers"]), "backlog_tokens": stats["backlog_tokens"],
                   "eta_s": eta_s, "drained_at": None if eta_s is None else now_s + eta_s,
                   "in_per_s": buckets.latest(ins), "out_per_s": buckets.latest(outs),
                   "tokens_per_s": buckets.latest(toks),
                   "fleet_tokens_per_s": sum(w["tokens_per_s"] for w in stats["workers"].values())},
        "lanes": lane_rows, "models": sorted(models.values(), key=lambda m: m["model"]),
        "series": {"minutes": minutes, "in_per_s": ins, "out_per_s": outs, "tokens_per_s": toks},
        "charts": {"in_per_s": buckets.charted(ins), "out_per_s": buckets.charted(outs),
                   "tokens_per_s": buckets.charted(toks)},
        "has_added": bool(live_added) or not lane_rows,
        "workers": _worker_rows(stats),
    }


async def _workers_and_time(state: DashboardState) -> tuple[list[dict[str, Any]], float]:
    pipe = state.client.pipeline(transaction=False)
    pipe.execute_command("EVAL", READ_WORKERS_LUA, 1, state.layout.home.workers)
    (reply,) = await pipe.execute()
    # NOTE: shape_stats judges the beats (the server's clock); lanes are not needed for them
    stats = queue_stats.shape_stats(state.layout, [], [0, 0] * len(state.layout.shards) + [reply],
                               stale_after_s=state.stale_after_s)
    _, now_s = split_workers_reply(reply)
    return _worker_rows(stats), now_s


async def workers(state: DashboardState) -> dict[str, Any]:
    rows, now_s = await _workers_and_time(state)
    return {"now_s": now_s, "workers": rows, "live": sum(not row["is_stale"] for row in rows),
            "stale": sum(row["is_stale"] for row in rows)}


async def worker(state: DashboardState, name: str) -> dict[str, Any] | None:
    """One worker's heartbeat and its results and tokens per second over the hour; None when it has no beat."""
    rows, now_s = await _workers_and_time(state)
    row = next((row for row in rows if row["name"] == name), None)
    if row is None:
        return None
    minutes = series.window(now_s)
    pipe = state.client.pipeline(transaction=False)
    series.queue_bucket_reads(pipe, state.layout.home, minutes, of_workers=True)
    buckets = series.Buckets(minutes, await pipe.execute(raise_on_error=False), now_s)
    outs, toks = buckets.rate(OUT, [name]), buckets.rate(TOKENS, [name])
    return {"now_s": now_s, "worker": row, "series": {"minutes": minutes, "out_per_s": outs, "tokens_per_s": toks},
            "charts": {"out_per_s": buckets.charted(outs), "tokens_per_s": buckets.charted(toks)}}


def _job_row(job_id: str, raw: Mapping[Any, Any], now_s: float) -> dict[str, Any]:
    fields = {_text(k): _text(v) for k, v in raw.items()}

    def number(name: str) -> float | None:
        try:
            return float(fields[name]) if fields.get(name) else None
        except ValueError:
            return None

    total, ok, failed, skipped = (int(number(name) or 0) for name in ("total", "ok", "failed", "skipped"))
    updated = number("updated_at")
    job_state = fields.get("state", "running")
    if job_state == "running" and updated is not None and now_s - updated > STALLED_AFTER_S:
        job_state = "stalled"
    done = ok + failed + skipped
    return {"id": job_id, "kind": fields.get("kind", "bulk"), "state": job_state, "total": total, "ok": ok,
            "failed": failed, "skipped": skipped, "done": done, "progress": done / total if total else 0.0,
            "tokens": int(number("tokens") or 0), "backlog_tokens": number("backlog_tokens"),
            "eta_s": number("eta_s") if job_state == "running" else None, "eta_error": number("eta_error"),
            "tokens_per_s": number("tokens_per_s"), "started_at": number("started_at"), "updated_at": updated,
            "input": fields.get("input", ""), "output": fields.get("output", "")}


def _batch_fields(raw: Sequence[Any]) -> dict[str, Any]:
    names = ("status", "request_counts", "created_at", "endpoint")
    out: dict[str, Any] = {}
    for name, value in zip(names, raw):
        try:
            out[name] = json.loads(value) if value is not None else None
        except ValueError:
            out[name] = None
    return out


async def jobs(state: DashboardState) -> dict[str, Any]:
    """The newest bulk jobs and batches (their progress records), and batches that have none (not started yet, or
    run by an older release) from their batch objects."""
    home = state.layout.home
    pipe = state.client.pipeline(transaction=False)
    pipe.execute_command("EVAL", READ_WORKERS_LUA, 1, home.workers)
    pipe.zrevrange(home.jobs, 0, MAX_JOBS - 1)
    pipe.zrevrange(home.batches, 0, MAX_JOBS - 1)
    reply, job_ids, batch_ids = await pipe.execute()
    _, now_s = split_workers_reply(reply)
    job_ids, batch_ids = [_text(i) for i in job_ids], [_text(i) for i in batch_ids]
    pipe = state.client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hgetall(home.job(job_id))
    for batch_id in batch_ids:
        pipe.hmget(home.batch(batch_id), ["status", "request_counts", "created_at", "endpoint"])
    replies = await pipe.execute(raise_on_error=False)
    rows = [_job_row(job_id, raw, now_s) for job_id, raw in zip(job_ids, replies) if isinstance(raw, Mapping) and raw]
    batches = {batch_id: _batch_fields(raw) for batch_id, raw in zip(batch_ids, replies[len(job_ids):])
               if isinstance(raw, list) and raw[0] is not None}
    for row in rows:
        row["batch_status"] = batches.get(row["id"], {}).get("status")
    known = {row["id"] for row in rows}
    for batch_id, batch in batches.items():
        if batch_id in known:
            continue
        counts = batch.get("request_counts") or {}
        total, completed, failed = (int(counts.get(name, 0)) for name in ("total", "completed", "failed"))
        rows.append({"id": batch_id, "kind": "batch", "state": batch.get("status") or "-", "total": total,
                     "ok": completed, "failed": failed, "skipped": 0, "done": completed + failed,
                     "progress": (completed + failed) / total if total else 0.0, "tokens": None,
                     "backlog_tokens": None, "eta_s": None, "eta_error": None, "tokens_per_s": None,
                     "started_at": batch.get("created_at"), "updated_at": None, "input": "", "output": "",
                     "batch_status": batch.get("status")})
    rows.sort(key=lambda row: row["started_at"] or 0, reverse=True)
    return {"now_s": now_s, "jobs": rows}


async def job(state: DashboardState, job_id: str) -> dict[str, Any] | None:
    """One job's progress and its failed rows (newest first); None when it has no record."""
    home = state.layout.home
    pipe = state.client.pipeline(transaction=False)
    pipe.execute_command("EVAL", READ_WORKERS_LUA, 1, home.workers)
    pipe.hgetall(home.job(job_id))
    pipe.lrange(home.job_failures(job_id), 0, MAX_FAILURES_SHOWN - 1)
    pipe.llen(home.job_failures(job_id))
    reply, raw, failures, num_failures = await pipe.execute(raise_on_error=False)
    if not isinstance(raw, Mapping) or not raw:
        return None
    _, now_s = split_workers_reply(reply)
    rows = []
    for item in failures if isinstance(failures, list) else []:
        try:
            failure = json.loads(item)
        except ValueError:
            continue
        if isinstance(failure, dict):
            rows.append(failure)
    codes = Counter(str(row.get("code")) for row in rows)
    return {"now_s": now_s, "job": _job_row(job_id, raw, now_s), "failures": rows,
            "num_failures": num_failures if isinstance(num_failures, int) else len(rows),
            "codes": dict(codes.most_common())}


def _preview(data: bytes) -> str:
    """The first bytes of an entry's payload, printable (msgpack shows its strings: the prompt, the id)."""
    head = data[:PREVIEW_BYTES]
    text = "".join(chr(b) if 32 <= b < 127 else "." for b in head)
    return text + ("..." if len(data) > PREVIEW_BYTES else "")


def _request_summary(fields: Mapping[bytes, bytes]) -> dict[str, Any]:
    try:
        request = decode_request(dict(fields))
    except Exception:  # noqa: BLE001 - any bytes at all may sit in a lane: shown as they are
        return {}
    prompt = request.prompt if request.prompt is not None else (
        request.messages[-1].content if request.messages else f"{len(request.prompt_token_ids or [])} token ids")
    return {"submitted_at": request.submitted_at, "priority": request.priority, "model": request.model,
            "max_tokens": request.params.max_tokens, "prompt": str(prompt)[:500], "reply_to": request.reply_to,
            "stream_tokens": request.stream_tokens, "deadline": request.deadline}


async def request_info(state: DashboardState, request_id: str, *, deep: bool = False) -> dict[str, Any]:
    """Where a request is and what it has: its result (status, text or error, timings, tokens) once answered; else
    the lane it waits in (searched at the front, where running entries are; ``deep`` reads further, in pages), the
    worker running it and its deliveries; its token stream so far; a dead letter of it."""
    keys = state.layout.for_id(request_id)
    pipe = state.client.pipeline(transaction=False)
    pipe.execute_command("EVAL", READ_WORKERS_LUA, 1, state.layout.home.workers)
    pipe.get(keys.result(request_id))
    pipe.xrange(keys.tokens(request_id), count=TOKEN_ENTRIES)
    pipe.zscore(keys.cancel, request_id)
    pipe.xrevrange(keys.dead, count=LANE_FRONT)
    workers_reply, raw_result, tokens, cancelled_at, dead = await pipe.execute(raise_on_error=False)
    _, now_s = split_workers_reply(workers_reply)
    info: dict[str, Any] = {"id": request_id, "now_s": now_s, "shard": state.layout.shard_of(request_id),
                            "cancel_requested": isinstance(cancelled_at, float), "result": None, "lane": None,
                            "worker": None, "deliveries": None, "position": None, "entry": {}, "dead": None,
                            "is_deep": deep}
    if isinstance(tokens, list) and tokens:
        reader = token_stream.TokenStreamReader()
        info["stream_text"] = "".join(reader.feed([[keys.tokens(request_id), tokens]]))
        info["stream_done"] = reader.is_done
    if isinstance(raw_result, bytes):
        result = decode_result(raw_result)
        info["result"] = result.model_dump(mode="json", exclude={"token_ids", "logprobs", "token_logprobs"})
        info["status"] = "finished" if result.ok else result.status
    for entry_id, fields in dead if isinstance(dead, list) else []:
        letter = dead_letters.parse(entry_id, fields, keys.dead)
        if letter.request_id == request_id:
            info["dead"] = {"dead_id": letter.dead_id, "reason": letter.reason, "stream": letter.stream}
            break
    if info["result"] is None:
        await _find_in_lanes(state, request_id, info, deep=deep)
    if "status" not in info:
        info["status"] = ("running" if info["worker"] else "waiting" if info["lane"] else
                          "dead letter" if info["dead"] else "running" if info.get("stream_text") is not None
                          else "unknown")
    return info


async def _find_in_lanes(state: DashboardState, request_id: str, info: dict[str, Any], *, deep: bool) -> None:
    """Fill ``info`` with the lane entry of ``request_id`` (on its shard), its position and its pending state."""
    shard = state.layout.shard_of(request_id)
    lanes = [lane for lane in await _lanes(state) if lane.shard == shard]
    limit = DEEP_SEARCH if deep else LANE_FRONT
    starts: dict[str, str] = {lane.stream: "-" for lane in lanes}
    seen: dict[str, int] = dict.fromkeys(starts, 0)
    while starts:
        pipe = state.client.pipeline(transaction=False)
        for stream, start in starts.items():
            pipe.xrange(stream, min=start, count=min(LANE_FRONT * 5 if deep else LANE_FRONT, limit))
        replies = await pipe.execute(raise_on_error=False)
        following: dict[str, str] = {}
        for (stream, _), entries in zip(starts.items(), replies):
            if not isinstance(entries, list):
                continue
            for index, (entry_id, fields) in enumerate(entries):
                if locate.ids_in_entries([(entry_id, fields)], {request_id}):
                    await _describe_entry(state, stream, entry_id, fields, seen[stream] + index, info)
                    return
            seen[stream] += len(entries)
            if entries and seen[stream] < limit and len(entries) >= LANE_FRONT:
                following[stream] = "(" + _text(entries[-1][0])
        starts = following


async def _describe_entry(state: DashboardState, stream: str, entry_id: Any, fields: Mapping[bytes, bytes],
                          position: int, info: dict[str, Any]) -> None:
    lane = state.layout.for_stream(stream).parse_lane(stream)
    info["lane"] = {"stream": stream, "priority": lane.priority if lane else None,
                    "model": lane.model if lane else None, "entry_id": _text(entry_id), "position": position,
                    "preview": _preview(fields.get(b"d", b""))}
    info["entry"] = _request_summary(fields)
    try:
        pending = await state.client.xpending_range(stream, CONSUMER_GROUP, min=entry_id, max=entry_id, count=1)
    except redis.ResponseError:  # NOTE: no group yet: no worker ever read the lane
        pending = []
    if pending:
        entry = pending[0]
        info["worker"] = _text(entry["consumer"])
        info["deliveries"] = int(entry["times_delivered"])
        info["idle_s"] = int(entry["time_since_delivered"]) / 1000


async def dead_page(state: DashboardState, *, reason: str | None = None, before: str | None = None) -> dict[str, Any]:
    """A page of dead letters, newest first (``before``: an entry id, for the next page), optionally of one
    ``reason`` (looked for among the newest :data:`DEAD_SCAN` of each shard), with counts by reason over those."""
    shards = state.layout.shards
    pipe = state.client.pipeline(transaction=False)
    for keys in shards:
        pipe.xlen(keys.dead)
        pipe.xrevrange(keys.dead, max=f"({before}" if before else "+", count=DEAD_SCAN if reason else DEAD_PAGE)
        pipe.xrevrange(keys.dead, count=min(DEAD_SCAN, 1000))
    replies = await pipe.execute(raise_on_error=False)
    total = 0
    letters: list[dead_letters.DeadLetter] = []
    reasons: Counter[str] = Counter()
    for position, keys in enumerate(shards):
        count, page, newest = replies[3 * position: 3 * position + 3]
        total += count if isinstance(count, int) else 0
        for entry_id, fields in page if isinstance(page, list) else []:
            letters.append(dead_letters.parse(entry_id, fields, keys.dead))
        for _, fields in newest if isinstance(newest, list) else []:
            reasons[_text(fields.get(b"reason", b""))] += 1
    if reason:
        letters = [letter for letter in letters if letter.reason == reason]
    letters.sort(key=lambda letter: tuple(int(p) for p in letter.dead_id.split("-")), reverse=True)
    page_letters = letters[:DEAD_PAGE]
    rows = [{**letter.as_dict(), "shard": state.layout.shard_of_stream(letter.dead_stream),
             "at_s": (_entry_ms(letter.dead_id) or 0) / 1000, "preview": _preview(letter.fields.get(b"d", b""))}
            for letter in page_letters]
    return {"total": total, "letters": rows, "reasons": dict(reasons.most_common(20)), "reason": reason,
            "next_before": page_letters[-1].dead_id if len(letters) > DEAD_PAGE else None}
