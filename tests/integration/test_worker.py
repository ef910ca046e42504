"""The worker end to end with the echo model: round trip, reply streams, token streams, lanes,
cancellation and deadlines."""

from __future__ import annotations

import time

import redis

from tests.worker_helpers import enqueue, make_settings, running_worker, wait_result
from tokenmill.producer.client import Producer
from tokenmill.protocol.schema import decode_result

SLOW = "echo:step_delay_s=0.01"


def test_round_trip_through_producer(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix)
    with running_worker(settings), Producer(client=redis_client, prefix=key_prefix) as producer:
        first = producer.submit(prompt="abc", metadata={"k": 1}, logprobs=1)
        result = producer.result(first, timeout=5)
        assert (result.status, result.text, result.metadata) == ("ok", "abc", {"k": 1})
        assert result.usage.prompt_tokens == 3 and result.usage.completion_tokens == 4  # the echo, then EOS
        assert result.worker == settings.worker.name and result.logprobs is not None
        assert result.timings.total is not None and result.timings.total >= result.timings.queued  # type: ignore[operator]
        ids = producer.submit_many([{"prompt": f"p{i}"} for i in range(20)])
        texts = {r.id: r.text for r in producer.as_completed(ids, timeout=10)}
        assert texts == {rid: f"p{i}" for i, rid in enumerate(ids)}
        assert producer.get(first) == result


def test_reply_to_stream_gets_each_result_once(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix)
    keys = settings.queue.keys
    reply = keys.reply("replies")
    with running_worker(settings):
        ids = [enqueue(redis_client, keys, prompt=f"r{i}", reply_to=reply) for i in range(5)]
        for rid in ids:
            wait_result(redis_client, keys, rid)
    entries = redis_client.xrange(reply)
    assert sorted(decode_result(f[b"d"]).id for _, f in entries) == sorted(ids)
    assert all(f[b"v"] == b"1" for _, f in entries)


def test_token_stream_has_deltas_then_end(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix)
    keys = settings.queue.keys
    with running_worker(settings), Producer(client=redis_client, prefix=key_prefix) as producer:
        rid = producer.submit(prompt="streaming!", stream_tokens=True)
        assert "".join(producer.stream(rid, timeout=5)) == "streaming!"
        wait_result(redis_client, keys, rid)
    entries = [f for _, f in redis_client.xrange(keys.tokens(rid))]
    # a delta per write: a step's (one byte or, from a verified draft, several; EOS adds no text), or the steps' the
    # writer had not written yet as one (tests/integration/test_token_delta_batches.py); then the end
    assert 1 <= len(entries) - 1 <= len("streaming!") and entries[-1] == {b"end": b"1", b"status": b"ok"}
    assert all(b"end" not in entry for entry in entries[:-1])
    assert redis_client.ttl(keys.tokens(rid)) > 0


def test_most_urgent_lane_first(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, engine={"scheduler": {"max_num_seqs": 1}}, max_waiting=1)
    keys = settings.queue.keys
    reply = keys.reply("order")
    ids = {lane: [enqueue(redis_client, keys, lane, prompt=f"l{lane}", reply_to=reply) for _ in range(4)]
           for lane in (2, 1, 0)}
    with running_worker(settings):
        for rid in ids[2]:
            wait_result(redis_client, keys, rid)
    order = [decode_result(f[b"d"]).text for _, f in redis_client.xrange(reply)]
    assert order == ["l0"] * 4 + ["l1"] * 4 + ["l2"] * 4


def test_cancel_before_and_during_generation(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, model=SLOW)
    keys = settings.queue.keys
    with Producer(client=redis_client, prefix=key_prefix) as producer:
        early = enqueue(redis_client, keys, prompt="never")
        producer.cancel(early)
        with running_worker(settings):
            assert wait_result(redis_client, keys, early).status == "cancelled"
            late = producer.submit(prompt="x" * 50, max_tokens=500, ignore_eos=True, stream_tokens=True)
            next(iter(producer.stream(late, timeout=5)))
            producer.cancel(late)
            result = wait_result(redis_client, keys, late)
    assert (result.status, result.finish_reason) == ("cancelled", "abort")
    assert 0 < result.usage.completion_tokens < 500


def test_deadline_expired_at_read_and_while_waiting(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, model=SLOW, engine={"scheduler": {"max_num_seqs": 1}})
    keys = settings.queue.keys
    past = enqueue(redis_client, keys, deadline=time.time() - 1)
    blocker = enqueue(redis_client, keys, prompt="b" * 40, params={"max_tokens": 40})
    waiting = enqueue(redis_client, keys, prompt="w", deadline=time.time() + 0.2)
    with running_worker(settings):
        assert wait_result(redis_client, keys, past).status == "expired"
        expired = wait_result(redis_client, keys, waiting)
        assert (expired.status, expired.usage.completion_tokens) == ("expired", 0)
        assert wait_result(redis_client, keys, blocker).status == "ok"
