"""Writing results to Redis: the one atomic finish step (Lua), dead-lettering and token deltas.

Owns the worker's Redis writes of answers. Imports redis and producer (schema, keys); never engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script

from tokenmill.producer.keys import CONSUMER_GROUP, DONE_TTL_S, Keys
from tokenmill.producer.schema import SCHEMA_VERSION, ErrorCode, GenerationResult, encode_result
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
# behind and the whole step is retried.
#   KEYS: 1 result, 2 done list, 3 lane stream, 4 reply stream, 5 token stream, 6 dead stream
#   ARGV: 1 group, 2 entry id, 3 result bytes, 4 result ttl ms, 5 done ttl ms, 6 schema version,
#         7 status, 8 has reply (0/1), 9 has tokens (0/1), 10 token ttl ms,
#         11 dead-letter reason ('' = none), 12.. original entry fields as name, value pairs
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
  for i = 12, #ARGV do fields[#fields + 1] = ARGV[i] end
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
redis.pcall('XACK', KEYS[3], ARGV[1], ARGV[2])
redis.pcall('XDEL', KEYS[3], ARGV[2])
if stored then return 1 end
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


class ResultWriter:
    """Queues writes of answers into one pipeline per flush.

    Args:
        client: the worker's Redis client.
        keys: key layout of the served queue.
        result_ttl_s: lifetime of a stored result.
        token_ttl_s: lifetime of a token stream after its last entry.
    """

    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: float, token_ttl_s: float) -> None:
        self._client = client
        self._keys = keys
        self._ttl_ms = {"result": int(result_ttl_s * 1000), "done": DONE_TTL_S * 1000,
                        "tokens": int(token_ttl_s * 1000)}
        self._script: Script = client.register_script(FINISH_LUA)
        self._handoff_script: Script = client.register_script(HANDOFF_LUA)

    def flush(self, items: list[Writable]) -> list[FlushOutcome]:
        """Write ``items`` in order, in one round trip.

        Returns:
            One outcome per finish / dead-letter item, in order. Token deltas that Redis refuses
            are dropped (a stream is best effort; the result carries the whole text).

        Raises:
            redis.RedisError: the round trip failed as a whole (connection, timeout, a refused
                script load); the caller retries every item (a finish is idempotent by id).
        """
        pipe = self._client.pipeline(transaction=False)
        finishes: list[tuple[int, Finish | DeadLetter | Handoff]] = []
        for item in items:
            if isinstance(item, PositionedDelta):
                self._add_token_delta(pipe, item)
            elif isinstance(item, Handoff):
                finishes.append((len(pipe), item))
                self._add_handoff(pipe, item)
            else:
                item, payload = encodable(item)
                finishes.append((len(pipe), item))
                self._add_finish(pipe, item, payload)
        replies = pipe.execute(raise_on_error=False)
        outcomes = []
        for position, item in finishes:
            reply = replies[position]
            if isinstance(reply, redis.RedisError):
                outcomes.append(FlushOutcome(item, error=reply))
            else:
                outcomes.append(FlushOutcome(item, is_stored=bool(int(reply))))
        return outcomes

    def _add_token_delta(self, pipe: Any, item: PositionedDelta) -> None:
        key = self._keys.tokens(item.request_id)
        pipe.xadd(key, {"t": item.data, "o": item.offset})
        pipe.pexpire(key, self._ttl_ms["tokens"])

    def _add_handoff(self, pipe: Any, item: Handoff) -> None:
        args: list[Any] = [CONSUMER_GROUP, item.entry.entry_id]
        for name, value in item.entry.fields.items():
            args.extend((name, value))
        self._handoff_script(keys=[self._keys.result(item.request_id), item.entry.stream, self.decode_stream(item)],
                             args=args, client=pipe)

    def decode_stream(self, item: Handoff) -> str:
        """The decode pool's stream of the lane the entry was read from (same priority, same model)."""
        lane = self._keys.parse_lane(item.entry.stream)
        if lane is None:  # NOTE: cannot happen: a prefill worker reads request lanes only
            return self._keys.lane(item.entry.lane, is_decode=True)
        return self._keys.decode_lane(lane).stream

    def _add_finish(self, pipe: Any, item: Finish | DeadLetter, payload: bytes | None) -> None:
        entry = item.entry
        result = item.result
        request_id = result.id if result is not None else "-"
        reply_to = item.reply_to if isinstance(item, Finish) else None
        has_tokens = isinstance(item, Finish) and item.stream_tokens
        reason = item.reason if isinstance(item, DeadLetter) else ""
        keys = [self._keys.result(request_id), self._keys.done(request_id), entry.stream,
                reply_to or entry.stream, self._keys.tokens(request_id), self._keys.dead]
        args: list[Any] = [CONSUMER_GROUP, entry.entry_id, payload or b"",
                           self._ttl_ms["result"], self._ttl_ms["done"], SCHEMA_VERSION,
                           result.status if result else "", int(reply_to is not None), int(has_tokens),
                           self._ttl_ms["tokens"], reason]
        if reason:
            for name, value in entry.fields.items():
                args.extend((name, value))
        self._script(keys=keys, args=args, client=pipe)
