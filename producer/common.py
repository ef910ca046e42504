"""Pure helpers shared by the sync and asyncio producers: building requests, deadlines,
reading results and shaping stats. No I/O here. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import codecs
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

import msgpack
from pydantic import ValidationError

from producer.config import MAX_BLOCK_S
from producer.errors import JobFailed, ResultTimeout, SchemaError
from producer.keys import CONSUMER_GROUP, Keys
from producer.schema import (
    ErrorCode,
    GenerationRequest,
    GenerationResult,
    Message,
    SamplingParams,
    decode_result,
    describe_validation_error,
)

# Longest single blocking command; a wait longer than this is a loop of such slices, each
# followed by a re-check of the result keys (so a lost wake-up costs at most one slice).
WAIT_SLICE_S = MAX_BLOCK_S
# Token streams re-check the result key this often, to end streams of requests that
# finished without a token stream (e.g. errors, or stream_tokens=False).
STREAM_SLICE_S = 0.5
DONE_KEYS_PER_BLPOP = 256
MGET_CHUNK = 1000

# NOTE: the multiple-waiter scheme. The worker pushes one token onto the done list; a
# waiter's BLPOP consumes it, so the waiter puts it back for the others, but only while the
# result exists (else a waiter would pop and re-push forever). One script = one round trip
# that also returns the result. KEYS: result, done. ARGV: token, ttl seconds.
REARM_SCRIPT = """
local value = redis.call('GET', KEYS[1])
if value then
  redis.call('LPUSH', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return value
"""

_SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
_REQUEST_FIELDS = frozenset({"prompt", "messages", "prompt_token_ids", "deadline", "reply_to",
                             "stream_tokens", "metadata", "model"})


class SubmitOptions(TypedDict, total=False):
    """Keyword arguments of ``submit``; dict items of ``submit_many`` use the same keys."""

    prompt: str
    messages: Sequence[Message | Mapping[str, Any]]
    prompt_token_ids: Sequence[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_tokens: int
    seed: int | None
    stop: str | Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: int | None
    priority: Literal["high", "normal", "low"] | int
    request_id: str | None
    deadline: float | None
    reply_to: str | None
    stream_tokens: bool
    metadata: Mapping[str, Any] | None
    model: str | None


def build_request(keys: Keys, options: Mapping[str, Any]) -> GenerationRequest:
    """Validate ``submit`` options into a request, before anything is sent.

    ``None`` values mean "default"; ``priority`` defaults to ``"normal"``.

    Raises:
        SchemaError: code ``validation``, one clause per bad field.
    """
    unknown = set(options) - _SAMPLING_FIELDS - _REQUEST_FIELDS - {"priority", "request_id"}
    if unknown:
        raise SchemaError(ErrorCode.VALIDATION.value, f"unknown submit option(s): {', '.join(sorted(unknown))}")
    given = {name: value for name, value in options.items() if value is not None}
    data: dict[str, Any] = {name: value for name, value in given.items() if name in _REQUEST_FIELDS}
    data["params"] = {name: value for name, value in given.items() if name in _SAMPLING_FIELDS}
    if "request_id" in given:
        data["id"] = given["request_id"]
    try:
        data["priority"] = keys.lane_of(given.get("priority", "normal"))
        return GenerationRequest.model_validate(data)
    except ValidationError as exc:
        raise SchemaError(ErrorCode.VALIDATION.value, describe_validation_error(exc)) from None
    except ValueError as exc:
        raise SchemaError(ErrorCode.VALIDATION.value, f"priority: {exc}") from None


def coerce_request(keys: Keys, item: GenerationRequest | Mapping[str, Any]) -> GenerationRequest:
    """A ``submit_many`` item as a request whose lane exists on this queue.

    Raises:
        SchemaError: code ``validation``.
    """
    if not isinstance(item, GenerationRequest):
        return build_request(keys, item)
    if item.priority >= keys.num_lanes:
        raise SchemaError(ErrorCode.VALIDATION.value, f"priority: lane {item.priority} >= num_lanes {keys.num_lanes}")
    return item


class Deadline:
    """A wait budget: ``timeout_s=None`` waits forever."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._end = math.inf if timeout_s is None else time.monotonic() + timeout_s

    @property
    def is_expired(self) -> bool:
        return time.monotonic() >= self._end

    def slice_s(self, cap_s: float) -> float:
        """Seconds to block next: the remaining budget, at most ``cap_s``, at least 1 ms."""
        return max(0.001, min(cap_s, self._end - time.monotonic()))


class TokenStreamReader:
    """Decodes a token stream's entries (``t`` = UTF-8 bytes of a text delta, ``end`` = last)
    for both producers: a character split across two entries comes out whole."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.last_id: bytes = b"0"
        self.is_done = False

    def feed(self, reply: Any) -> list[str]:
        """Text deltas of one XREAD reply; sets ``is_done`` at the end marker."""
        entries: list[tuple[bytes, dict[bytes, bytes]]] = reply[0][1] if reply else []
        texts: list[str] = []
        for entry_id, fields in entries:
            self.last_id = entry_id
            is_end = b"end" in fields
            text = self._decoder.decode(fields.get(b"t", b""), final=is_end)
            if text:
                texts.append(text)
            if is_end:
                self.is_done = True
                break
        return texts


def finish(raw: bytes, *, raise_on_error: bool) -> GenerationResult:
    """Decode a stored result; raise :class:`JobFailed` for non-ok ones when asked."""
    result = decode_result(raw)
    if raise_on_error and not result.ok:
        raise JobFailed(result)
    return result


def timeout_error(missing_ids: Sequence[str], timeout_s: float | None) -> ResultTimeout:
    if len(missing_ids) == 1:
        return ResultTimeout(f"no result for request {missing_ids[0]!r} within {timeout_s} s")
    shown = ", ".join(repr(i) for i in missing_ids[:5]) + (", ..." if len(missing_ids) > 5 else "")
    return ResultTimeout(f"{len(missing_ids)} results did not land within {timeout_s} s: {shown}")


def rotate(pending: Sequence[str], offset: int) -> list[str]:
    """The next batch of ids to BLPOP on, starting at ``offset`` (wrapping)."""
    start = offset % len(pending)
    batch = list(pending[start:start + DONE_KEYS_PER_BLPOP])
    return batch + list(pending[: DONE_KEYS_PER_BLPOP - len(batch)]) if start else batch


def done_keys(keys: Keys, request_ids: Sequence[str]) -> dict[str, str]:
    """Done-list key to request id."""
    return {keys.done(request_id): request_id for request_id in request_ids}


def queue_stats_commands(pipe: Any, keys: Keys) -> None:
    """Queue the commands whose replies :func:`shape_stats` reads (sync or asyncio pipeline)."""
    for lane in keys.lanes:
        pipe.xlen(lane)
        pipe.xpending(lane, CONSUMER_GROUP)
        pipe.xinfo_groups(lane)
    pipe.xlen(keys.dead)
    pipe.zcard(keys.cancel)
    pipe.hgetall(keys.workers)


def shape_stats(keys: Keys, replies: Sequence[Any], *, stale_after_s: float) -> dict[str, Any]:
    """Stats from the replies of :func:`queue_stats_commands` (errors returned, not raised) and the workers hash."""
    lanes = []
    for k in range(keys.num_lanes):
        depth, pending, groups = replies[3 * k: 3 * k + 3]
        group = _find_group(groups)
        lanes.append({
            "lane": k,
            "stream": keys.lane(k),
            "depth": depth,
            "pending": 0 if isinstance(pending, Exception) else int(pending["pending"]),
            "lag": None if group is None else group.get("lag"),
            "has_group": group is not None,
        })
    dead, num_cancelled, workers = replies[3 * keys.num_lanes:]
    now = time.time()
    live: dict[str, Any] = {}
    stale: dict[str, Any] = {}
    for name, raw in workers.items():
        try:
            info = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            ts = float(info["ts"])
        except Exception:  # noqa: BLE001 - a garbled heartbeat counts as stale, it must not break stats
            info, ts = {"undecodable": True}, 0.0
        (live if now - ts <= stale_after_s else stale)[name.decode(errors="replace")] = info
    return {
        "queue": keys.base,
        "lanes": lanes,
        "depth": sum(lane["depth"] for lane in lanes),
        "pending": sum(lane["pending"] for lane in lanes),
        "dead": dead,
        "cancelled": num_cancelled,
        "num_live_workers": len(live),
        "workers": live,
        "stale_workers": stale,
    }


def _find_group(groups: Any) -> dict[str, Any] | None:
    if isinstance(groups, Exception):
        return None
    for group in groups:
        name = group.get("name")
        if name in (CONSUMER_GROUP, CONSUMER_GROUP.encode()):
            return dict(group)
    return None
