"""The commands that put requests on the queue and take them back: the pipelined XADDs of a submit (each on its
shard's lane, after clearing the ids' old cancel marks), the submit-once script (Celery, bulk), the cancel marks,
and what a Redis failure during an enqueue means (:class:`SubmitUncertain`). Queued on a sync or asyncio pipeline
alike; the producers send them. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis

from tokenmill.producer.errors import SubmitUncertain
from tokenmill.protocol.schema import GenerationRequest, encode_request
from tokenmill.protocol.shards import QueueLayout

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
