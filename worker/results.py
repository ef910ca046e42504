"""Writing results to Redis: the one atomic finish step (Lua), dead-lettering and token deltas.

Every script call names keys of one shard (one cluster slot): the request's result, done list and token
stream live on the shard of its lane (protocol/shards.py). A reply stream is queue-wide: on a cluster with
several shards it is on another slot, and the finish is three steps (see :meth:`ResultWriter.flush`).
Owns the worker's Redis writes of answers. Imports redis and protocol (schema, keys, shards); never engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script

from tokenmill.protocol.keys import CONSUMER_GROUP, DONE_TTL_S, Keys
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.schema import SCHEMA_VERSION, GenerationResult, encode_result
from tokenmill.protocol.shards import QueueLayout
from tokenmill.worker.messages import DeadLetter, Finish, Handoff

# NOTE: one script, so "stored + notified + replied + acked" is a single atomic step. The
# result is stored only if absent (SET NX); only the call that stored it notifies (done list,
# reply stream, token-stream end marker). The entry is acked either way, so a re-run of an
# already answered request (reclaimed from a worker that also finished it) changes nothing.
# The answered entry is then deleted (what XACKDEL does on Redis 8.2), so lane streams hold only
# unanswered work and never grow without bound under `maxmemory-policy noeviction`.
#
# The script never fails half-way: every write after the first checks the key's type first
# (a client may have created, say, a string where a reply stream is expected: that write is
# skipped, never an error), and the ack uses pcall (a lane whose group was deleted). Under
# `maxmemory` Redis refuses only a script's *first* write, so an OOM refusal leaves nothing
# behind and the whole step is retried. With ack 0 the entry stays pending (a reply stream on another
# cluster slot is written first: :data:`REPLY_ONCE_LUA`).
#   KEYS: 1 result, 2 done list, 3 lane stream, 4 reply stream, 5 token stream, 6 dead stream
#   ARGV: 1 group, 2 entry id, 3 result bytes, 4 result ttl ms, 5 done ttl ms, 6 schema version,
#         7 status, 8 has reply (0/1), 9 has tokens (0/1), 10 token ttl ms,
#         11 dead-letter reason ('' = none), 12 ack (0/1), 13.. original entry fields as name, value pairs
FINISH_LUA = """
local function holds(key, kind)
  local t = redis.call('TYPE', key)['ok']
  return t == 'none' or t == kind
end
local stored = false
if ARGV[3] ~= '' then
  stored = redis.call('SET', KEYS[1], ARGV[3], 'NX', 'PX', ARGV[4])
end
if ARGV[11] ~= '' and holds(KEYS[6], 'stream') then
  local fields = {'reason', ARGV[11], 'stream', KEYS[3], 'entry_id', ARGV[2]}
  for i = 13, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('XADD', KEYS[6], '*', unpack(fields))
end
if stored then
  if holds(KEYS[2], 'list') then
    redis.call('LPUSH', KEYS[2], ARGV[7])
    redis.call('PEXPIRE', KEYS[2], ARGV[5])
  end
  if ARGV[8] == '1' and holds(KEYS[4], 'stream') then
    redis.call('XADD', KEYS[4], '*', 'd', ARGV[3], 'v', ARGV[6])
  end
  if ARGV[9] == '1' and holds(KEYS[5], 'stream') then
    redis.call('XADD', KEYS[5], '*', 'end', '1', 'status', ARGV[7])
    redis.call('PEXPIRE', KEYS[5], ARGV[10])
  end
end
if ARGV[12] == '1' then
  redis.pcall('XACK', KEYS[3], ARGV[1], ARGV[2])
  redis.pcall('XDEL', KEYS[3], ARGV[2])
end
if stored then return 1 end
return 0
"""

# NOTE: the reply of a finish whose reply stream is on another cluster slot than its shard: a marker set NX
# (as long as the result lives) guards the XADD, so the reply goes out once however often the finish runs
# (a worker that dies after storing the result and before the ack leaves the entry for a reclaimer, which
# runs it again: its SET NX keeps the first result, and this keeps the first reply).
#   KEYS: 1 marker (Keys.replied), 2 reply stream.  ARGV: 1 result bytes, 2 schema version, 3 marker ttl ms
REPLY_ONCE_LUA = """
if redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[3]) then
  local t = redis.call('TYPE', KEYS[2])['ok']
  if t == 'none' or t == 'stream' then
    redis.call('XADD', KEYS[2], '*', 'd', ARGV[1], 'v', ARGV[2])
  end
  return 1
end
return 0
"""


# NOTE: a prefill worker's hand-off, one atomic step: the entry's fields, unchanged, go to the decode pool's
# lane and the entry is acked and deleted. A request already answered (a reclaimed duplicate) is only acked,
# so a request is never handed off after its result exists; a hand-off re-run after a failed reply adds a
# second decode entry at worst, which the finish step's SET NX answers once.
#   KEYS: 1 result, 2 lane stream, 3 decode stream.  ARGV: 1 group, 2 entry id, 3.. fields as name, value
HANDOFF_LUA = """
local moved = 0
if redis.call('EXISTS', KEYS[1]) == 0 then
  local fields = {}
  for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('XADD', KEYS[3], '*', unpack(fields))
  moved = 1
end
redis.pcall('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.pcall('XDEL', KEYS[2], ARGV[2])
return moved
"""


@dataclass(frozen=True)
class PositionedDelta:
    """A token delta with its place in this run's text: ``offset`` is the byte where ``data`` starts.

    NOTE: a reclaimed request runs again from its first token while readers may have read part of
    an earlier run (a worker paused, not dead, goes on writing too); the offset lets them take each
    byte of the text once (docs/design.md, the token stream).
    """

    request_id: str
    data: bytes  # UTF-8 text
    offset: int


Writable = Finish | DeadLetter | Handoff | PositionedDelta


@dataclass(frozen=True)
class FlushOutcome:
    """What happened to one finish / dead-letter item of a flush."""

    item: Finish | DeadLetter | Handoff  # what was written: the item, or an error result if it could not be encoded
    is_stored: bool = False  # the result was newly stored, or the request handed off (False: answered already)
    error: redis.RedisError | None = None  # Redis refused this item; nothing of it was written


def encodable(item: Finish | DeadLetter) -> tuple[Finish | DeadLetter, bytes | None]:
    """The item and its encoded result, replacing a result that cannot be encoded by an error result.

    NOTE: triage validates metadata, so this is the last line of defence: one odd result must
    never take the writer thread down with it.
    """
    result = item.result
    if result is None:
        return item, None
    try:
        return item, encode_result(result)
    except Exception as exc:  # noqa: BLE001 - anything the encoder raises concerns this item only
        failure = GenerationResult.failure(result.id, ErrorCode.INTERNAL,
                                           f"the result could not be encoded ({type(exc).__name__}: {exc})",
                                           worker=result.worker)
        if isinstance(item, Finish):
            item = Finish(failure, item.entry, item.reply_to, item.stream_tokens)
        else:
            item = DeadLetter(item.entry, item.reason, failure)
        return item, encode_result(failure)


@dataclass(frozen=True)
class ScriptCall:
    """One script call's keys and arguments (what :mod:`protocol.shards` keeps in one slot)."""

    keys: list[str]
    args: list[Any]


class ResultWriter:
    """Queues writes of answers into one pipeline per flush.

    Args:
        client: the worker's Redis client.
        keys: the served queue's shards (or, for a queue of one shard, its keys).
        result_ttl_s: lifetime of a stored result.
        token_ttl_s: lifetime of a token stream after its last entry.
    """

    def __init__(self, client: redis.Redis, keys: Keys | QueueLayout, result_ttl_s: float, token_ttl_s: float) -> None:
        self._client = client
        self._layout = keys if isinstance(keys, QueueLayout) else QueueLayout.single(keys)
        # NOTE: reply streams are queue-wide: on a cluster with several shards they are on another slot
        self._is_reply_apart = self._layout.is_cluster and self._layout.is_sharded
        self._ttl_ms = {"result": int(result_ttl_s * 1000), "done": DONE_TTL_S * 1000,
                        "tokens": int(token_ttl_s * 1000)}
        self._script: Script = client.register_script(FINISH_LUA)
        self._handoff_script: Script = client.register_script(HANDOFF_LUA)
        self._reply_script: Script = client.register_script(REPLY_ONCE_LUA)
        # Ids whose result a flush stored though a later step of theirs failed (retried whole: still "stored").
        self._stored_before: set[str] = set()
        # NOTE: redis-py's cluster pipeline loads no script: they are loaded on every primary before the first flush
        self._needs_scripts = self._layout.is_cluster

    def flush(self, items: list[Writable]) -> list[FlushOutcome]:
        """Write ``items`` in order, in one round trip (three on a cluster for finishes whose reply stream is on
        another slot: store and notify without the ack; the reply, once (:data:`REPLY_ONCE_LUA`); the ack).

        Returns:
            One outcome per finish / dead-letter item, in order. Token deltas that Redis refuses
            are dropped (a stream is best effort; the result carries the whole text).

        Raises:
            redis.RedisError: the round trip failed as a whole (connection, timeout, a refused
                script load); the caller retries every item (a finish is idempotent by id).
        """
        if self._needs_scripts:
            self._load_scripts()
        pipe = self._client.pipeline(transaction=False)
        finishes: list[tuple[int, Finish | DeadLetter | Handoff]] = []
        for item in items:
            if isinstance(item, PositionedDelta):
                self._add_token_delta(pipe, item)
            elif isinstance(item, Handoff):
                finishes.append((len(pipe), item))
                self._handoff_script(**vars(self.handoff_call(item)), client=pipe)
            else:
                item, payload = encodable(item)
                finishes.append((len(pipe), item))
                call = self.finish_call(item, payload)
                self._script(**vars(call), client=pipe)
                if self._defers_ack(item):
                    pipe.get(call.keys[0])  # NOTE: the stored result (this run's or an earlier one's), for the reply
        replies = pipe.execute(raise_on_error=False)
        self._load_scripts_if_missing(replies)
        outcomes = [self._outcome(item, replies[position]) for position, item in finishes]
        deferred = [(i, replies[position + 1]) for i, (position, item) in enumerate(finishes)
                    if self._defers_ack(item) and outcomes[i].error is None]
        if deferred:
            self._reply_and_ack(outcomes, deferred)
        return outcomes

    def _outcome(self, item: Finish | DeadLetter | Handoff, reply: Any) -> FlushOutcome:
        if isinstance(reply, redis.RedisError):
            return FlushOutcome(item, error=reply)
        return FlushOutcome(item, is_stored=bool(int(reply)))

    def _defers_ack(self, item: Finish | DeadLetter | Handoff) -> bool:
        return self._is_reply_apart and isinstance(item, Finish) and item.reply_to is not None

    def _reply_and_ack(self, outcomes: list[FlushOutcome], deferred: list[tuple[int, Any]]) -> None:
        """The reply (once) of each finish in ``deferred`` (outcome index, the stored result), then its ack;
        an item whose step fails is an error outcome (retried whole; its first store still counts)."""
        for index, _ in deferred:
            item = outcomes[index].item
            assert isinstance(item, Finish) and item.result is not None  # NOTE: _defers_ack's
            if outcomes[index].is_stored:
                self._stored_before.add(item.result.id)
        pipe = self._client.pipeline(transaction=False)
        sent = []
        for index, stored in deferred:
            if isinstance(stored, bytes):
                item = outcomes[index].item
                assert isinstance(item, Finish)
                self._reply_script(**vars(self.reply_call(item, stored)), client=pipe)
                sent.append(index)
        replies = pipe.execute(raise_on_error=False) if sent else []
        self._load_scripts_if_missing(replies)
        failed = {index: reply for index, reply in zip(sent, replies) if isinstance(reply, redis.RedisError)}
        pipe = self._client.pipeline(transaction=False)
        acked = [index for index, _ in deferred if index not in failed]
        for index in acked:
            entry = outcomes[index].item.entry
            pipe.xack(entry.stream, CONSUMER_GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
        ack_replies = pipe.execute(raise_on_error=False) if acked else []
        for position, index in enumerate(acked):
            error = next((r for r in ack_replies[2 * position: 2 * position + 2] if isinstance(r, redis.RedisError)),
                         None)
            if error is not None:
                failed[index] = error
        for index, _ in deferred:
            item = outcomes[index].item
            assert isinstance(item, Finish) and item.result is not None
            if index in failed:
                outcomes[index] = FlushOutcome(item, error=failed[index])
            else:
                was_stored = item.result.id in self._stored_before
                self._stored_before.discard(item.result.id)
                outcomes[index] = FlushOutcome(item, is_stored=was_stored)

    def _load_scripts_if_missing(self, replies: list[Any]) -> None:
        """Load the scripts on every primary when a node answered NOSCRIPT (a replica a failover promoted:
        redis-py's cluster pipeline loads none); the items it refused are retried by the caller."""
        if any(isinstance(reply, redis.exceptions.NoScriptError) for reply in replies):
            self._load_scripts()

    def _load_scripts(self) -> None:
        for script in (self._script, self._handoff_script, self._reply_script):
            self._client.script_load(script.script)
        self._needs_scripts = False

    def _add_token_delta(self, pipe: Any, item: PositionedDelta) -> None:
        key = self._layout.for_id(item.request_id).tokens(item.request_id)
        pipe.xadd(key, {"t": item.data, "o": item.offset})
        pipe.pexpire(key, self._ttl_ms["tokens"])

    def _keys_of(self, stream: str) -> Keys:
        """The keys of the shard of lane ``stream`` (the shard a request's answer is written to)."""
        shard = self._layout.shard_of_stream(stream)
        return self._layout.shards[shard] if shard is not None else self._layout.home

    def handoff_call(self, item: Handoff) -> ScriptCall:
        """The :data:`HANDOFF_LUA` call of a prefill worker's hand-off."""
        args: list[Any] = [CONSUMER_GROUP, item.entry.entry_id]
        for name, value in item.entry.fields.items():
            args.extend((name, value))
        keys = self._keys_of(item.entry.stream)
        return ScriptCall([keys.result(item.request_id), item.entry.stream, self.decode_stream(item)], args)

    def decode_stream(self, item: Handoff) -> str:
        """The decode pool's stream of the lane the entry was read from (same shard, priority and model)."""
        keys = self._keys_of(item.entry.stream)
        lane = keys.parse_lane(item.entry.stream)
        if lane is None:  # NOTE: cannot happen: a prefill worker reads request lanes only
            return keys.lane(item.entry.lane, is_decode=True)
        return keys.decode_lane(lane).stream

    def finish_call(self, item: Finish | DeadLetter, payload: bytes | None) -> ScriptCall:
        """The :data:`FINISH_LUA` call of an answer: every key its lane's shard's (on a cluster with several
        shards, the reply stream is left out and the ack deferred: :meth:`flush`)."""
        entry = item.entry
        result = item.result
        request_id = result.id if result is not None else "-"
        reply_to = item.reply_to if isinstance(item, Finish) else None
        defers_ack = self._defers_ack(item)
        has_reply = reply_to is not None and not defers_ack
        has_tokens = isinstance(item, Finish) and item.stream_tokens
        reason = item.reason if isinstance(item, DeadLetter) else ""
        shard = self._keys_of(entry.stream)
        keys = [shard.result(request_id), shard.done(request_id), entry.stream,
                reply_to if has_reply and reply_to else entry.stream, shard.tokens(request_id), shard.dead]
        args: list[Any] = [CONSUMER_GROUP, entry.entry_id, payload or b"",
                           self._ttl_ms["result"], self._ttl_ms["done"], SCHEMA_VERSION,
                           result.status if result else "", int(has_reply), int(has_tokens),
                           self._ttl_ms["tokens"], reason, int(not defers_ack)]
        if reason:
            for name, value in entry.fields.items():
                args.extend((name, value))
        return ScriptCall(keys, args)

    def reply_call(self, item: Finish, stored: bytes) -> ScriptCall:
        """The :data:`REPLY_ONCE_LUA` call that adds ``stored`` (the request's stored result) to its reply stream."""
        assert item.reply_to is not None and item.result is not None
        marker = self._layout.home.replied(item.result.id)
        return ScriptCall([marker, item.reply_to], [stored, SCHEMA_VERSION, self._ttl_ms["result"]])
