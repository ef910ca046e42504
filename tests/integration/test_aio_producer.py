"""AsyncProducer against a real Redis: the same contract as the sync producer, awaited."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from tests.integration.conftest import FakeWorker
from tokenmill.producer import AsyncProducer, JobFailed, ResultTimeout, SchemaError
from tokenmill.producer.result_waits import WAIT_SLICE_S
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import GenerationRequest, decode_request


async def test_submit_and_submit_many(aproducer: AsyncProducer, redis_client: redis.Redis, keys: Keys) -> None:
    first = await aproducer.submit(prompt="hi", priority="low", max_tokens=4)
    rest = await aproducer.submit_many([{"prompt": "a", "priority": "low"},
                                        GenerationRequest(id="b", prompt="b", priority=2)])
    entries = [decode_request(fields) for _, fields in redis_client.xrange(keys.lane(2))]
    assert [e.id for e in entries] == [first, *rest] and rest[1] == "b"
    assert entries[0].params.max_tokens == 4
    with pytest.raises(SchemaError, match="unknown submit option"):
        await aproducer.submit(prompt="x", max_token=4)  # type: ignore[call-arg]


async def test_result_get_and_timeout(aproducer: AsyncProducer, fake_worker: FakeWorker) -> None:
    request_id = await aproducer.submit(prompt="x")
    assert await aproducer.get(request_id) is None
    fake_worker.later(0.1, fake_worker.finish, request_id, "async hello")
    assert (await aproducer.result(request_id, timeout=10)).text == "async hello"
    assert (await aproducer.get(request_id)) is not None
    with pytest.raises(ResultTimeout, match="'absent'"):
        await aproducer.result("absent", timeout=0.2)


async def test_many_waiters_on_one_id_all_wake(aproducer: AsyncProducer, fake_worker: FakeWorker) -> None:
    request_id = await aproducer.submit(prompt="x")
    waiters = [asyncio.create_task(aproducer.result(request_id, timeout=10)) for _ in range(3)]
    await asyncio.sleep(0.2)
    start = time.monotonic()
    fake_worker.finish(request_id, "everyone")
    results = await asyncio.gather(*waiters)
    assert [r.text for r in results] == ["everyone"] * 3
    assert time.monotonic() - start < WAIT_SLICE_S / 2


async def test_raise_on_error(aproducer: AsyncProducer, fake_worker: FakeWorker) -> None:
    fake_worker.finish("gone", "late", status="expired")
    with pytest.raises(JobFailed, match="expired"):
        await aproducer.result("gone", raise_on_error=True)


async def test_as_completed_and_wait_all(aproducer: AsyncProducer, fake_worker: FakeWorker) -> None:
    ids = await aproducer.submit_many([{"prompt": str(i)} for i in range(3)])
    for delay, index in ((0.1, 1), (0.2, 2), (0.3, 0)):
        fake_worker.later(delay, fake_worker.finish, ids[index], str(index))
    order = [r.id async for r in aproducer.as_completed(ids, timeout=10)]
    assert order == [ids[1], ids[2], ids[0]]
    assert [r.text for r in await aproducer.wait_all(ids, timeout=1)] == ["0", "1", "2"]


async def test_stream_cancel_and_stats(aproducer: AsyncProducer, fake_worker: FakeWorker,
                                       redis_client: redis.Redis, keys: Keys) -> None:
    request_id = await aproducer.submit(prompt="x", stream_tokens=True, priority="high")
    fake_worker.later(0.1, fake_worker.emit, request_id, [b"a", b"b", b"c"])
    assert [delta async for delta in aproducer.stream(request_id, timeout=10)] == ["a", "b", "c"]
    await aproducer.cancel(request_id)
    assert redis_client.zscore(keys.cancel, request_id) is not None
    stats = await aproducer.stats()
    assert stats["lanes"][0]["depth"] == 1 and stats["cancelled"] == 1 and stats["num_live_workers"] == 0


async def test_injected_client_is_not_closed(redis_url: str, key_prefix: str) -> None:
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(redis_url)
    async with AsyncProducer(prefix=key_prefix, client=client) as producer:
        await producer.submit(prompt="x")
    assert await client.ping()
    await client.aclose()
