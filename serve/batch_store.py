"""OpenAI batch objects in Redis, shared by every ``serve`` process: one hash per batch
(``Keys.batch``), each field of the object JSON-encoded, plus ``account``, the API key's account
that created it (only that account sees it), and ``owner`` / ``owner_ts``, the process running it
and its last sign of life. Status changes are compare-and-set, so a cancel from one process and a
completion in another never overwrite each other.

One field is not OpenAI's: :data:`EXTENSION` (``tokenmill``), ``{"backlog_tokens", "eta_s"}`` while the
batch runs (the completion tokens left and seconds to go its workers predict, producer/eta.py), else null.
Clients ignore fields they do not know (the openai package keeps them in ``model_extra``).

Imports redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable
from typing import Any, cast

import redis.asyncio

from tokenmill.protocol.keys import Keys
from tokenmill.serve.listing import account_objects
from tokenmill.serve.stray_keys import absent_if_stray

ACTIVE = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
_INTERNAL = ("account", "owner", "owner_ts")
EXTENSION = "tokenmill"  # the object's one field of tokenmill's own
# KEYS: the batch hash. ARGV: 1 allowed statuses, JSON-encoded, '|'-separated ('' = any);
# 2 owner_ts must be below this ('' = no check); then field / value pairs to set. Returns 1 if set.
_UPDATE_SCRIPT = """
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return 0 end
if ARGV[1] ~= '' then
  local status = redis.call('HGET', h, 'status') or ''
  if not string.find('|' .. ARGV[1] .. '|', '|' .. status .. '|', 1, true) then return 0 end
end
if ARGV[2] ~= '' and tonumber(redis.call('HGET', h, 'owner_ts') or '0') >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', h, unpack(ARGV, 3))
return 1
"""


class BatchStore:
    """Batch objects of one queue.

    Args:
        client: an asyncio Redis client (bytes responses).
        keys: the queue's key layout.
        ttl_s: lifetime of a batch object (``serve.file_ttl_s``, like its files).
    """

    def __init__(self, client: redis.asyncio.Redis, keys: Keys, ttl_s: float) -> None:
        self._client, self._keys, self._ttl_s = client, keys, ttl_s
        self._update = client.register_script(_UPDATE_SCRIPT)

    async def create(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict[str, Any] | None,
                     *, account: str, owner: str) -> dict[str, Any]:
        """A new batch in ``validating`` of ``account``, run by the process ``owner``."""
        now, batch_id = int(time.time()), f"batch_{secrets.token_hex(12)}"
        batch: dict[str, Any] = {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": input_file_id, "completion_window": completion_window, "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + 86_400, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None,
                 "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata,
                 "model": None, "usage": None, EXTENSION: None}
        key = self._keys.batch(batch_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(key, mapping=_encode({**batch, "account": account, "owner": owner,  # type: ignore[arg-type]
                                        "owner_ts": time.time()}))
        pipe.expire(key, int(self._ttl_s))
        pipe.zadd(self._keys.batches, {batch_id: time.time()})  # NOTE: not created_at: seconds would tie
        await pipe.execute()
        return batch

    async def get(self, batch_id: str, account: str) -> dict[str, Any] | None:
        """The batch object, or None when there is none or it is another account's."""
        batch, owner = await self.load(batch_id)
        return batch if owner == account else None

    async def listing(self, account: str, *, limit: int, after: str | None) -> list[dict[str, Any]]:
        """The account's batch objects, newest first (:func:`serve.listing.account_objects`)."""
        return await account_objects(await self.ids(), account=account, after=after, limit=limit, load=self.load,
                                     forget=lambda batch_id: self._client.zrem(self._keys.batches, batch_id))

    async def load(self, batch_id: str) -> tuple[dict[str, Any] | None, str | None]:
        """The batch object (without the internal fields) and its account, whoever asks (the runner);
        (None, None) for no batch (or a stray key in its place)."""
        raw = cast("dict[bytes, bytes] | None", await absent_if_stray(self._client.hgetall(self._keys.batch(batch_id))))
        if not raw:
            return None, None
        fields = {key.decode(): json.loads(value) for key, value in raw.items()}
        batch = {key: value for key, value in fields.items() if key not in _INTERNAL}
        return batch, fields.get("account")

    async def update(self, batch_id: str, fields: dict[str, Any], *, if_status: Iterable[str] = (),
                     if_owner_older_than: float | None = None) -> bool:
        """Set ``fields`` if the status is one of ``if_status`` (empty: any) and, when given, the owner's
        last sign of life is older than that unix time. Returns whether they were set."""
        allowed = "|".join(json.dumps(status) for status in if_status)
        stale = "" if if_owner_older_than is None else repr(if_owner_older_than)
        args = [allowed, stale, *(item for pair in _encode(fields).items() for item in pair)]
        return bool(await absent_if_stray(self._update(keys=[self._keys.batch(batch_id)], args=args)))

    async def ids(self, *, since: float = 0.0, descending: bool = True) -> list[str]:
        """Batch ids created since unix time ``since``, newest first by default."""
        ids = cast("list[bytes]", await self._client.zrangebyscore(self._keys.batches, since, "+inf"))
        decoded = [batch_id.decode() for batch_id in ids]
        return decoded[::-1] if descending else decoded


def _encode(fields: dict[str, Any]) -> dict[str, str]:
    return {key: json.dumps(value) for key, value in fields.items()}
