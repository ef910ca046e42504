"""One logical queue spread over 3 shards of a real Redis Cluster (3 primaries, one replica each): every
script's keys share a slot, echo workers answer each request exactly once (Producer.result, as_completed and
a reply stream unchanged; the async producer too), through a worker SIGKILLed mid-run, a primary failing
over, a slot migrating, and workers joining and leaving (shards rebalance; none is left unread)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import redis.cluster
from redis.crc import key_slot

from tests.cluster_helpers import LocalCluster, wait_for
from tests.worker_helpers import FAST_WORKER, start_worker_process
from tokenmill.producer import AsyncProducer, Producer, submit_commands
from tokenmill.producer.config import ProducerConfig
from tokenmill.protocol.config import QueueConfig, RedisConfig
from tokenmill.protocol.keys import CONSUMER_GROUP
from tokenmill.protocol.schema import GenerationRequest, GenerationResult, decode_result
from tokenmill.protocol.shards import QueueLayout
from tokenmill.worker.config import Settings
from tokenmill.worker.messages import DeadLetter, Entry, Finish, Handoff
from tokenmill.worker.redis_block_store import redis_block_store
from tokenmill.worker.results import ResultWriter
from tokenmill.worker.runtime import Worker

pytestmark = pytest.mark.timeout(120)
NUM_SHARDS = 3
SLOW_ECHO = "echo:step_delay_s=0.01"  # 16 tokens a request: ~0.2 s each, so events land mid-run


def _slot(key: str | bytes) -> int:
    return int(key_slot(key.encode() if isinstance(key, str) else key))


def _assert_one_slot(keys: list[str], what: str) -> None:
    assert len({_slot(key) for key in keys}) == 1, f"{what}: keys on several slots: {keys}"


def test_every_script_call_names_keys_of_one_slot() -> None:
    layout = QueueConfig(prefix="slots", shards=NUM_SHARDS).layout(is_cluster=True)
    writer = ResultWriter(redis.Redis(), layout, result_ttl_s=60, token_ttl_s=60)  # NOTE: register_script: no I/O
    reply = layout.home.reply("fan-in")
    seen_slots = set()
    for shard, keys in enumerate(layout.shards):
        request_id = next(f"r{i}" for i in range(1000) if layout.shard_of(f"r{i}") == shard)
        request = GenerationRequest(id=request_id, prompt="x", reply_to=reply)
        lane = keys.lanes_for(["m"])[1]  # a model's lane of the shard
        entry = Entry(lane.stream, "1-0", lane.priority, {b"d": b"x"})
        with_reply = Finish(GenerationResult(id=request_id, status="ok"), entry, reply, True)
        calls = {"finish": writer.finish_call(with_reply, b"payload"),
                 "dead letter": writer.finish_call(DeadLetter(entry, "why"), None),
                 "handoff": writer.handoff_call(Handoff(entry, request_id)),
                 "reply once": writer.reply_call(with_reply, b"payload")}
        for what, call in calls.items():
            _assert_one_slot(call.keys, what)
        assert _slot(calls["finish"].keys[0]) != _slot(reply), "the reply stream is queue-wide: its own slot"
        submitted: list[list[str]] = []

        def record(keys: list[str], args: list[Any], client: Any, calls: list[list[str]] = submitted) -> None:
            calls.append(keys)

        submit_commands.queue_submit_once_commands(None, record, layout, [request.model_copy(update={"model": "m"})],
                                                   0.0, 60.0)
        _assert_one_slot([*submitted[0], keys.result(request_id), keys.done(request_id), keys.cancel, keys.dead,
                          keys.tokens(request_id), *keys.lanes], "submit once, rearm, cancel and the lanes")
        assert layout.for_id(request_id) == keys
        seen_slots.add(_slot(keys.cancel))
    assert len(seen_slots) == NUM_SHARDS, "each shard is a slot of its own"
    store = redis_block_store(redis.Redis(), "slots", b"\x01\x02", 1 << 20, 60, hash_tag=True)
    _assert_one_slot([store.lru_key, store.sizes_key, store.bytes_key, store.value_key(b"\x09" * 16),
                      f"{store.key_prefix}:{'ab' * 16}"], "block store (keys the put script builds too)")
    unsharded = QueueConfig(prefix="slots").layout(is_cluster=False)
    assert unsharded.shards == (unsharded.home,) and unsharded.home.lane(0) == "slots:default:lane:0", \
        "one shard on one instance keeps today's names"


def _config(cluster: LocalCluster, prefix: str, **queue: Any) -> ProducerConfig:
    return ProducerConfig(redis=RedisConfig(url=cluster.url),
                          queue=QueueConfig(prefix=prefix, shards=NUM_SHARDS, **queue))


def _settings(cluster: LocalCluster, prefix: str, name: str, model: str = SLOW_ECHO, **queue: Any) -> Settings:
    return Settings.load(None, {"queue": {"prefix": prefix, "shards": NUM_SHARDS, **queue},
                                "redis": {"url": cluster.url},
                                "worker": {**FAST_WORKER, "name": name, "max_waiting": 16},
                                "engine": {"model": {"name": model}, "scheduler": {"max_num_seqs": 16}}})


@pytest.fixture
def prefix() -> str:
    return f"tmcl-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def cluster_client(redis_cluster: LocalCluster) -> Iterator[redis.Redis]:
    client = redis.cluster.RedisCluster.from_url(redis_cluster.url.replace("+cluster", ""))
    yield client  # type: ignore[misc]
    client.close()


@contextmanager
def _worker(settings: Settings) -> Iterator[Worker]:
    """An echo worker on the cluster in a thread, once its heartbeat is written; stopped gracefully after."""
    worker = Worker(settings, handle_signals=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    probe = redis.cluster.RedisCluster.from_url(settings.redis.url.replace("+cluster", ""))  # type: ignore[union-attr]
    home = settings.queue.layout(True).home
    wait_for(lambda: bool(probe.hexists(home.workers, settings.worker.name)), 15, "heartbeat")
    probe.close()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=20)
        assert not thread.is_alive(), "worker did not stop"


def _submit(producer: Producer, count: int, reply: str) -> list[str]:
    # NOTE: three shared 600-character prefixes, so prefix placement puts them on (at most) three shards
    heads = ["alpha " * 100, "beta " * 120, "gamma " * 100]
    return producer.submit_many([{"prompt": f"{heads[i % 3]} request {i:03d}", "raw": True, "max_tokens": 16,
                                  "reply_to": reply} for i in range(count)])


def _num_answered(producer: Producer, ids: list[str]) -> int:
    return sum(raw is not None for raw in producer.raw_results(ids))


def _wait_answered(client: redis.Redis, layout: QueueLayout, ids: list[str], timeout_s: float) -> None:
    def count() -> int:
        pipe = client.pipeline(transaction=False)
        for request_id in ids:
            pipe.exists(layout.for_id(request_id).result(request_id))
        return sum(pipe.execute())

    wait_for(lambda: count() == len(ids), timeout_s, f"all {len(ids)} answered", poll_s=0.2)


def _assert_exactly_once(client: redis.Redis, producer: Producer, ids: list[str], reply: str) -> None:
    results = producer.wait_all(ids, timeout=30)
    assert all(result.status == "ok" and result.text for result in results)
    # NOTE: on a cluster with several shards the reply and the ack follow the stored result (three steps)
    lanes = [lane for keys in producer.layout.shards for lane in keys.lanes]
    wait_for(lambda: client.xlen(reply) >= len(ids) and all(
        client.xpending(lane, CONSUMER_GROUP)["pending"] == 0 for lane in lanes if client.exists(lane)),
        30, "every reply sent and every entry acked", poll_s=0.2)
    replied = [decode_result(fields[b"d"]).id for _, fields in client.xrange(reply)]
    assert sorted(replied) == sorted(ids), "the reply stream has duplicates or gaps"
    for keys in producer.layout.shards:
        for lane in keys.lanes:
            if client.exists(lane):
                assert client.xpending(lane, CONSUMER_GROUP)["pending"] == 0
                assert client.xlen(lane) == 0, "answered entries are deleted"


def test_echo_workers_over_three_shards_answer_each_request_once(
        redis_cluster: LocalCluster, cluster_client: redis.Redis, prefix: str) -> None:
    with Producer.from_config(_config(redis_cluster, prefix)) as producer, \
            _worker(_settings(redis_cluster, prefix, "w-a")), _worker(_settings(redis_cluster, prefix, "w-b")):
        reply = producer.keys.reply("fan-in")
        ids = _submit(producer, 90, reply)
        shards = {producer.layout.shard_of(request_id) for request_id in ids}
        by_prefix = {producer.layout.shard_of(request_id) for request_id in ids[::3]}
        assert len(by_prefix) == 1, "requests sharing a prefix share a shard"
        first = producer.result(ids[0], timeout=20)
        collected = {result.id: result for result in producer.as_completed(ids, timeout=30)}
        assert first.ok and collected[ids[0]].text == first.text and set(collected) == set(ids)
        single = producer.submit(prompt="hello there", max_tokens=4)
        assert producer.result(single, timeout=10).ok
        stats = producer.stats()
        assert len(shards) >= 2 and len(stats["shards"]) == NUM_SHARDS
        _assert_exactly_once(cluster_client, producer, ids, reply)


def test_the_issue_s_environment_reaches_producer_and_a_producer_of_one_shard_is_told(
        redis_cluster: LocalCluster, prefix: str, monkeypatch: pytest.MonkeyPatch,
        producer_warnings: list[str]) -> None:
    """Issue 44: with ``REDIS_URL=redis+cluster://...`` and ``TOKENMILL_QUEUE__SHARDS=3``, ``Producer()`` writes the
    shards the workers read; a producer of one shard (the defaults) writes ``{prefix:default}:lane:1``, which no
    worker reads, and is told so by its first submit instead of a ResultTimeout a minute later."""
    for name in [name for name in os.environ if name.startswith("TOKENMILL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("REDIS_URL", redis_cluster.url)
    monkeypatch.setenv("TOKENMILL_QUEUE__SHARDS", str(NUM_SHARDS))
    monkeypatch.setenv("TOKENMILL_QUEUE__PREFIX", prefix)
    settings = Settings.load(None, {"worker": {**FAST_WORKER, "name": "w-env"}, "engine": {"model": {"name": "echo"}}})
    with _worker(settings), Producer() as producer, Producer(shards=1) as single:
        ids = producer.submit_many([{"prompt": f"env {i}", "raw": True, "max_tokens": 8} for i in range(20)])
        assert [result.text for result in producer.wait_all(ids, timeout=30)] == [f"env {i}" for i in range(20)]
        assert producer_warnings == []
        start = time.monotonic()
        single.submit_many([{"prompt": f"lost {i}", "raw": True} for i in range(20)])
        elapsed_s = time.monotonic() - start
    assert elapsed_s < 1.0
    assert producer_warnings == [
        f"this producer writes queue 'default' over 1 shard (lanes such as {{{prefix}:default}}:lane:1) but its 1 live "
        f"worker reads it over 3 shards (lanes such as {{{prefix}:default:0}}:lane:1): set [queue] shards = 3 for this "
        "producer (TOKENMILL_QUEUE__SHARDS=3, or TOKENMILL_CONFIG naming the workers' settings file); producers and "
        "workers must agree on it"]


async def test_the_async_producer_over_three_shards(redis_cluster: LocalCluster, cluster_client: redis.Redis,
                                                   prefix: str) -> None:
    """AsyncProducer on the cluster client: submit_many, result, as_completed, stream, cancel and stats over
    3 shards, each request answered once."""
    with _worker(_settings(redis_cluster, prefix, "w-async")):
        async with AsyncProducer.from_config(_config(redis_cluster, prefix)) as producer:
            ids = await producer.submit_many([{"prompt": f"async request {i:02d}", "raw": True, "max_tokens": 8}
                                              for i in range(24)])
            assert len({producer.layout.shard_of(request_id) for request_id in ids}) >= 2
            first = await producer.result(ids[0], timeout=20)
            collected = {result.id: result async for result in producer.as_completed(ids, timeout=30)}
            assert first.ok and collected[ids[0]].text == first.text and set(collected) == set(ids)
            assert all(result.ok and result.text for result in collected.values())
            streamed = await producer.submit(prompt="stream me", raw=True, max_tokens=6, stream_tokens=True)
            text = "".join([piece async for piece in producer.stream(streamed, timeout=20)])
            assert text == (await producer.result(streamed, timeout=10)).text
            stats = await producer.stats()
            assert len(stats["shards"]) == NUM_SHARDS
    # NOTE: each id's result key lives on its own shard's slot: exactly one each
    layout = _config(redis_cluster, prefix).layout
    for request_id in ids:
        assert cluster_client.exists(layout.for_id(request_id).result(request_id)) == 1


def test_sigkill_mid_run_second_worker_reclaims(redis_cluster: LocalCluster, cluster_client: redis.Redis,
                                                prefix: str) -> None:
    env = {"TOKENMILL_QUEUE__SHARDS": str(NUM_SHARDS), "TOKENMILL_ENGINE__SCHEDULER__MAX_NUM_SEQS": "16"}
    with Producer.from_config(_config(redis_cluster, prefix)) as producer:
        reply = producer.keys.reply("crash")
        ids = _submit(producer, 120, reply)
        victim = start_worker_process(redis_cluster.url, prefix, "victim", "--max-waiting", "16",
                                      model="echo:step_delay_s=0.02", env=env)
        try:
            wait_for(lambda: _num_answered(producer, ids) >= 20, 40, "20 answers", poll_s=0.05)
            victim.send_signal(signal.SIGKILL)
            victim.wait(timeout=10)
            held = sum(int(cluster_client.xpending_range(lane, CONSUMER_GROUP, "-", "+", 1000, "victim").__len__())
                       for keys in producer.layout.shards for lane in keys.lanes)
            assert held > 0 and _num_answered(producer, ids) < len(ids), "killed mid-run, holding entries"
            rescuer = start_worker_process(redis_cluster.url, prefix, "rescuer", "--max-waiting", "16",
                                           model="echo:step_delay_s=0.001", env=env)
            try:
                _wait_answered(cluster_client, producer.layout, ids, 60)
            finally:
                rescuer.send_signal(signal.SIGTERM)
                assert rescuer.wait(timeout=20) == 0
        finally:
            victim.kill()
        _assert_exactly_once(cluster_client, producer, ids, reply)
        assert any(result.worker == "rescuer" for result in producer.wait_all(ids, timeout=5))


@contextmanager
def _mid_run(redis_cluster: LocalCluster, cluster_client: redis.Redis, prefix: str, event: str) -> Iterator[int]:
    """Two echo workers answering 240 requests, 15 of them answered but not all: the test's ``event`` (the
    body) happens now, to the slot of the shard most of them are on (yielded); then 30 more requests go through
    the cluster as the event left it, and every request is answered exactly once."""
    with Producer.from_config(_config(redis_cluster, prefix)) as producer, \
            _worker(_settings(redis_cluster, prefix, "w-a")), _worker(_settings(redis_cluster, prefix, "w-b")):
        reply = producer.keys.reply(event)
        ids = _submit(producer, 240, reply)
        wait_for(lambda: _num_answered(producer, ids) >= 15, 30, "15 answers")
        busiest = max(range(NUM_SHARDS), key=lambda k: sum(producer.layout.shard_of(i) == k for i in ids))
        assert _num_answered(producer, ids) < len(ids), f"the {event} starts mid-run"
        yield _slot(producer.layout.shards[busiest].cancel)
        more = _submit(producer, 30, reply)
        _wait_answered(cluster_client, producer.layout, ids + more, 60)
        _assert_exactly_once(cluster_client, producer, ids + more, reply)


def test_a_primary_failing_over_under_load_loses_nothing(redis_cluster: LocalCluster, cluster_client: redis.Redis,
                                                         prefix: str) -> None:
    with _mid_run(redis_cluster, cluster_client, prefix, "failover") as slot:
        redis_cluster.failover(redis_cluster.node_of_slot(slot))  # NOTE: later requests go through the promoted replica


def test_a_slot_migrating_under_load_loses_nothing(redis_cluster: LocalCluster, cluster_client: redis.Redis,
                                                   prefix: str) -> None:
    with _mid_run(redis_cluster, cluster_client, prefix, "migration") as slot:
        source = redis_cluster.node_of_slot(slot)
        target = next(node for node in redis_cluster.primaries() if node.port != source.port)
        moved = redis_cluster.migrate_slot(slot, target, batch=3, pause_s=0.02)
        assert moved > 0 and redis_cluster.node_of_slot(slot).port == target.port


def test_workers_joining_and_leaving_rebalance_and_no_shard_is_left_unread(
        redis_cluster: LocalCluster, cluster_client: redis.Redis, prefix: str) -> None:
    every = frozenset(range(NUM_SHARDS))
    with Producer.from_config(_config(redis_cluster, prefix, readers_per_shard=1)) as producer, \
            _worker(_settings(redis_cluster, prefix, "w-first", readers_per_shard=1)) as first:
        reader_a = first._reader
        wait_for(lambda: reader_a.claimed_shards == every, 5, "alone, it reads every shard")
        with _worker(_settings(redis_cluster, prefix, "w-second", readers_per_shard=1)) as second:
            reader_b = second._reader
            wait_for(lambda: reader_a.claimed_shards | reader_b.claimed_shards == every
                     and not reader_a.claimed_shards & reader_b.claimed_shards
                     and bool(reader_b.claimed_shards) and reader_a.claimed_shards != every, 10, "shards split")
            reply = producer.keys.reply("rebalance")
            ids = _submit(producer, 60, reply)
            _wait_answered(cluster_client, producer.layout, ids, 30)
        wait_for(lambda: reader_a.claimed_shards == every, 10, "the orphaned shards taken back")
        later = _submit(producer, 60, reply)
        _wait_answered(cluster_client, producer.layout, later, 30)
        _assert_exactly_once(cluster_client, producer, ids + later, reply)


def test_the_block_store_reads_after_its_node_lost_the_scripts(redis_cluster: LocalCluster,
                                                               cluster_client: redis.Redis, prefix: str) -> None:
    """A promoted replica holds no scripts: the store's reads (a pipeline with the recency script) still answer."""
    store = redis_block_store(cluster_client, prefix, b"ns", max_bytes=1 << 20, ttl_s=60, hash_tag=True)
    store.put([b"a", b"b"], [b"x" * 100, b"y" * 100])
    for node in redis_cluster.primaries():
        node.client.script_flush()
    assert store.get([b"c", b"a"]) == [None, b"x" * 100]
    node = redis_cluster.node_of_slot(_slot(store.lru_key))
    assert node.client.zrange(store.lru_key, 0, -1) == [b"b".hex().encode(), b"a".hex().encode()]  # a renewed
    assert store.get([b"b"]) == [b"y" * 100]  # the script loaded again
    assert node.client.zrange(store.lru_key, 0, -1) == [b"a".hex().encode(), b"b".hex().encode()]
    store.discard([b"a", b"c"])  # a rejected value: its key deleted through the cluster client
    assert store.contains([b"a", b"b"]) == [False, True]
