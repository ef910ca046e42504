"""One way settings reach every client: ``Producer()``, ``AsyncProducer()``, Celery's
``register_tasks``, the worker and the CLI all load explicit arguments > ``TOKENMILL_*`` / ``REDIS_URL`` > the file
``TOKENMILL_CONFIG`` names > defaults; and the sentences a producer logs when the live workers' layout differs
from its own (producer/worker_check.py). No Redis: clients are built without connecting."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from tokenmill.producer import AsyncProducer, Producer, ProducerConfig
from tokenmill.producer.celery import register_tasks
from tokenmill.producer.config import ClientSettings
from tokenmill.producer.worker_check import SeenWorkers, every_lane, problems
from tokenmill.protocol.config import QueueConfig, RedisConfig
from tokenmill.protocol.errors import ConfigError
from tokenmill.protocol.heartbeat import Heartbeat
from tokenmill.worker.config import Settings

FILE = """
[queue]
prefix = "fromfile"
name = "filequeue"
shards = 3
num_lanes = 4
[redis]
url = "redis://file-host:6379/0"
[worker]
stale_after_s = 20.0
[engine.model]
name = "echo"
"""


@pytest.fixture
def config_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``TOKENMILL_CONFIG`` naming a deployment file; no other TOKENMILL_* variable nor REDIS_URL set."""
    for name in [*(name for name in os.environ if name.startswith("TOKENMILL_")), "REDIS_URL"]:
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "deployment.toml"
    path.write_text(FILE)
    monkeypatch.setenv("TOKENMILL_CONFIG", str(path))
    return path


def test_producer_config_load_reads_the_named_file_then_env_then_arguments(
        config_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = ProducerConfig.load()
    assert (config.queue.prefix, config.queue.name, config.queue.shards, config.queue.num_lanes) == \
        ("fromfile", "filequeue", 3, 4)
    assert config.redis.url == "redis://file-host:6379/0"
    monkeypatch.setenv("TOKENMILL_QUEUE__NUM_LANES", "5")
    monkeypatch.setenv("REDIS_URL", "redis://env-host:6379/0")
    config = ProducerConfig.load()
    assert (config.queue.num_lanes, config.redis.url, config.queue.shards) == (5, "redis://env-host:6379/0", 3)
    config = ProducerConfig.load(queue={"num_lanes": 2, "name": None}, redis={"url": "redis://arg:6379/0"})
    assert (config.queue.num_lanes, config.queue.name, config.redis.url) == (2, "filequeue", "redis://arg:6379/0")
    assert ProducerConfig.load(config_env.parent / "deployment.toml") == ProducerConfig.load(str(config_env))


def test_every_process_loads_the_file_the_env_names(config_env: Path) -> None:
    """The CLI's client settings and the worker's (and so serve's, a subclass) read the same file."""
    client = ClientSettings.load()
    worker = Settings.load(None, {"worker": {"name": "w"}})
    assert client.producer_config == ProducerConfig.load()
    assert (worker.queue, worker.redis) == (client.queue, client.redis)
    assert client.worker.stale_after_s == worker.worker.stale_after_s == 20.0


def test_a_missing_file_named_by_the_env_is_an_error_that_says_so(
        config_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_CONFIG", str(config_env.parent / "nope.toml"))
    with pytest.raises(ConfigError, match=r"nope.toml \(named by TOKENMILL_CONFIG\)"):
        ProducerConfig.load()
    with pytest.raises(ConfigError, match="TOKENMILL_CONFIG"):
        register_tasks(Celery("settings-missing", set_as_current=False))
    with pytest.raises(ConfigError, match="TOKENMILL_CONFIG"):
        AsyncProducer()


def test_producer_and_async_producer_load_the_settings_and_arguments_win(
        config_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_QUEUE__NUM_LANES", "5")
    loaded = ProducerConfig.load()
    client = redis.Redis.from_url("redis://file-host:6379/0")  # never connects: nothing is sent
    try:
        assert Producer(client=client).config == loaded
        assert AsyncProducer().config == loaded
        explicit = Producer(client=client, prefix="mine", queue="q", num_lanes=2, shards=1, result_ttl_s=60.0).config
        assert (explicit.queue.prefix, explicit.queue.name, explicit.queue.num_lanes, explicit.queue.shards,
                explicit.queue.result_ttl_s) == ("mine", "q", 2, 1, 60.0)
        assert AsyncProducer("redis://arg:6379/0", queue="q").config.redis.url == "redis://arg:6379/0"
    finally:
        client.close()


def test_register_tasks_loads_the_settings(config_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a producer config, the task feeds the queue the settings name (its producer is built lazily)."""
    seen: list[ProducerConfig] = []

    def from_config(cls: type[Producer], /, config: ProducerConfig, **kwargs: Any) -> Producer:
        seen.append(config)
        raise RuntimeError("a stand-in: no producer is built")

    monkeypatch.setattr(Producer, "from_config", classmethod(from_config))
    generate = register_tasks(Celery("settings-loaded", set_as_current=False), mode="blocking", timeout_s=1.0)
    with pytest.raises(RuntimeError, match="stand-in"):
        generate.apply(args=["hello"]).get()
    assert seen == [ProducerConfig.load()]


# --- what a producer says about the live workers (no Redis: heartbeats built here) ---

def _beat(name: str, config: ProducerConfig, *, shards: int | None = None, num_lanes: int | None = None,
          model_names: tuple[str, ...] = ("echo",)) -> Heartbeat:
    layout = config.layout
    return Heartbeat(name=name, ts=time.time(), model_names=list(model_names), prefix=layout.home.prefix,
                     queue=layout.home.queue, num_lanes=num_lanes or layout.home.num_lanes,
                     shards=shards or layout.num_shards, hash_tag=layout.home.hash_tag, cluster=layout.is_cluster)


def _config(**queue: object) -> ProducerConfig:
    return ProducerConfig(redis=RedisConfig(url="redis://x:6379/0"), queue=QueueConfig.model_validate(queue))


def test_matching_workers_raise_nothing() -> None:
    config = _config(shards=3)
    seen = SeenWorkers([_beat("w", config)], [], 0)
    assert problems(config, seen, every_lane(3)) == []
    assert problems(config, seen, {(1, "echo")}) == []
    old = Heartbeat(name="old", ts=time.time())  # an older release publishes no layout: taken as matching
    assert problems(config, SeenWorkers([old], [], 0), every_lane(3)) == []


def test_lanes_and_models_no_live_worker_reads_are_named() -> None:
    config = _config(num_lanes=3)
    seen = SeenWorkers([_beat("w", config, num_lanes=2)], [], 0)
    assert problems(config, seen, {(0, None), (1, None)}) == []
    [lanes] = problems(config, seen, {(2, None)})
    assert lanes == ("this producer writes lane 2 of queue 'default' (num_lanes = 3) but its 1 live worker reads "
                     "lanes 0..1 only: set [queue] num_lanes = 2 for this producer (TOKENMILL_QUEUE__NUM_LANES=2, "
                     "or TOKENMILL_CONFIG naming the workers' settings file)")
    [model] = problems(config, seen, {(1, "beta")})
    assert model == "no live worker serves model 'beta' on queue 'default' (served: 'echo'); its requests wait " \
                    "until one starts"


def test_a_shard_count_of_its_own_is_named_with_both_layouts() -> None:
    config = _config(prefix="tm", shards=2)
    [message] = problems(config, SeenWorkers([_beat("w", config, shards=3)], [], 0), every_lane(3))
    assert message == ("this producer writes queue 'default' over 2 shards (lanes such as {tm:default:0}:lane:1) but "
                       "its 1 live worker reads it over 3 shards (lanes such as {tm:default:0}:lane:1): set "
                       "[queue] shards = 3 for this producer (TOKENMILL_QUEUE__SHARDS=3, or TOKENMILL_CONFIG naming "
                       "the workers' settings file); producers and workers must agree on it")
