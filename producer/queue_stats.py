"""What a queue holds, as ``tokenmill status``, ``Producer.stats`` and the dashboard show it: every lane of every
shard (the shared ones and each registered model's), their depth, pending and lag, the dead letters and cancel
marks, the workers judged by the server's clock, and the queue's predicted backlog and ETA (producer/eta.py).
Queued on a sync or asyncio pipeline alike; no I/O here. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tokenmill.producer.eta import queue_eta
from tokenmill.protocol.heartbeat import READ_WORKERS_LUA, Heartbeat, decode_heartbeat, split_workers_reply
from tokenmill.protocol.keys import CONSUMER_GROUP, Lane
from tokenmill.protocol.shards import QueueLayout


def all_lanes(layout: QueueLayout, registered: Iterable[bytes | str]) -> list[Lane]:
    """Every lane of the queue, of every shard: the shared ones and those of each model in ``registered`` (the
    replies to SMEMBERS of the shards' :attr:`Keys.models`), most urgent first, then the decode pool's lanes of
    them (prefill workers' hand-offs; :func:`shape_stats` leaves out those that do not exist).

    NOTE: anyone may write to the set: a name that is not UTF-8 is read with replacement characters,
    which names lanes that hold nothing, never an error.
    """
    models = [name.decode(errors="replace") if isinstance(name, bytes) else name for name in registered]
    return layout.lanes_for(models) + layout.lanes_for(models, is_decode=True)


def queue_stats_commands(pipe: Any, layout: QueueLayout, lanes: Sequence[Lane]) -> None:
    """Queue the commands whose replies :func:`shape_stats` reads (sync or asyncio pipeline)."""
    for lane in lanes:
        pipe.xlen(lane.stream)
        pipe.xpending(lane.stream, CONSUMER_GROUP)
        pipe.xinfo_groups(lane.stream)
    for keys in layout.shards:
        pipe.xlen(keys.dead)
        pipe.zcard(keys.cancel)
    # NOTE: the workers hash with the server's time, from its node: heartbeats are judged by that clock only.
    # execute_command, as redis-py's sync cluster pipeline has no eval(); EVAL routes by its key on every client.
    pipe.execute_command("EVAL", READ_WORKERS_LUA, 1, layout.home.workers)


def shape_stats(layout: QueueLayout, lanes: Sequence[Lane], replies: Sequence[Any], *,
                stale_after_s: float) -> dict[str, Any]:
    """Stats of ``lanes`` from the replies of :func:`queue_stats_commands` (errors returned, not raised) and
    the workers hash, with the queue's predicted backlog in completion tokens and its ETA (producer/eta.py).
    Depth, pending, dead letters and cancel marks add up every shard; ``shards`` has each shard's."""
    lane_stats = []
    for position, lane in enumerate(lanes):
        depth, pending, groups = replies[3 * position: 3 * position + 3]
        group = _find_group(groups)
        if lane.is_decode and not depth and group is None:
            continue  # NOTE: no prefill worker ever handed off through it (no fleet of pools)
        lane_stats.append({
            "lane": lane.priority,
            "pool": "decode" if lane.is_decode else "request",
            "model": lane.model,
            "shard": lane.shard,
            "stream": lane.stream,
            "depth": depth,
            "pending": 0 if isinstance(pending, Exception) else int(pending["pending"]),
            "lag": None if group is None else group.get("lag"),
            "has_group": group is not None,
        })
    rest = replies[3 * len(lanes):]
    dead = sum(int(n) for n in rest[0:-1:2] if isinstance(n, int))
    num_cancelled = sum(int(n) for n in rest[1:-1:2] if isinstance(n, int))
    workers, now_s = split_workers_reply(rest[-1])
    live: dict[str, Any] = {}
    stale: dict[str, Any] = {}
    live_beats: list[Heartbeat] = []
    for name, raw in workers.items():
        beat = decode_heartbeat(name, raw)
        if beat is None:  # NOTE: a garbled heartbeat counts as stale; it must not break stats
            stale[name] = {"undecodable": True}
            continue
        # age by the server's clock; None for a beat from the future (stale: protocol/heartbeat.py), never negative
        age_s = None if beat.is_from_future(now_s) else round(beat.age_s(now_s), 3)
        if beat.is_stale(now_s, stale_after_s):
            stale[name] = {**beat.model_dump(), "age_s": age_s}
        else:
            live[name] = {**beat.model_dump(), "age_s": age_s}
            live_beats.append(beat)
    return {
        "queue": layout.home.base,
        "models": sorted({lane.model for lane in lanes if lane.model is not None}),
        "lanes": lane_stats,
        "shards": _shard_stats(layout, lane_stats),
        "depth": sum(lane["depth"] for lane in lane_stats),
        "pending": sum(lane["pending"] for lane in lane_stats),
        "dead": dead,
        "cancelled": num_cancelled,
        "num_live_workers": len(live),
        "workers": live,
        "stale_workers": stale,
        **queue_eta(live_beats, _undelivered(lane_stats)).as_dict(),
    }


def _shard_stats(layout: QueueLayout, lane_stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Depth, pending and lag (None where a lane's is unknown) of each shard, summed over its lanes."""
    out = []
    for shard, keys in enumerate(layout.shards):
        lanes = [lane for lane in lane_stats if lane["shard"] == shard]
        lags = [lane["lag"] for lane in lanes]
        out.append({"shard": shard, "base": keys.base, "depth": sum(lane["depth"] for lane in lanes),
                    "pending": sum(lane["pending"] for lane in lanes),
                    "lag": None if any(lag is None for lag in lags) else sum(int(lag) for lag in lags)})
    return out


def _undelivered(lane_stats: list[dict[str, Any]]) -> int | None:
    """Entries of the lanes not yet delivered to the group: its lag, or the whole stream before the group exists;
    None when a lane's lag is unknown (Redis < 7)."""
    total = 0
    for lane in lane_stats:
        if lane["lag"] is not None:
            total += int(lane["lag"])
        elif not lane["has_group"] and isinstance(lane["depth"], int):
            total += lane["depth"]
        else:
            return None
    return total


def _find_group(groups: Any) -> dict[str, Any] | None:
    if isinstance(groups, Exception):
        return None
    for group in groups:
        name = group.get("name")
        if name in (CONSUMER_GROUP, CONSUMER_GROUP.encode()):
            return dict(group)
    return None
