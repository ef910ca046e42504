"""Writing results to Redis: the one atomic finish step (Lua), dead-lettering and token deltas.

Owns the worker's Redis writes of answers. Imports redis and producer (schema, keys); never engine.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.commands.core import Script

from producer.keys import CONSUMER_GROUP, Keys
from producer.schema import SCHEMA_VERSION, encode_result
from worker.messages import DeadLetter, Finish, Outgoing, TokenDelta

# NOTE: one script, so "stored + notified + replied + acked" is a single atomic step. The
# result is stored only if absent (SET NX); only the call that stored it notifies (done list,
# reply stream, token-stream end marker). The entry is acked either way, so a re-run of an
# already answered request (reclaimed from a worker that also finished it) changes nothing.
# The answered entry is then deleted (what XACKDEL does on Redis 8.2), so lane streams hold only
# unanswered work and never grow without bound under `maxmemory-policy noeviction`.
#   KEYS: 1 result, 2 done list, 3 lane stream, 4 reply stream, 5 token stream, 6 dead stream
#   ARGV: 1 group, 2 entry id, 3 result bytes, 4 result ttl ms, 5 done ttl ms, 6 schema version,
#         7 status, 8 has reply (0/1), 9 has tokens (0/1), 10 token ttl ms,
#         11 dead-letter reason ('' = none), 12.. original entry fields as name, value pairs
FINISH_LUA = """
local stored = false
if ARGV[3] ~= '' then
  stored = redis.call('SET', KEYS[1], ARGV[3], 'NX', 'PX', ARGV[4])
end
if stored then
  redis.call('LPUSH', KEYS[2], ARGV[7])
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
  if ARGV[8] == '1' then
    redis.call('XADD', KEYS[4], '*', 'd', ARGV[3], 'v', ARGV[6])
  end
  if ARGV[9] == '1' then
    redis.call('XADD', KEYS[5], '*', 'end', '1', 'status', ARGV[7])
    redis.call('PEXPIRE', KEYS[5], ARGV[10])
  end
end
if ARGV[11] ~= '' then
  local fields = {'reason', ARGV[11], 'stream', KEYS[3], 'entry_id', ARGV[2]}
  for i = 12, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('XADD', KEYS[6], '*', unpack(fields))
end
redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[3], ARGV[2])
if stored then return 1 end
return 0
"""


class ResultWriter:
    """Queues writes of answers into one pipeline per flush.

    Args:
        client: the worker's Redis client.
        keys: key layout of the served queue.
        result_ttl_s: lifetime of a stored result.
        done_ttl_s: lifetime of the done list (BLPOP waiters).
        token_ttl_s: lifetime of a token stream after its last entry.
    """

    def __init__(self, client: redis.Redis, keys: Keys, result_ttl_s: float, done_ttl_s: float,
                 token_ttl_s: float) -> None:
        self._client = client
        self._keys = keys
        self._ttl_ms = {"result": int(result_ttl_s * 1000), "done": int(done_ttl_s * 1000),
                        "tokens": int(token_ttl_s * 1000)}
        self._script: Script = client.register_script(FINISH_LUA)

    def flush(self, items: list[Outgoing]) -> list[int]:
        """Write ``items`` in order, in one round trip.

        Returns:
            For each finish / dead-letter item, 1 when its result was newly stored, else 0.

        Raises:
            redis.RedisError: the pipeline failed; nothing is acked that was not stored.
        """
        pipe = self._client.pipeline(transaction=False)
        finish_positions = []
        for item in items:
            if isinstance(item, TokenDelta):
                self._add_token_delta(pipe, item)
            else:
                finish_positions.append(len(pipe))
                self._add_finish(pipe, item)
        replies = pipe.execute()
        return [int(replies[i]) for i in finish_positions]

    def _add_token_delta(self, pipe: Any, item: TokenDelta) -> None:
        key = self._keys.tokens(item.request_id)
        pipe.xadd(key, {"t": item.text.encode()})
        pipe.pexpire(key, self._ttl_ms["tokens"])

    def _add_finish(self, pipe: Any, item: Finish | DeadLetter) -> None:
        entry = item.entry
        result = item.result
        request_id = result.id if result is not None else "-"
        reply_to = item.reply_to if isinstance(item, Finish) else None
        has_tokens = isinstance(item, Finish) and item.stream_tokens
        reason = item.reason if isinstance(item, DeadLetter) else ""
        keys = [self._keys.result(request_id), self._keys.done(request_id), entry.stream,
                reply_to or entry.stream, self._keys.tokens(request_id), self._keys.dead]
        args: list[Any] = [CONSUMER_GROUP, entry.entry_id, encode_result(result) if result else b"",
                           self._ttl_ms["result"], self._ttl_ms["done"], SCHEMA_VERSION,
                           result.status if result else "", int(reply_to is not None), int(has_tokens),
                           self._ttl_ms["tokens"], reason]
        if reason:
            for name, value in entry.fields.items():
                args.extend((name, value))
        self._script(keys=keys, args=args, client=pipe)
