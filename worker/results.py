"""Writing results to Redis: the one atomic finish step (Lua), dead-lettering and token deltas.

Every script call names keys of one shard (one cluster slot): the request's result, done list and token
stream live on the shard of its lane (protocol/shards.py). A reply stream is queue-wide: on a cluster with
several shards it is on another slot, and the finish is three steps (see :meth:`ResultWriter.flush`).
Owns the worker's Redis writes of answers. Imports redis and protocol (schema, keys, shards); never engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack
import redis
from redis.commands.core import Script

from tokenmill.protocol.keys import CONSUMER_GROUP, DONE_TTL_S, Keys
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.schema import SCHEMA_VERSION, GenerationResult, encode_result
from tokenmill.protocol.shards import QueueLayout
from tokenmill.worker.messages import DeadLetter, Finish, Handoff

# NOTE: one script call answers a batch of entries, and each answer in it is one step: "stored + notified +
# replied + acked". The result is stored only if absent (SET NX); only the step that stored it notifies (done list,
# reply stream, token-stream end marker). The entry is acked either way, so a re-run of an already answered request
# (reclaimed from a worker that also finished it) changes nothing. The answered entry is then deleted (what XACKDEL
# does on Redis 8.2), so lane streams hold only unanswered work and never grow without bound under
# `maxmemory-policy noeviction`.
#
# A step never fails half-way: every write after the first checks the key's type first (a client may have created,
# say, a string where a reply stream is expected: that write is skipped, never an error), and the ack uses pcall (a
# lane whose group was deleted). Each step runs in a pcall of its own, so one refused step is an error reply for
# that entry alone and the batch goes on. Under `maxmemory` Redis refuses only a script's *first* write: a refused
# batch has written nothing (every step's first write is refused in turn) and is retried whole, and one whose first
# write passed completes. With ack 0 the entry stays pending (a reply stream on another cluster slot is written
# first: :data:`REPLY_ONCE_LUA`).
#
# NOTE: one call per batch rather than per entry (a pipeline of single-answer calls): the client packs and parses
# one command instead of FINISH_BATCH, and the server looks the script up once (ops/bench/README.md, queue_bench).
# The answers travel as one msgpack array, each key once in KEYS (a batch's answers share their lane and dead-letter
# streams): redis-py packs every argument in Python, and 15 arguments per answer were a third of the writer's time.
#   KEYS: the batch's keys, each once
#   ARGV: 1 group, 2 result ttl ms, 3 done ttl ms, 4 schema version, 5 token ttl ms, 6 the answers (msgpack, cmsgpack's
#         raw strings), each an array: 1 result key, 2 done list, 3 lane stream, 4 reply stream, 5 token stream, 6 dead
#         stream (each an index into KEYS; 0 = none: no reply, no token stream, no dead letter), 7 entry id, 8 result
#         bytes ('' = none), 9 status, 10 dead-letter reason, 11 ack (0/1), then the original entry fields as name,
#         value pairs (dead letters only)
#   Returns: per answer, 1 (stored by this step), 0 (answered before) or the error that refused it
FINISH_LUA = """
local function holds(key, kind)
  local t = redis.call('TYPE', key)['ok']
  return t == 'none' or t == kind
end
local function finish(x)
  local stored = false
  if x[8] ~= '' then
    stored = redis.call('SET', KEYS[x[1]], x[8], 'NX', 'PX', ARGV[2])
  end
  if x[6] > 0 and holds(KEYS[x[6]], 'stream') then
    local fields = {'reason', x[10], 'stream', KEYS[x[3]], 'entry_id', x[7]}
    for i = 12, #x do fields[#fields + 1] = x[i] end
    redis.call('XADD', KEYS[x[6]], '*', unpack(fields))
  end
  if stored then
    if holds(KEYS[x[2]], 'list') then
      redis.call('LPUSH', KEYS[x[2]], x[9])
      redis.call('PEXPIRE', KEYS[x[2]], ARGV[3])
    end
    if x[4] > 0 and holds(KEYS[x[4]], 'stream') then
      redis.call('XADD', KEYS[x[4]], '*', 'd', x[8], 'v', ARGV[4])
    end
    if x[5] > 0 and holds(KEYS[x[5]], 'stream') then
      redis.call('XADD', KEYS[x[5]], '*', 'end', '1', 'status', x[9])
      redis.call('PEXPIRE', KEYS[x[5]], ARGV[5])
    end
  end
  if x[11] == 1 then
    redis.pcall('XACK', KEYS[x[3]], ARGV[1], x[7])
    redis.pcall('XDEL', KEYS[x[3]], x[7])
  end
  if stored then return 1 end
  return 0
end
local replies = {}
for item, answer in ipairs(cmsgpack.unpack(ARGV[6])) do
  local ok, reply = pcall(finish, answer)
  if ok then
    replies[item] = reply
  else
    replies[item] = redis.error_reply(type(reply) == 'table' and reply.err or tostring(reply))
  end
end
return replies
"""
FINISH_BATCH = 64  # answers per finish call: bounds how long one call holds the server (about 10 commands each)

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
        # NOTE: the calls are EVALSHA, loaded before the first flush and again after a NOSCRIPT (a restarted server, a
        # promoted replica): redis-py's own script handling in a pipeline asks SCRIPT EXISTS on every execute, one
        # more round trip per flush.
        self._needs_scripts = True

    def flush(self, items: list[Writable]) -> list[FlushOutcome]:
        """Write ``items`` in one round trip (three on a cluster for finishes whose reply stream is on another slot:
        store and notify without the ack; the reply, once (:data:`REPLY_ONCE_LUA`); the ack): the token deltas in
        order, then the hand-offs, then the answers, :data:`FINISH_BATCH` to a script call (on a cluster, those of
        one shard together).

        Returns:
            One outcome per finish / dead-letter / hand-off item, in order. Token deltas that Redis refuses
            are dropped (a stream is best effort; the result carries the whole text).

        Raises:
            redis.RedisError: the round trip failed as a whole (connection, timeout, a refused
                script load); the caller retries every item (a finish is idempotent by id).
        """
        if self._needs_scripts:
            self._load_scripts()
        pipe = self._client.pipeline(transaction=False)
        answers: list[Finish | DeadLetter | Handoff] = []
        payloads: list[bytes | None] = []
        for item in items:
            if isinstance(item, PositionedDelta):  # NOTE: first: a token stream's end marker is the finish's
                self._add_token_delta(pipe, item)
            elif isinstance(item, Handoff):
                answers.append(item)
                payloads.append(None)
            else:
                item, payload = encodable(item)
                answers.append(item)
                payloads.append(payload)
        # Where each answer's reply is: its pipeline position, and its index in a batch's reply (None: a call alone).
        where: list[tuple[int, int | None]] = [(0, None)] * len(answers)
        batches: dict[int | None, list[int]] = {}  # the shard (a cluster slot) -> its answers, as indexes
        for index, answer in enumerate(answers):
            if isinstance(answer, Handoff):
                where[index] = (len(pipe), None)
                self._call(pipe, self._handoff_script, self.handoff_call(answer))
            else:
                shard = self._layout.shard_of_stream(answer.entry.stream) if self._layout.is_cluster else None
                batches.setdefault(shard, []).append(index)
        for indexes in batches.values():
            for start in range(0, len(indexes), FINISH_BATCH):
                chunk = indexes[start:start + FINISH_BATCH]
                calls = []
                for offset, index in enumerate(chunk):
                    answer = answers[index]
                    assert not isinstance(answer, Handoff)
                    where[index] = (len(pipe), offset)
                    calls.append(self.finish_call(answer, payloads[index]))
                self._call(pipe, self._script, self.finish_batch_call(calls))
        stored_at = {}  # NOTE: the stored result (this run's or an earlier one's) of a deferred ack, for the reply
        for index, answer in enumerate(answers):
            if self._defers_ack(answer):
                stored_at[index] = len(pipe)
                pipe.get(self._keys_of(answer.entry.stream).result(answer.result.id))
        replies = pipe.execute(raise_on_error=False)
        self._load_scripts_if_missing(replies)
        outcomes = [self._outcome(answer, _reply_at(replies, *where[index])) for index, answer in enumerate(answers)]
        deferred = [(index, replies[position]) for index, position in stored_at.items()
                    if outcomes[index].error is None]
        if deferred:
            self._reply_and_ack(outcomes, deferred)
        return outcomes

    @staticmethod
    def _call(pipe: Any, script: Script, call: ScriptCall) -> None:
        """Queue ``call`` of ``script`` in ``pipe`` by its SHA1 (loaded by :meth:`_load_scripts`)."""
        pipe.evalsha(script.sha, len(call.keys), *call.keys, *call.args)

    def _outcome(self, item: Finish | DeadLetter | Handoff, reply: Any) -> FlushOutcome:
        if isinstance(reply, redis.RedisError):
            return FlushOutcome(item, error=reply)
        return FlushOutcome(item, is_stored=bool(int(reply)))

    def _defers_ack(self, item: Finish | DeadLetter | Handoff) -> TypeGuard[Finish]:
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
                self._call(pipe, self._reply_script, self.reply_call(item, stored))
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
        """Load the scripts (on every primary) when the server answered NOSCRIPT (restarted, flushed, or a replica a
        failover promoted); the items it refused are retried by the caller."""
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
        """One answer's keys and arguments in a :data:`FINISH_LUA` batch (:meth:`finish_batch_call`): every key its
        lane's shard's (on a cluster with several shards, the reply stream is left out and the ack deferred:
        :meth:`flush`)."""
        entry = item.entry
        result = item.result
        request_id = result.id if result is not None else "-"
        reply_to = item.reply_to if isinstance(item, Finish) else None
        defers_ack = self._defers_ack(item)
        has_reply = reply_to is not None and not defers_ack
        has_tokens = isinstance(item, Finish) and item.stream_tokens
        reason = item.reason if isinstance(item, DeadLetter) else ""
        shard = self._keys_of(entry.stream)
        # NOTE: only the keys it writes: the result, done list and lane always, then the reply stream, the token
        # stream and the dead stream where it has them (the args say which)
        keys = [shard.result(request_id), shard.done(request_id), entry.stream]
        if has_reply and reply_to:
            keys.append(reply_to)
        if has_tokens:
            keys.append(shard.tokens(request_id))
        if reason:
            keys.append(shard.dead)
        args: list[Any] = [entry.entry_id, payload or b"", result.status if result else "", int(has_reply),
                           int(has_tokens), reason, int(not defers_ack)]
        if reason:
            for name, value in entry.fields.items():
                args.extend((name, value))
        return ScriptCall(keys, args)

    def finish_batch_call(self, calls: list[ScriptCall]) -> ScriptCall:
        """The :data:`FINISH_LUA` call of the answers ``calls`` (:meth:`finish_call`'s, of one shard on a cluster):
        each key once, the answers in one msgpack array."""
        index_of: dict[str, int] = {}  # key -> its 1-based place in KEYS
        answers = []
        for call in calls:
            entry_id, payload, status, has_reply, has_tokens, reason, ack, *fields = call.args
            indexes = [index_of.setdefault(key, len(index_of) + 1) for key in call.keys]
            optional = iter(indexes[3:])
            answers.append([*indexes[:3], next(optional) if has_reply else 0, next(optional) if has_tokens else 0,
                            next(optional) if reason else 0, entry_id, payload, status, reason, ack, *fields])
        args: list[Any] = [CONSUMER_GROUP, self._ttl_ms["result"], self._ttl_ms["done"], SCHEMA_VERSION,
                           self._ttl_ms["tokens"], msgpack.packb(answers, use_bin_type=False)]
        return ScriptCall(list(index_of), args)

    def reply_call(self, item: Finish, stored: bytes) -> ScriptCall:
        """The :data:`REPLY_ONCE_LUA` call that adds ``stored`` (the request's stored result) to its reply stream."""
        assert item.reply_to is not None and item.result is not None
        marker = self._layout.home.replied(item.result.id)
        return ScriptCall([marker, item.reply_to], [stored, SCHEMA_VERSION, self._ttl_ms["result"]])


def _reply_at(replies: list[Any], position: int, offset: int | None) -> Any:
    """The reply of one answer: the call's at ``position`` in the pipeline, or its ``offset``-th entry when the call
    was a batch (an error that refused the whole call is every answer's)."""
    reply = replies[position]
    if offset is None or isinstance(reply, redis.RedisError):
        return reply
    return reply[offset]
