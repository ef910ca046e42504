"""Typed, validated configuration shared by every tokenmill process (pydantic and pydantic-settings only).

Owns ``QueueConfig``, ``RedisConfig`` and ``ServeConfig`` (the ``[queue]`` / ``[redis]`` / ``[serve]``
sections of a deployment's TOML file), and ``FileSettings``: the one merge of flags (explicit arguments) > env >
file (``--config``, else ``$TOKENMILL_CONFIG``) > defaults, which the CLI, the worker, serve, ``Producer()``,
``AsyncProducer()`` and Celery's ``register_tasks`` all load through.

Why here and not in producer/: the ``[queue]`` section is the key layout every producer and worker of a queue
must agree on, and the worker's settings (worker/config.py) declare all three sections so that one deployment
file validates whole, ``[serve]`` included; the producer-side roots (``ProducerConfig``, ``ClientSettings``,
``ServeSettings``) are producer/config.py's. Never imports redis, torch, the engine, the producer or the worker.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, cast
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from typing_extensions import Self

from tokenmill.protocol.errors import ConfigError
from tokenmill.protocol.keys import DEFAULT_NUM_LANES, DEFAULT_PREFIX, DEFAULT_QUEUE, Keys
from tokenmill.protocol.shards import MAX_SHARDS, QueueLayout

URL_SCHEMES = ("redis", "rediss", "unix")
# A Redis Cluster: the node URL as redis:// / rediss://, with "+cluster" saying what it is (protocol/connection.py).
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
# NOTE: the producer never blocks in one command for longer than this, so a socket timeout
# above it can never cut a healthy BLPOP / XREAD short.
MAX_BLOCK_S = 5.0
REDIS_URL_ENV = "REDIS_URL"  # the one env name of the Redis URL (docs/design.md)
CONFIG_ENV = "TOKENMILL_CONFIG"  # the settings file read when none is named (--config, config_file)
# Env names that once set the URL: refused with a pointer, so no setting has two names.
_REFUSED_URL_ENVS = frozenset({"TOKENMILL_REDIS__URL", "TOKENMILL_REDIS_URL"})


def _no_whitespace(value: str) -> str:
    if any(ch.isspace() for ch in value):
        raise ValueError("must not contain whitespace")
    return value


Name = Annotated[str, Field(min_length=1), AfterValidator(_no_whitespace)]  # a prefix, queue or consumer name


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QueueConfig(_Frozen):
    """One queue's key layout and result lifetime: the ``[queue]`` section, shared by workers and producers."""

    prefix: Name = Field(DEFAULT_PREFIX, description="key namespace shared by workers and producers")
    name: Name = Field(DEFAULT_QUEUE, description="queue name; no ':'")
    num_lanes: int = Field(DEFAULT_NUM_LANES, ge=1, le=64, description="priority lanes; lane k runs at priority k")
    hash_tag: bool = Field(False, description="keys as {prefix:name}:... so a queue lives in one Redis Cluster slot")
    result_ttl_s: float = Field(86_400.0, gt=0, description="how long results and cancel marks live")
    # NOTE: shards > 1 on one Redis instance is allowed: it spreads the pending lists and lanes over keys (the
    # same names a cluster uses, so moving to one is a key copy), though one instance's core stays the limit.
    shards: int = Field(1, ge=1, le=MAX_SHARDS, description="streams the queue is spread over, one cluster slot "
                        "each (protocol/shards.py); every producer and worker of the queue must agree on it")
    placement: Literal["prefix", "id"] = Field(
        "prefix", description="shard of a request: by its prompt's first characters (shared prefixes meet one "
        "worker's prefix cache; ids the producer generates, and bulk's and Celery's derived ids) or by its id")
    readers_per_shard: int = Field(0, ge=0, description="live workers reading each shard, chosen by rendezvous "
                                   "hashing over the heartbeats (worker/shard_claims.py); 0 = every worker reads "
                                   "every shard")

    @model_validator(mode="after")
    def _check_keys(self) -> QueueConfig:
        _ = self.layout(is_cluster=False)  # raises ValueError with the reason
        return self

    @property
    def keys(self) -> Keys:
        """Key layout of this queue off a cluster (its queue-wide keys when sharded: :meth:`layout`)."""
        return self.layout(is_cluster=False).home

    def layout(self, is_cluster: bool) -> QueueLayout:
        """The queue's keys: its own and its shards' (hash-tagged on a cluster or with several shards)."""
        return QueueLayout.build(self.prefix, self.name, self.num_lanes, num_shards=self.shards,
                                 hash_tag=self.hash_tag, placement=self.placement, is_cluster=is_cluster)


class RedisConfig(_Frozen):
    """Where Redis is and how to reach it: ``url`` if set, else the ``REDIS_URL`` environment
    variable, else the embedded Redis under ``embedded_dir`` (see :mod:`protocol.embedded_redis`)."""

    url: str | None = Field(None, description="redis://, rediss:// (TLS) or unix:// URL; user:password@ for ACLs; "
                            "redis+cluster:// / rediss+cluster:// for a node of a Redis Cluster")
    cluster: bool = Field(False, description="the URL is a node of a Redis Cluster: connect with redis-py's "
                          "cluster client (MOVED/ASK, failover) and keep every script's keys in one slot")
    embedded_dir: Path | None = Field(None, description="data dir of the embedded Redis; "
                                      "None = $TOKENMILL_HOME/redis or ~/.cache/tokenmill/redis")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="TCP/unix connect timeout per attempt")
    socket_timeout_s: float | None = Field(default=30.0, description="read timeout of one command; None = wait forever")
    connect_retries: int = Field(default=5, ge=0, description="extra connect attempts after the first fails")
    retry_backoff_s: float = Field(default=0.2, gt=0, description="first backoff; doubles per attempt")
    max_backoff_s: float = Field(default=5.0, gt=0, description="cap of one backoff")
    health_check_interval_s: int = Field(
        default=30, ge=0, description="PING idle pooled connections this often; 0 = off")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in URL_SCHEMES + CLUSTER_SCHEMES:
            raise ValueError(f"url scheme must be one of {', '.join(s + '://' for s in URL_SCHEMES + CLUSTER_SCHEMES)}"
                             f", got {value!r}")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError("a unix:// url needs a socket path, e.g. unix:///run/redis.sock")
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError(f"url {parts.scheme}:// needs a host, e.g. {parts.scheme}://localhost:6379/0")
        return value

    @model_validator(mode="after")
    def _check(self) -> RedisConfig:
        if self.max_backoff_s < self.retry_backoff_s:
            raise ValueError("max_backoff_s must be >= retry_backoff_s")
        if self.socket_timeout_s is not None and self.socket_timeout_s <= MAX_BLOCK_S:
            raise ValueError(f"socket_timeout_s must exceed {MAX_BLOCK_S} s (the longest blocking wait) or be None")
        if self.cluster and self.url is not None and urlsplit(self.url).scheme == "unix":
            raise ValueError("cluster = true needs a redis:// or rediss:// node address (a cluster has no unix socket)")
        return self

    @property
    def is_cluster(self) -> bool:
        """Whether Redis is a cluster: ``cluster = true``, or a ``+cluster`` scheme (of ``url``, else ``REDIS_URL``)."""
        url = self.url or os.environ.get(REDIS_URL_ENV) or ""
        return self.cluster or urlsplit(url).scheme in CLUSTER_SCHEMES


SERVE_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


class ServeConfig(_Frozen):
    """The ``[serve]`` section: the OpenAI-compatible HTTP front (``tokenmill serve``)."""

    host: str = Field("127.0.0.1", min_length=1, description="address to bind; 0.0.0.0 for every interface")
    port: int = Field(8000, ge=1, le=65535, description="TCP port")
    api_keys: list[str] = Field(default_factory=list, description="accepted Bearer keys; empty = no authentication")
    admin_api_keys: list[str] = Field(default_factory=list, description="Bearer keys that may also change things "
                                      "from the dashboard (replay, discard, cancel); accepted wherever api_keys are")
    dashboard_public: bool = Field(False, description="the dashboard's pages and data need no key (changes still "
                                   "need an admin key)")
    dashboard_session_ttl_s: float = Field(12 * 3600.0, gt=0, description="a dashboard sign-in lasts this long")
    priority: str | int = Field("normal", description="lane of requests without X-Tokenmill-Priority / priority")
    batch_priority: str | int = Field("low", description="lane of /v1/batches work")
    request_timeout_s: float = Field(600.0, gt=0, description="longest wait for one request when the client "
                                     "sends no timeout; also its deadline in the queue")
    max_body_bytes: int = Field(8 << 20, ge=1024, le=512 << 20, description="largest request body of every route "
                                "but the /v1/files upload; refused (413) before it is read")
    max_upload_bytes: int = Field(100 << 20, ge=1024, le=512 << 20, description="largest /v1/files upload body "
                                  "(the file and its multipart framing); spooled to disk, refused (413) past it")
    header_timeout_s: float = Field(10.0, gt=0, description="a request's head must arrive within this of the "
                                    "connection opening or the previous response ending, else the connection closes")
    body_timeout_s: float = Field(120.0, gt=0, description="a request's whole body must arrive within this of its "
                                  "head, else 408")
    keep_alive_timeout_s: int = Field(5, ge=1, description="an idle keep-alive connection closes after this")
    max_connections: int | None = Field(None, ge=1, description="connections (or requests in progress) beyond "
                                        "this get uvicorn's plain 503; None = no cap")
    file_ttl_s: float = Field(30 * 86_400.0, gt=0, description="how long uploaded and batch output files live")
    batch_max_in_flight: int = Field(256, ge=1, le=100_000, description="requests outstanding per batch")
    batch_dir: Path | None = Field(None, description="scratch dir of running batches; default: the temp dir")
    log_level: str = Field("info", description="log level: critical, error, warning, info (the access log), debug")
    log_json: bool = Field(False, description="one JSON object per log line (else text)")
    throughput_log_s: float = Field(60.0, ge=0, description="log requests and tokens per minute this often, when "
                                    "there was traffic; 0 = never")

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        if value.lower() not in SERVE_LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(SERVE_LOG_LEVELS)}")
        return value.lower()

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _check_keys(cls, value: list[str]) -> list[str]:
        if any(not key or any(ch.isspace() for ch in key) for key in value):
            raise ValueError("api keys must be non-empty and contain no whitespace")
        return value


class FileSettings(BaseSettings):
    """Root settings of a process (subclasses declare the sections): flags > env > a TOML file >
    defaults. Env names are ``TOKENMILL_<SECTION>__<KEY>``, except the Redis URL's: ``REDIS_URL``."""

    model_config = SettingsConfigDict(env_prefix="TOKENMILL_", env_nested_delimiter="__", extra="forbid",
                                      frozen=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        refused = sorted(_REFUSED_URL_ENVS & {name.upper() for name in os.environ})
        if refused:
            raise ConfigError(
                f"{', '.join(refused)} is not read: set {REDIS_URL_ENV}, the one env name of the Redis URL")
        url = os.environ.get(REDIS_URL_ENV)
        redis_url = InitSettingsSource(settings_cls, {"redis": {"url": url}} if url else {})
        return init_settings, redis_url, env_settings, TomlConfigSettingsSource(settings_cls)

    @classmethod
    def load(cls, config_file: Path | str | None = None, overrides: Mapping[str, Any] | None = None) -> Self:
        """Merge defaults, the TOML file (``config_file``, else the one ``$TOKENMILL_CONFIG`` names, else none),
        the environment and ``overrides`` (flags: section -> {key: value}, nested like the file; None values,
        flags not given, are left out). The one loader of every process's settings.

        Raises:
            ConfigError: the file is missing or not TOML, or a refused env name is set.
            pydantic.ValidationError: a value is invalid or a key unknown (listed field by field).
        """
        named_by = ""
        if config_file is None and os.environ.get(CONFIG_ENV):
            config_file, named_by = os.environ[CONFIG_ENV], f" (named by {CONFIG_ENV})"
        config_file = Path(config_file) if config_file is not None else None
        if config_file is not None:
            try:
                tomllib.loads(config_file.read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"cannot read config file {config_file}{named_by}: {exc}") from exc
        from_file = type(cls.__name__, (cls,), {"model_config": SettingsConfigDict(toml_file=config_file)})
        return cast(Self, from_file(**_given(overrides or {})))


def _given(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without None leaves and without sections left empty."""
    pruned = {key: _given(value) if isinstance(value, Mapping) else value for key, value in values.items()}
    return {key: value for key, value in pruned.items() if value is not None and value != {}}
