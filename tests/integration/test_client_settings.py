"""Issue 44 item 1, on a real Redis: a producer built with no arguments feeds the queue the deployment's settings
name (``TOKENMILL_CONFIG``: a queue of 3 shards, which works on one Redis too), as the worker, ``AsyncProducer()``
and Celery's ``register_tasks`` do; and a producer whose prefix or shard count differs from the live workers' is
told so on its first submit, not by a ``ResultTimeout`` a minute later."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from tests.worker_helpers import make_settings, running_worker
from tokenmill.producer import AsyncProducer, GenerationResult, Producer
from tokenmill.producer.celery import register_tasks
from tokenmill.worker.config import Settings
from tokenmill.worker.heartbeat import read_heartbeats


@pytest.fixture
def braced_keys(redis_client: redis.Redis, key_prefix: str) -> Iterator[None]:
    """Deletes the test's hash-tagged keys (``{prefix:queue...}``), which the ``key_prefix`` fixture does not."""
    yield
    for key in redis_client.scan_iter(match=f"{{{key_prefix}:*", count=1000):
        redis_client.delete(key)


@pytest.fixture
def sharded_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str, key_prefix: str,
                       braced_keys: None) -> Path:
    """``TOKENMILL_CONFIG`` naming a deployment of a 3-shard queue on the test's Redis and prefix."""
    for name in [*(name for name in os.environ if name.startswith("TOKENMILL_")), "REDIS_URL"]:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "deployment.toml"
    path.write_text(f'[queue]\nprefix = "{key_prefix}"\nshards = 3\n[redis]\nurl = "{redis_url}"\n')
    monkeypatch.setenv("TOKENMILL_CONFIG", str(path))
    return path


def _settings(redis_url: str, prefix: str) -> Settings:
    """An echo worker's settings: those of the deployment the environment names, with fast intervals."""
    return make_settings(redis_url, prefix, stale_after_s=5.0)


def test_clients_without_arguments_feed_the_queue_the_settings_name(
        redis_url: str, key_prefix: str, sharded_deployment: Path, producer_warnings: list[str]) -> None:
    settings = _settings(redis_url, key_prefix)
    assert settings.queue.shards == 3, "the worker reads the file TOKENMILL_CONFIG names"
    prompts = [{"prompt": f"item {i}", "raw": True, "max_tokens": 32} for i in range(20)]

    async def through_async_producer() -> list[GenerationResult]:
        async with AsyncProducer() as producer:
            return await producer.wait_all(await producer.submit_many(prompts[:5]), timeout=30)

    with running_worker(settings), Producer() as producer:
        assert producer.layout.num_shards == 3 and producer.keys.prefix == key_prefix
        ids = producer.submit_many(prompts)
        results = producer.wait_all(ids, timeout=30)
        assert len({producer.layout.shard_of(request_id) for request_id in ids}) >= 2
        assert producer.check_workers() == []
        async_results = asyncio.run(through_async_producer())
        generate = register_tasks(Celery("settings-test", set_as_current=False), mode="blocking", timeout_s=30.0)
        from_celery = generate.apply(args=[{"prompt": "via celery", "raw": True}], kwargs={"max_tokens": 32}).get()
        [beat] = read_heartbeats(producer.client, producer.keys).values()
    assert [r.text for r in results] == [p["prompt"] for p in prompts] and all(r.ok for r in results)
    assert [r.text for r in async_results] == [p["prompt"] for p in prompts[:5]]
    assert from_celery["status"] == "ok" and from_celery["text"] == "via celery"
    assert (beat.prefix, beat.queue, beat.num_lanes, beat.shards, beat.hash_tag, beat.cluster) == \
        (key_prefix, "default", 3, 3, True, False), "the worker publishes its layout"
    assert producer_warnings == []


def test_a_producer_with_another_shard_count_is_told_at_once(
        redis_url: str, key_prefix: str, sharded_deployment: Path, producer_warnings: list[str]) -> None:
    """The issue's case: the workers read 3 shards. A producer of 1 shard (plain keys on one Redis) finds their
    heartbeats under the braced spelling only; one of 2 shards finds them but with 3: both are told which setting
    to change, on the first submit, and again no sooner than the check interval."""
    warned = producer_warnings
    with running_worker(_settings(redis_url, key_prefix)):
        with Producer(shards=1) as single:
            start = time.monotonic()
            single.submit(prompt="lost", raw=True, max_tokens=4)
            elapsed_s = time.monotonic() - start
            single.submit(prompt="lost too", raw=True, max_tokens=4)
            told = single.check_workers()
        with Producer(shards=2) as double:
            double.submit(prompt="lost", raw=True, max_tokens=4)
    assert elapsed_s < 1.0
    assert warned[0] == told[0] == (
        f"no live worker heartbeat under {key_prefix}:default:workers, but 1 live worker of queue 'default' beats "
        f"under {{{key_prefix}:default}}:workers, reading it over 3 shards (lanes such as "
        f"{{{key_prefix}:default:0}}:lane:1), while this producer writes it over 1 shard (lanes such as "
        f"{key_prefix}:default:lane:1): set [queue] shards = 3 for this producer (TOKENMILL_QUEUE__SHARDS=3), or "
        "TOKENMILL_CONFIG naming the workers' settings file")
    assert len(warned) == 2, "one look per producer on its first submit, none on the next"
    assert warned[1].startswith("this producer writes queue 'default' over 2 shards (lanes such as "
                                f"{{{key_prefix}:default:0}}:lane:1) but its 1 live worker reads it over 3 shards")
    assert "set [queue] shards = 3 for this producer (TOKENMILL_QUEUE__SHARDS=3" in warned[1]


def test_a_producer_with_another_prefix_is_told_at_once(
        redis_url: str, key_prefix: str, sharded_deployment: Path, producer_warnings: list[str]) -> None:
    other = f"{key_prefix}:other"
    with running_worker(_settings(redis_url, key_prefix)), Producer(prefix=other) as producer:
        start = time.monotonic()
        producer.submit(prompt="lost", raw=True, max_tokens=4)
        elapsed_s = time.monotonic() - start
    assert elapsed_s < 1.0
    assert producer_warnings == [
        f"no live worker heartbeat under {{{other}:default}}:workers: no worker reads queue 'default' under prefix "
        f"{other!r} (3 shards, lanes such as {{{other}:default:0}}:lane:1), so requests wait until one starts; "
        "workers and producers must share [queue] prefix and name (TOKENMILL_QUEUE__PREFIX, TOKENMILL_QUEUE__NAME, "
        "or TOKENMILL_CONFIG naming the workers' settings file)"]
