"""Pure helpers shared by the sync and asyncio producers: building requests, deadlines,
reading results and shaping stats. No I/O here. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import codecs
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import redis
from pydantic import ValidationError

from tokenmill.producer.errors import JobFailed, ResultTimeout, SubmitUncertain
from tokenmill.producer.eta import queue_eta
from tokenmill.protocol.config import MAX_BLOCK_S
from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.heartbeat import READ_WORKERS_LUA, Heartbeat, decode_heartbeat, split_workers_reply
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys, Lane
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.sampling import ResponseFormat, SamplingParams
from tokenmill.protocol.schema import (
    GenerationRequest,
    GenerationResult,
    Message,
    ToolSpec,
    check_reply_to,
    decode_result,
    describe_validation_error,
    encode_request,
    peek_request_id,
)
from tokenmill.protocol.shards import QueueLayout

# Longest single blocking command; a wait longer than this is a loop of such slices, each
# followed by a re-check of the result keys (so a lost wake-up costs at most one slice).
WAIT_SLICE_S = MAX_BLOCK_S
# Token streams re-check the result key this often, to end streams of requests that
# finished without a token stream (e.g. errors, or stream_tokens=False).
STREAM_SLICE_S = 0.5
DONE_KEYS_PER_BLPOP = 256
# NOTE: on a cluster one BLPOP watches the done lists of one shard only: while results are awaited on several
# shards, each wait is this short, in turn over the shards (a result on another shard waits at most about this
# long per shard to be seen).
SHARDED_WAIT_SLICE_S = 0.05
MGET_CHUNK = 1000
LOCATE_PAGE = 1000  # lane entries per XRANGE while looking requests up (Producer.locate)

# Where a request is (Producer.locate): in a lane (waiting or running), answered, or neither.
RequestState = Literal["queued", "finished", "unknown"]

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

# NOTE: the submit-once scheme (Celery tasks, bulk jobs): a marker per id, set NX with the result's
# lifetime, guards the XADD, so a re-run or redelivery never queues an id twice. A first submit also
# clears an old cancel mark of the id (it would pre-cancel this request), and registers the model of a
# request that names one. KEYS: marker, lane, cancel set[, models set]. ARGV: now (unix s), marker ttl
# ms, d, v, id[, model]. Returns the submit time of whoever submitted first.
SUBMIT_ONCE_SCRIPT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('ZREM', KEYS[3], ARGV[5])
  if KEYS[4] then redis.call('SADD', KEYS[4], ARGV[6]) end
  redis.call('XADD', KEYS[2], '*', 'd', ARGV[3], 'v', ARGV[4])
  return ARGV[1]
end
return redis.call('GET', KEYS[1])
"""

_SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
# A request's own fields a caller may set (id is request_id, priority a name or lane; the rest are the producer's).
_REQUEST_FIELDS = frozenset(GenerationRequest.model_fields) - {"id", "params", "priority", "submitted_at"}
# How a plain prompt reaches the model: resolved into the request's prompt or messages (as_request_prompt).
_PROMPT_STYLE_OPTIONS = frozenset({"raw", "system"})
# Options given as any Sequence / Mapping from Python; the strict wire models take lists and dicts.
_SEQUENCE_FIELDS = frozenset({"messages", "prompt_token_ids", "stop_token_ids", "stop", "tools"})


class SubmitOptions(TypedDict, total=False):
    """Keyword arguments of ``submit``; dict items of ``submit_many`` use the same keys."""

    n: int

    prompt: str
    raw: bool
    system: str | None
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
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    response_format: ResponseFormat | Mapping[str, Any] | None
    speculative: bool
    priority: Literal["high", "normal", "low"] | int
    request_id: str | None
    deadline: float | None
    reply_to: str | None
    stream_tokens: bool
    metadata: Mapping[str, Any] | None
    model: str | None
    tools: Sequence[ToolSpec | Mapping[str, Any]] | None


def build_request(keys: Keys, options: Mapping[str, Any]) -> GenerationRequest:
    """Validate ``submit`` options into a request, before anything is sent.

    ``None`` values mean "default"; ``priority`` defaults to ``"normal"``; a plain ``prompt`` is
    the user's message unless ``raw`` (see :func:`as_request_prompt`).

    Raises:
        SchemaError: code ``validation``, one clause per bad field.
    """
    unknown = set(options) - _SAMPLING_FIELDS - _REQUEST_FIELDS - _PROMPT_STYLE_OPTIONS - {"priority", "request_id"}
    if unknown:
        raise SchemaError(ErrorCode.VALIDATION.value, f"unknown submit option(s): {', '.join(sorted(unknown))}")
    given = {name: _as_plain(name, value) for name, value in as_request_prompt(options).items() if value is not None}
    data: dict[str, Any] = {name: value for name, value in given.items() if name in _REQUEST_FIELDS}
    data["params"] = {name: value for name, value in given.items() if name in _SAMPLING_FIELDS}
    if "request_id" in given:
        data["id"] = given["request_id"]
    try:
        data["priority"] = keys.lane_of(given.get("priority", "normal"))
        request = GenerationRequest.model_validate(data)
    except ValidationError as exc:
        raise SchemaError(ErrorCode.VALIDATION.value, describe_validation_error(exc)) from None
    except ValueError as exc:
        raise SchemaError(ErrorCode.VALIDATION.value, f"priority: {exc}") from None
    _check_for_queue(keys, request)
    return request


def _as_plain(name: str, value: Any) -> Any:
    """A Python-side convenience: tuples (any non-str sequence) as lists, mappings as dicts."""
    if name in _SEQUENCE_FIELDS and isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [dict(item) if isinstance(item, Mapping) else item for item in value]
    if name in ("metadata", "response_format") and isinstance(value, Mapping):
        return dict(value)
    return value


def coerce_request(keys: Keys, item: GenerationRequest | Mapping[str, Any]) -> GenerationRequest:
    """A ``submit_many`` item as a request whose lane and reply stream exist on this queue.

    Raises:
        SchemaError: code ``validation``.
    """
    if not isinstance(item, GenerationRequest):
        return build_request(keys, item)
    if item.priority >= keys.num_lanes:
        raise SchemaError(ErrorCode.VALIDATION.value, f"priority: lane {item.priority} >= num_lanes {keys.num_lanes}")
    _check_for_queue(keys, item)
    return item


def build_placed(layout: QueueLayout, options: Mapping[str, Any]) -> GenerationRequest:
    """:func:`build_request` on the queue's shards: without a ``request_id`` the id is chosen on the shard of the
    queue's placement (protocol/shards.py); a given id decides its shard itself.

    Raises:
        SchemaError: code ``validation``.
    """
    request = build_request(layout.home, options)
    return request if options.get("request_id") is not None else layout.placed(request)


def coerce_placed(layout: QueueLayout, item: GenerationRequest | Mapping[str, Any]) -> GenerationRequest:
    """:func:`coerce_request` on the queue's shards: a dict item without ``request_id`` is placed
    (:func:`build_placed`); a ``GenerationRequest`` keeps its id (the caller may know it already).

    Raises:
        SchemaError: code ``validation``.
    """
    if isinstance(item, GenerationRequest):
        return coerce_request(layout.home, item)
    return build_placed(layout, item)


def _check_for_queue(keys: Keys, request: GenerationRequest) -> None:
    reason = check_reply_to(request, keys)
    if reason is not None:
        raise SchemaError(ErrorCode.VALIDATION.value, reason)


def as_request_prompt(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` without ``raw`` and ``system``, its plain ``prompt`` as the request carries it:
    the user's message after ``system`` (:func:`as_chat`), or with ``raw=True`` the text as it is
    (no chat template). Every entry point that takes a plain prompt (``Producer.submit``, the CLI,
    bulk, Celery) resolves it here.

    Raises:
        SchemaError: code ``validation``: ``raw`` is not a bool, ``system`` not a string, or
            ``system`` given where it would be dropped (``raw``, ``messages``, token ids).
    """
    is_raw, system = options.get("raw") or False, options.get("system")
    rest = {name: value for name, value in options.items() if name not in _PROMPT_STYLE_OPTIONS}
    if not isinstance(is_raw, bool):
        raise SchemaError(ErrorCode.VALIDATION.value, f"raw: must be true or false, got {is_raw!r}")
    if system is not None and not isinstance(system, str):
        raise SchemaError(ErrorCode.VALIDATION.value, f"system: must be a string, got {type(system).__name__}")
    if system is not None and (is_raw or rest.get("prompt") is None):
        raise SchemaError(ErrorCode.VALIDATION.value, "system: goes with a plain prompt sent as chat (not raw; "
                          "put it in messages otherwise)")
    return rest if is_raw else as_chat(rest, system)


def as_chat(options: Mapping[str, Any], system: str | None = None) -> dict[str, Any]:
    """``options`` with a plain ``prompt`` turned into chat messages: an optional system message,
    then the prompt as the user's. Messages and token ids stay as given.

    NOTE: chat is the default for plain prompts (the producers, CLI, Celery, bulk), because the models people serve
    are instruct models that ramble on raw text; a worker whose model has no chat template reads a
    lone user message as raw text (docs/design.md).
    """
    if options.get("prompt") is None or options.get("messages") is not None:
        return dict(options)  # NOTE: prompt + messages stays invalid, for validation to say so
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": options["prompt"]})
    return {**{k: v for k, v in options.items() if k != "prompt"}, "messages": messages}


def by_shard(layout: QueueLayout, requests: Sequence[GenerationRequest]) -> dict[int, list[GenerationRequest]]:
    """``requests`` by the shard each lives on, in order within a shard."""
    groups: dict[int, list[GenerationRequest]] = {}
    for request in requests:
        groups.setdefault(layout.shard_of(request.id), []).append(request)
    return groups


def queue_submit_commands(pipe: Any, layout: QueueLayout, requests: Sequence[GenerationRequest]) -> None:
    """Queue the commands that enqueue ``requests`` (sync or asyncio pipeline, one round trip), each on
    its shard's priority lane: the shared one, or its model's when it names one (the model is registered too).

    NOTE: the ids are first removed from the cancel set: a cancel mark lives ``result_ttl_s`` and
    would otherwise cancel a later submit of the same id before it ran. ZREM precedes the XADDs
    on the same connection (a shard's keys are one node's), so no worker can see an entry while its old
    mark still stands.
    """
    for shard, shard_requests in by_shard(layout, requests).items():
        keys = layout.shards[shard]
        pipe.zrem(keys.cancel, *[request.id for request in shard_requests])
        models = {request.model for request in shard_requests if request.model is not None}
        if models:
            pipe.sadd(keys.models, *sorted(models))
        for request in shard_requests:
            pipe.xadd(keys.lane(request.priority, request.model), encode_request(request))


def queue_submit_once_commands(pipe: Any, script: Any, layout: QueueLayout, requests: Sequence[GenerationRequest],
                               now_s: float, ttl_s: float) -> None:
    """Queue one :data:`SUBMIT_ONCE_SCRIPT` call per request (each replies with its first submit time)."""
    for request in requests:
        keys = layout.for_id(request.id)
        fields = encode_request(request)
        script_keys = [keys.submitted(request.id), keys.lane(request.priority, request.model), keys.cancel]
        args = [repr(now_s), int(ttl_s * 1000), fields["d"], fields["v"], request.id]
        if request.model is not None:
            script_keys.append(keys.models)
            args.append(request.model)
        script(keys=script_keys, args=args, client=pipe)


def ids_in_entries(entries: Sequence[tuple[bytes, Mapping[bytes, bytes]]], wanted: set[str]) -> list[str]:
    """The request ids of ``wanted`` that lane ``entries`` (XRANGE replies) carry."""
    return [rid for _, fields in entries if (rid := peek_request_id(dict(fields))) is not None and rid in wanted]


def queue_cancel_commands(pipe: Any, layout: QueueLayout, request_ids: Sequence[str], mark_ttl_s: float) -> None:
    """Queue the commands that cancel ``request_ids`` (in the cancel set of each one's shard) and trim marks
    older than ``mark_ttl_s``."""
    now = time.time()
    shard_to_ids: dict[int, list[str]] = {}
    for request_id in request_ids:
        shard_to_ids.setdefault(layout.shard_of(request_id), []).append(request_id)
    for shard, ids in shard_to_ids.items():
        cancel = layout.shards[shard].cancel
        pipe.zadd(cancel, dict.fromkeys(ids, now))
        pipe.zremrangebyscore(cancel, "-inf", now - mark_ttl_s)


@contextmanager
def uncertain_on_redis_error(requests: Sequence[GenerationRequest]) -> Iterator[None]:
    """Turn a Redis failure while enqueuing ``requests`` into :class:`SubmitUncertain`.

    A timeout (or a dropped connection) may strike after Redis applied the XADD: the caller
    cannot know, and the safe answer is to submit again with the same ids (one id, one result).
    """
    try:
        yield
    except redis.RedisError as exc:
        raise SubmitUncertain([request.id for request in requests], exc) from exc


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
    """Decodes a token stream's entries (``t`` = UTF-8 bytes of a text delta, ``o`` = the byte offset
    where it starts, ``end`` = last) for both producers: a character split across two entries comes
    out whole, and each byte of the text comes out once.

    NOTE: a reclaimed request runs again from the start while its earlier run's deltas are in the
    stream already (and a paused worker that was reclaimed goes on writing its own): the offset says
    which bytes a delta repeats. A delta without ``o`` (an older worker) continues the text.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_bytes = 0  # bytes of the text decoded so far
        self.last_id: bytes = b"0"
        self.is_done = False

    def feed(self, reply: Any) -> list[str]:
        """Text deltas of one XREAD reply; sets ``is_done`` at the end marker."""
        entries: list[tuple[bytes, dict[bytes, bytes]]] = reply[0][1] if reply else []
        texts: list[str] = []
        for entry_id, fields in entries:
            self.last_id = entry_id
            is_end = b"end" in fields
            text = self._decoder.decode(self._new_bytes(fields), final=is_end)
            if text:
                texts.append(text)
            if is_end:
                self.is_done = True
                break
        return texts

    def _new_bytes(self, fields: dict[bytes, bytes]) -> bytes:
        """The bytes of a delta past those already decoded (all of them after a gap)."""
        data = fields.get(b"t", b"")
        try:
            offset = int(fields[b"o"])
        except (KeyError, ValueError):
            offset = self._num_bytes
        new = data[max(0, self._num_bytes - offset):]
        self._num_bytes = max(self._num_bytes, offset + len(data))
        return new


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
    """The next batch of ids to BLPOP on: up to ``DONE_KEYS_PER_BLPOP`` of them from ``offset`` on,
    wrapping around the end, each id at most once (``pending`` holds distinct ids)."""
    start = offset % len(pending)
    num_ids = min(DONE_KEYS_PER_BLPOP, len(pending))
    return [pending[(start + i) % len(pending)] for i in range(num_ids)]


def take_pending(pending: dict[str, None], request_id: str) -> bool:
    """Drop ``request_id`` from ``pending``; whether it was there, so a repeated id is yielded once."""
    if request_id not in pending:
        return False
    del pending[request_id]
    return True


@dataclass(frozen=True)
class WaitBatch:
    """One BLPOP of a wait for many results: the done lists it watches and for how long, and the ids to
    re-check (one MGET per slot group) when it times out."""

    key_to_id: dict[str, str]  # done-list key -> request id
    slice_cap_s: float  # the longest this wait may block
    recheck_ids: list[str]


def next_batch(layout: QueueLayout, pending: dict[str, None], turn: int, deadline: Deadline,
               timeout_s: float | None) -> WaitBatch:
    """The ``turn``-th BLPOP of a wait for ``pending``: up to ``DONE_KEYS_PER_BLPOP`` done lists of one slot
    group (all ids on one instance; one shard's on a cluster, the shards in turn), rotating over larger sets.
    After a timeout every pending id is re-checked; on a cluster with several shards awaited, the batch's ids
    only (each id's turn comes once per round), since its waits are short (:data:`SHARDED_WAIT_SLICE_S`).

    Raises:
        ResultTimeout: ``deadline`` has passed with results still pending.
    """
    if deadline.is_expired:
        raise timeout_error(list(pending), timeout_s)
    groups = layout.slot_groups(list(pending))
    group = groups[turn % len(groups)]
    ids = rotate(group, turn // len(groups) * DONE_KEYS_PER_BLPOP)
    key_to_id = {layout.for_id(request_id).done(request_id): request_id for request_id in ids}
    if len(groups) == 1:
        return WaitBatch(key_to_id, WAIT_SLICE_S, list(pending))
    return WaitBatch(key_to_id, SHARDED_WAIT_SLICE_S, ids)


def queue_result_reads(pipe: Any, layout: QueueLayout, request_ids: Sequence[str]) -> Callable[[list[Any]], list[Any]]:
    """Queue the reads of the results of ``request_ids`` (sync or asyncio pipeline); returns what turns the
    pipeline's replies into one raw result (or None) per id. One MGET per ``MGET_CHUNK`` ids; on a cluster one
    GET per id (redis-py's cluster pipeline refuses MGET), which it sends to each node at once."""
    keys = [layout.for_id(request_id).result(request_id) for request_id in request_ids]
    if layout.is_cluster:
        for key in keys:
            pipe.get(key)
        return lambda replies: replies
    for start in range(0, len(keys), MGET_CHUNK):
        pipe.mget(keys[start:start + MGET_CHUNK])
    return lambda replies: [raw for chunk in replies for raw in chunk]


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
