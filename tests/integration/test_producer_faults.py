"""The producer under faults, on a real Redis: wait slices that expire before results
land (the ``make run`` KeyError), stale cancel marks, Redis timeouts on XADD, and reply_to names
outside the reply namespace."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.worker_helpers import make_settings, running_worker
from tokenmill.producer import AsyncProducer, Producer, SchemaError, SubmitUncertain, result_waits
from tokenmill.protocol.keys import DONE_TTL_S, Keys
from tokenmill.protocol.schema import GenerationResult, encode_result

SLICE_S = 0.6  # the wait slice under test; results land 0.5 and 1.5 slices in


@pytest.fixture
def short_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(result_waits, "WAIT_SLICE_S", SLICE_S)


def _land(client: redis.Redis, keys: Keys, request_ids: list[str], *, notify: bool) -> None:
    """Write results the way a worker does (result key, one done push), all in one MULTI."""
    pipe = client.pipeline(transaction=True)
    for request_id in request_ids:
        pipe.set(keys.result(request_id), encode_result(GenerationResult(id=request_id, status="ok")), ex=600)
        if notify:
            pipe.lpush(keys.done(request_id), b"1")
            pipe.expire(keys.done(request_id), DONE_TTL_S)
    pipe.execute()


@pytest.fixture
def late_results(redis_client: redis.Redis, keys: Keys) -> Iterator[list[str]]:
    """Four ids whose results land late: ``d`` (silently) before the first slice ends, so the
    next batch is a rotation of three ids; ``a``, ``b``, ``c`` together, during that batch's BLPOP.

    NOTE: before the fix, that batch was ``[b, c, a, b, c]``; the wake-up on one of them then
    collected the other two twice and raised KeyError.
    """
    def write() -> None:
        time.sleep(SLICE_S / 2)
        _land(redis_client, keys, ["d"], notify=False)
        time.sleep(SLICE_S)
        _land(redis_client, keys, ["a", "b", "c"], notify=True)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    yield ["a", "b", "c", "d"]
    writer.join(timeout=10)


def test_as_completed_survives_slices_that_expire_first(producer: Producer, short_slice: None,
                                                        late_results: list[str]) -> None:
    landed = [result.id for result in producer.as_completed(late_results, timeout=10)]
    assert sorted(landed) == late_results


def test_wait_all_survives_slices_that_expire_first(producer: Producer, short_slice: None,
                                                    late_results: list[str]) -> None:
    assert [result.id for result in producer.wait_all(late_results, timeout=10)] == late_results


async def test_async_as_completed_survives_slices_that_expire_first(aproducer: AsyncProducer, short_slice: None,
                                                                    late_results: list[str]) -> None:
    landed = [result.id async for result in aproducer.as_completed(late_results, timeout=10)]
    assert sorted(landed) == late_results


async def test_async_wait_all_survives_slices_that_expire_first(aproducer: AsyncProducer, short_slice: None,
                                                                late_results: list[str]) -> None:
    assert [result.id for result in await aproducer.wait_all(late_results, timeout=10)] == late_results


def test_a_resubmitted_id_is_not_cancelled_by_an_old_mark(redis_url: str, key_prefix: str, producer: Producer,
                                                          redis_client: redis.Redis, keys: Keys) -> None:
    producer.cancel("again")
    producer.cancel("many-1")
    assert redis_client.zcard(keys.cancel) == 2
    producer.submit(prompt="run me", max_tokens=2, request_id="again")
    producer.submit_many([{"prompt": "me too", "max_tokens": 2, "request_id": "many-1"}])
    assert redis_client.zcard(keys.cancel) == 0
    with running_worker(make_settings(redis_url, key_prefix)):
        results = producer.wait_all(["again", "many-1"], timeout=10)
    assert [result.status for result in results] == ["ok", "ok"]


async def test_async_submits_clear_old_cancel_marks(aproducer: AsyncProducer, redis_client: redis.Redis,
                                                    keys: Keys) -> None:
    for request_id in ("one", "two", "three"):
        await aproducer.cancel(request_id)
    await aproducer.submit(prompt="x", request_id="one")
    await aproducer.submit_many([{"prompt": "y", "request_id": "two"}])
    assert redis_client.zrange(keys.cancel, 0, -1) == [b"three"]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections and never answers: every command times out."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


NO_RETRY = {"socket_timeout": 0.2, "socket_connect_timeout": 1.0, "retry": Retry(NoBackoff(), 0)}
# NOTE: an asyncio client takes asyncio's retry (redis-py 8 converts a sync one, with a warning)
NO_RETRY_ASYNC = {**NO_RETRY, "retry": redis.asyncio.retry.Retry(NoBackoff(), 0)}


def test_a_timed_out_submit_says_resubmitting_is_safe(silent_port: int) -> None:
    client = redis.Redis(port=silent_port, **NO_RETRY)  # type: ignore[arg-type]
    producer = Producer(client=client)
    with pytest.raises(SubmitUncertain, match="same request_id is safe") as info:
        producer.submit(prompt="x", request_id="maybe")
    assert info.value.request_ids == ["maybe"]
    with pytest.raises(SubmitUncertain) as many:
        producer.submit_many([{"prompt": "x", "request_id": f"m{i}"} for i in range(3)])
    assert many.value.request_ids == ["m0", "m1", "m2"]
    client.close()


async def test_a_timed_out_async_submit_says_resubmitting_is_safe(silent_port: int) -> None:
    client = redis.asyncio.Redis(port=silent_port, **NO_RETRY_ASYNC)  # type: ignore[arg-type]
    producer = AsyncProducer(client=client)
    with pytest.raises(SubmitUncertain, match="same request_id is safe"):
        await producer.submit(prompt="x", request_id="maybe")
    await client.aclose()


@pytest.mark.parametrize("reply_to", ["{base}:res:other", "{base}:cancel", "{base}:lane:0", "elsewhere",
                                      "{base}:reply:"])
def test_reply_to_outside_the_namespace_is_refused_before_sending(reply_to: str, producer: Producer,
                                                                  redis_client: redis.Redis, keys: Keys) -> None:
    with pytest.raises(SchemaError, match="reply_to") as info:
        producer.submit(prompt="x", reply_to=reply_to.format(base=keys.base))
    assert info.value.code == "validation"
    with pytest.raises(SchemaError, match="reply_to"):
        producer.submit_many([{"prompt": "x", "reply_to": reply_to.format(base=keys.base)}])
    assert sum(redis_client.xlen(lane) for lane in keys.lanes) == 0
