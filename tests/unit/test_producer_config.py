"""Producer-side config and request building: validation messages, no Redis involved."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tokenmill.producer import ProducerConfig, RedisConfig, SchemaError
from tokenmill.producer.config import ClientSettings
from tokenmill.producer.result_waits import Deadline, rotate
from tokenmill.producer.submit_options import build_request
from tokenmill.protocol.config import MAX_BLOCK_S
from tokenmill.protocol.connection import redact_url, resolve_url
from tokenmill.protocol.keys import Keys


def test_defaults() -> None:
    config = ProducerConfig()
    queue = config.queue
    assert (queue.prefix, queue.name, queue.num_lanes, config.submit_chunk_size) == ("tokenmill", "default", 3, 500)
    assert config.redis.url is None and config.keys == Keys()
    assert config.redis.socket_timeout_s is not None and config.redis.socket_timeout_s > MAX_BLOCK_S


@pytest.mark.parametrize("url", ["redis://localhost:6379/0", "rediss://user:pw@cache.example.com:6380/1",
                                 "unix:///run/redis.sock", "unix://user:pw@/tmp/r.sock?db=2"])
def test_accepted_urls(url: str) -> None:
    assert RedisConfig(url=url).url == url


@pytest.mark.parametrize(("url", "match"), [
    ("http://localhost", "url scheme must be one of redis://, rediss://, unix://"),
    ("localhost:6379", "url scheme"),
    ("unix://", "needs a socket path"),
    ("redis://", "needs a host"),
])
def test_rejected_urls(url: str, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        RedisConfig(url=url)


@pytest.mark.parametrize(("kwargs", "field", "match"), [
    ({"redis": {"urll": "redis://x"}}, "redis.urll", "Extra inputs are not permitted"),
    ({"queues": "q"}, "queues", "Extra inputs are not permitted"),
    ({"queue": {"name": "a:b"}}, "queue", "must not contain ':'"),
    ({"queue": {"name": "a b"}}, "queue.name", "whitespace"),
    ({"queue": {"prefix": ""}}, "queue.prefix", "at least 1 character"),
    ({"queue": {"num_lanes": 0}}, "queue.num_lanes", "greater than or equal to 1"),
    ({"queue": {"result_ttl_s": 0}}, "queue.result_ttl_s", "greater than 0"),
    ({"queue": {"prefix": "{tm}", "hash_tag": True}}, "queue", "must not contain '{' or '}'"),
    ({"redis": {"retry_backoff_s": 2, "max_backoff_s": 1}}, "redis", "max_backoff_s must be >= retry_backoff_s"),
    ({"redis": {"socket_timeout_s": 1}}, "redis", "socket_timeout_s must exceed"),
    ({"redis": {"connect_retries": -1}}, "redis.connect_retries", "greater than or equal to 0"),
])
def test_validation_messages_name_the_field(kwargs: dict[str, object], field: str, match: str) -> None:
    with pytest.raises(ValidationError, match=match) as info:
        ProducerConfig.model_validate(kwargs)
    locations = [".".join(str(p) for p in err["loc"]) for err in info.value.errors()]
    assert any(loc == field for loc in locations), locations


def test_configs_are_frozen() -> None:
    with pytest.raises(ValidationError, match="frozen"):
        ProducerConfig().queue.name = "other"  # type: ignore[misc]


def test_client_settings_read_a_deployment_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text('[queue]\nname = "batch"\nhash_tag = true\n[redis]\nurl = "redis://file:6379/0"\n'
                    '[worker]\nmax_waiting = 1\n[engine.model]\nname = "echo"\n')
    monkeypatch.setenv("TOKENMILL_QUEUE__NUM_LANES", "2")
    config = ClientSettings.load(path, {"queue": {"prefix": "tm"}}).producer_config
    assert config.keys == Keys("tm", "batch", 2, hash_tag=True) and config.redis.url == "redis://file:6379/0"
    path.write_text('[queue]\nnam = "typo"\n')
    with pytest.raises(ValidationError, match="queue.nam"):
        ClientSettings.load(path)


def test_socket_timeout_may_be_none() -> None:
    assert RedisConfig(socket_timeout_s=None).socket_timeout_s is None


def test_resolve_url_prefers_config_then_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://from-env:6379/0")
    assert resolve_url(RedisConfig()) == "redis://from-env:6379/0"
    assert resolve_url(RedisConfig(url="unix:///x.sock")) == "unix:///x.sock"
    monkeypatch.setenv("REDIS_URL", "http://nope")
    with pytest.raises(ValidationError, match="url scheme"):
        resolve_url(RedisConfig())


def test_redact_url() -> None:
    assert redact_url("rediss://alice:hunter2@h:6380/0") == "rediss://alice:***@h:6380/0"
    assert redact_url("redis://:pw@h/0") == "redis://:***@h/0"
    assert redact_url("redis://h:6379") == "redis://h:6379"


def test_build_request_maps_options() -> None:
    request = build_request(Keys(), {"prompt": "x", "max_tokens": 5, "seed": None, "priority": "low",
                                     "request_id": "r1", "metadata": {"a": 1}})
    assert (request.id, request.priority, request.params.max_tokens, request.params.seed) == ("r1", 2, 5, None)
    assert build_request(Keys(), {"prompt": "x"}).priority == 1  # "normal" by default


@pytest.mark.parametrize(("options", "match"), [
    ({"prompt": "x", "temperatur": 1}, "unknown submit option\\(s\\): temperatur"),
    ({"prompt": "x", "priority": "urgent"}, "priority: unknown priority 'urgent'"),
    ({"prompt": "x", "priority": 5}, "priority: priority lane 5 out of range"),
    ({"prompt": "x", "top_p": 0}, "params.top_p: Input should be greater than 0"),
    ({}, "exactly one of prompt / messages / prompt_token_ids"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
])
def test_build_request_errors(options: dict[str, object], match: str) -> None:
    with pytest.raises(SchemaError, match=match) as info:
        build_request(Keys(), options)
    assert info.value.code == "validation"


def test_deadline_and_rotation() -> None:
    assert Deadline(None).slice_s(5.0) == 5.0 and not Deadline(None).is_expired
    assert Deadline(0).is_expired and Deadline(0).slice_s(5.0) == 0.001
    assert 0 < Deadline(2.0).slice_s(1.0) <= 1.0
    ids = [str(i) for i in range(300)]
    assert rotate(ids, 0) == ids[:256]
    assert rotate(ids, 256) == ids[256:] + ids[:212]
    assert rotate(["a", "b"], 2) == ["a", "b"]
