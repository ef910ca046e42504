"""Producer against a real Redis, with a simulated worker writing results per the contract."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import redis

from tests.integration.conftest import FakeWorker
from tokenmill.producer import (
    JobFailed,
    Producer,
    ProducerConfig,
    QueueConfig,
    RedisConfig,
    RedisUnavailable,
    ResultTimeout,
    SchemaError,
    locate,
)
from tokenmill.producer.result_waits import WAIT_SLICE_S
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys
from tokenmill.protocol.schema import GenerationRequest, decode_request


def lane_entries(client: redis.Redis, keys: Keys, lane: int) -> list[GenerationRequest]:
    return [decode_request(fields) for _, fields in client.xrange(keys.lane(lane))]


def test_submit_writes_a_decodable_entry_to_its_lane(producer: Producer, redis_client: redis.Redis,
                                                     keys: Keys) -> None:
    request_id = producer.submit(prompt="Hello", max_tokens=8, temperature=0.5, stop="\n",
                                 metadata={"user": 7}, request_id="req-1")
    assert request_id == "req-1"
    (request,) = lane_entries(redis_client, keys, 1)  # default priority "normal" = lane 1
    assert (request.id, request.prompt, request.priority) == ("req-1", None, 1)
    assert [(m.role, m.content) for m in request.messages] == [("user", "Hello")]  # a plain prompt is chat
    assert (request.params.max_tokens, request.params.temperature, request.params.stop) == (8, 0.5, ["\n"])
    assert request.metadata == {"user": 7}


@pytest.mark.parametrize(("priority", "lane"), [("high", 0), ("normal", 1), ("low", 2), (0, 0), (2, 2)])
def test_priorities_map_to_lanes(producer: Producer, redis_client: redis.Redis, keys: Keys,
                                 priority: str | int, lane: int) -> None:
    messages = [{"role": "user", "content": "hi"}]
    request_id = producer.submit(messages=messages, priority=priority)  # type: ignore[arg-type]
    assert [r.id for r in lane_entries(redis_client, keys, lane)] == [request_id]


def test_invalid_submit_sends_nothing(producer: Producer, redis_client: redis.Redis, keys: Keys) -> None:
    with pytest.raises(SchemaError, match="exactly one of prompt"):
        producer.submit(max_tokens=3)
    with pytest.raises(SchemaError, match="priority"):
        producer.submit(prompt="x", priority=3)
    with pytest.raises(SchemaError, match="max_tokens"):
        producer.submit_many([{"prompt": "fine"}, {"prompt": "bad", "max_tokens": 0}])
    assert sum(redis_client.xlen(lane) for lane in keys.lanes) == 0


def test_submit_many_is_pipelined_and_keeps_order(redis_url: str, key_prefix: str, keys: Keys,
                                                  redis_client: redis.Redis,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    sends: list[int] = []
    probe = redis.Redis.from_url(redis_url)
    base = probe.connection_pool.connection_class
    probe.close()

    class CountingConnection(base):  # type: ignore[valid-type, misc]
        """Counts round trips of this client only (other threads' clients are not patched)."""

        def send_packed_command(self, *args: object, **kwargs: object) -> None:
            sends.append(1)
            super().send_packed_command(*args, **kwargs)

    client = redis.Redis.from_url(redis_url, connection_class=CountingConnection)
    client.ping()
    sends.clear()
    config = ProducerConfig(queue=QueueConfig(prefix=key_prefix), submit_chunk_size=500)
    producer = Producer.from_config(config, client=client)
    items: list[GenerationRequest | dict[str, object]] = [
        {"prompt": f"p{i}", "priority": i % 3} for i in range(1199)
    ]
    items.append(GenerationRequest(id="last", prompt_token_ids=[1, 2], priority=0))
    ids = producer.submit_many(items)
    client.close()
    assert len(sends) == 3  # 1200 requests / 500 per round trip
    assert len(ids) == 1200 and ids[-1] == "last" and len(set(ids)) == 1200
    in_lane_0 = [r.id for r in lane_entries(redis_client, keys, 0)]
    assert in_lane_0 == [ids[i] for i in range(0, 1199, 3)] + ["last"]


def test_result_wakes_when_the_worker_writes(producer: Producer, fake_worker: FakeWorker) -> None:
    request_id = producer.submit(prompt="x")
    fake_worker.later(0.2, fake_worker.finish, request_id, "hello")
    start = time.monotonic()
    result = producer.result(request_id, timeout=10)
    assert (result.id, result.status, result.text) == (request_id, "ok", "hello")
    assert time.monotonic() - start < 1.5


def test_result_times_out(producer: Producer) -> None:
    start = time.monotonic()
    with pytest.raises(ResultTimeout, match=r"'nope'.*0\.3 s"):
        producer.result("nope", timeout=0.3)
    assert 0.25 < time.monotonic() - start < 1.5


def test_two_waiters_on_one_id_both_wake(producer: Producer, fake_worker: FakeWorker) -> None:
    request_id = producer.submit(prompt="x")
    texts: list[str] = []
    threads = [threading.Thread(target=lambda: texts.append(producer.result(request_id, timeout=10).text))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)  # both are blocked in BLPOP now
    start = time.monotonic()
    fake_worker.finish(request_id, "shared")
    for thread in threads:
        thread.join(timeout=10)
    assert texts == ["shared", "shared"]
    assert time.monotonic() - start < WAIT_SLICE_S / 2  # woken by the re-armed token, not a re-check
    assert producer.result(request_id, timeout=1).text == "shared"  # a third, late waiter too


def test_waiter_after_done_list_expired_reads_the_result_key(producer: Producer, fake_worker: FakeWorker) -> None:
    fake_worker.finish("late", "still here", notify=False)
    assert producer.result("late", timeout=1).text == "still here"


def test_get_and_raise_on_error(producer: Producer, fake_worker: FakeWorker) -> None:
    request_id = producer.submit(prompt="x")
    assert producer.get(request_id) is None
    fake_worker.finish(request_id, "bad input", status="error")
    failed = producer.get(request_id)
    assert failed is not None and failed.status == "error"
    assert producer.result(request_id).error is not None
    with pytest.raises(JobFailed, match="boom: bad input") as info:
        producer.result(request_id, raise_on_error=True)
    assert info.value.code == "internal"


def test_as_completed_yields_in_completion_order(producer: Producer, fake_worker: FakeWorker) -> None:
    ids = producer.submit_many([{"prompt": str(i)} for i in range(4)])
    fake_worker.finish(ids[3], "already")  # landed before anyone waits
    for delay, index in ((0.1, 2), (0.25, 0), (0.4, 1)):
        fake_worker.later(delay, fake_worker.finish, ids[index], str(index))
    order = [result.id for result in producer.as_completed(ids, timeout=10)]
    assert order == [ids[3], ids[2], ids[0], ids[1]]


def test_wait_all_keeps_input_order_and_times_out(producer: Producer, fake_worker: FakeWorker) -> None:
    ids = ["a", "b", "c"]
    fake_worker.later(0.1, fake_worker.finish, "c", "C")
    fake_worker.later(0.2, fake_worker.finish, "a", "A")
    fake_worker.later(0.3, fake_worker.finish, "b", "B")
    assert [r.text for r in producer.wait_all(ids, timeout=10)] == ["A", "B", "C"]
    with pytest.raises(ResultTimeout, match="1 results|'missing'"):
        producer.wait_all(["a", "missing"], timeout=0.3)


def test_stream_yields_deltas(producer: Producer, fake_worker: FakeWorker) -> None:
    request_id = producer.submit(prompt="x", stream_tokens=True)
    snowman = "☃".encode()
    fake_worker.later(0.1, fake_worker.emit, request_id, [b"Hel", b"lo ", snowman[:1], snowman[1:], b"!"])
    assert "".join(producer.stream(request_id, timeout=10)) == "Hello ☃!"


def test_stream_ends_when_the_result_lands_without_tokens(producer: Producer, fake_worker: FakeWorker) -> None:
    request_id = producer.submit(prompt="x")
    fake_worker.later(0.1, fake_worker.finish, request_id)
    assert list(producer.stream(request_id, timeout=10)) == []
    with pytest.raises(ResultTimeout):
        list(producer.stream("never", timeout=0.2))


def test_cancel_marks_and_trims(producer: Producer, redis_client: redis.Redis, keys: Keys) -> None:
    redis_client.zadd(keys.cancel, {"ancient": time.time() - 2 * producer.config.queue.result_ttl_s})
    producer.cancel("job-9")
    assert redis_client.zscore(keys.cancel, "job-9") == pytest.approx(time.time(), abs=5)
    assert redis_client.zscore(keys.cancel, "ancient") is None


def test_stats_on_a_populated_queue(producer: Producer, redis_client: redis.Redis, keys: Keys) -> None:
    producer.submit_many([{"prompt": "a", "priority": 0}, {"prompt": "b", "priority": 0},
                          {"prompt": "c", "priority": 2}])
    redis_client.xgroup_create(keys.lane(0), CONSUMER_GROUP, id="0")
    redis_client.xreadgroup(CONSUMER_GROUP, "w1", {keys.lane(0): ">"}, count=1)
    redis_client.xadd(keys.dead, {"d": b"x"})
    now = time.time()
    redis_client.hset(keys.workers, mapping={
        "w1": msgpack.packb({"ts": now, "running": 1}),
        "w2": msgpack.packb({"ts": now - 300}),
        "w3": b"\xc1garbage",
        "w4": msgpack.packb({"ts": now, "state": "stopped"}),
    })
    producer.cancel("c1")
    stats = producer.stats(stale_after_s=30)
    lane0, lane1, lane2 = stats["lanes"]
    assert (lane0["depth"], lane0["pending"], lane0["has_group"]) == (2, 1, True)
    assert lane0["lag"] in (None, 1)  # XINFO GROUPS reports lag from Redis 7 on
    assert (lane1["depth"], lane1["pending"], lane1["has_group"], lane1["lag"]) == (0, 0, False, None)
    assert (lane2["depth"], lane2["pending"]) == (1, 0)
    assert (stats["depth"], stats["pending"], stats["dead"], stats["cancelled"]) == (3, 1, 1, 1)
    assert stats["num_live_workers"] == 1 and stats["workers"]["w1"]["running"] == 1
    assert set(stats["stale_workers"]) == {"w2", "w3", "w4"}


def test_reply_to_stream_receives_the_result(producer: Producer, fake_worker: FakeWorker,
                                             redis_client: redis.Redis) -> None:
    reply_to = producer.keys.reply("fan-in")
    request_id = producer.submit(prompt="x", reply_to=reply_to)
    fake_worker.finish(request_id, "fan-in", reply_to=reply_to)
    (_, fields), = redis_client.xrange(reply_to)
    assert fields[b"v"] == b"1" and producer.result(request_id).text == "fan-in"


def test_connect_failure_is_clear_and_redacts_the_password() -> None:
    config = RedisConfig(url="redis://user:s3cret@127.0.0.1:1/0", connect_retries=1, retry_backoff_s=0.01)
    start = time.monotonic()
    with pytest.raises(RedisUnavailable, match="after 2 attempt") as info:
        Producer.from_config(ProducerConfig(redis=config))
    assert "s3cret" not in str(info.value) and "user:***@" in str(info.value)
    assert time.monotonic() - start < 3


def test_locate_pages_through_every_lane(producer: Producer, fake_worker: FakeWorker,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locate, "LOCATE_PAGE", 2)  # several XRANGE pages per lane
    ids = [producer.submit(prompt=f"p{i}", priority=i % 3) for i in range(9)]
    fake_worker.finish("answered")
    states = producer.locate([ids[8], "answered", "never-seen", ids[0]])
    assert states == {ids[8]: "queued", "answered": "finished", "never-seen": "unknown", ids[0]: "queued"}
    assert producer.locate([]) == {}
