"""Typed, validated configuration of Redis connections and producers (pydantic only).

Owns ``RedisConfig`` (shared with the worker) and ``ProducerConfig``. Never imports redis,
torch, the engine or the worker.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from producer.keys import DEFAULT_NUM_LANES, DEFAULT_PREFIX, DEFAULT_QUEUE, Keys

URL_SCHEMES = ("redis", "rediss", "unix")
# NOTE: the producer never blocks in one command for longer than this, so a socket timeout
# above it can never cut a healthy BLPOP / XREAD short.
MAX_BLOCK_S = 5.0


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RedisConfig(_Frozen):
    """Where Redis is and how to reach it.

    The server is chosen as: ``url`` if set, else the ``REDIS_URL`` environment variable,
    else the embedded Redis under ``embedded_dir`` (see :mod:`producer.embedded`).
    """

    url: str | None = Field(
        default=None, description="redis://, rediss:// (TLS) or unix:// URL; user:password@ for ACLs"
    )
    embedded_dir: Path | None = Field(default=
        None, description="data dir of the embedded Redis; None = $TOKENMILL_HOME/redis or ~/.cache/tokenmill/redis"
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, description="TCP/unix connect timeout per attempt")
    socket_timeout_s: float | None = Field(default=30.0, description="read timeout of one command; None = wait forever")
    connect_retries: int = Field(default=5, ge=0, description="extra connect attempts after the first fails")
    retry_backoff_s: float = Field(default=0.2, gt=0, description="first backoff; doubles per attempt")
    max_backoff_s: float = Field(default=5.0, gt=0, description="cap of one backoff")
    health_check_interval_s: int = Field(
        default=30, ge=0, description="PING idle pooled connections this often; 0 = off"
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in URL_SCHEMES:
            raise ValueError(f"url scheme must be one of {', '.join(s + '://' for s in URL_SCHEMES)}, got {value!r}")
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
        return self


class ProducerConfig(_Frozen):
    """Which queue a producer feeds and how it talks to it."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    prefix: str = Field(default=DEFAULT_PREFIX, min_length=1, description="key namespace shared with the workers")
    queue: str = Field(default=DEFAULT_QUEUE, min_length=1, description="queue name; no ':'")
    num_lanes: int = Field(default=DEFAULT_NUM_LANES, ge=1, le=64, description="priority lanes; must match the workers")
    result_ttl_s: float = Field(default=
        86_400.0, gt=0, description="how long results live; cancel marks older than this are trimmed"
    )
    submit_chunk_size: int = Field(default=500, ge=1, le=100_000, description="requests per pipelined round trip")

    @field_validator("prefix", "queue")
    @classmethod
    def _no_space(cls, value: str) -> str:
        if any(ch.isspace() for ch in value):
            raise ValueError("must not contain whitespace")
        return value

    @model_validator(mode="after")
    def _check_keys(self) -> ProducerConfig:
        Keys(self.prefix, self.queue, self.num_lanes)  # raises ValueError with the reason
        return self

    @property
    def keys(self) -> Keys:
        """Key layout of this queue."""
        return Keys(self.prefix, self.queue, self.num_lanes)
