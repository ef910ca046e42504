"""The one Redis connection factory of tokenmill, sync and asyncio; the worker uses it too.

Picks the server (config url > $REDIS_URL > embedded Redis), then retries with backoff,
PINGs and logs. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio

from tokenmill.producer import embedded
from tokenmill.producer.config import RedisConfig
from tokenmill.producer.errors import RedisUnavailable

logger = logging.getLogger("tokenmill.connection")

_RETRYABLE = (redis.ConnectionError, redis.TimeoutError, OSError)


def resolve_url(config: RedisConfig) -> str:
    """The URL to connect to, starting the embedded Redis when nothing is configured.

    Args:
        config: ``config.url`` wins, then the ``REDIS_URL`` environment variable.

    Returns:
        A redis://, rediss:// or unix:// URL.
    """
    url = config.url or os.environ.get("REDIS_URL")
    if url:
        RedisConfig(url=url)  # NOTE: validates an env URL exactly like a configured one
        return url
    return embedded.start(config.embedded_dir).url


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _client_kwargs(config: RedisConfig, *, probe: bool = False) -> dict[str, Any]:
    """Client options; a ``probe`` (the PING that proves the server answers) waits for no longer
    than the connect timeout, TLS handshake included (``rediss://`` to a plain port never answers
    the handshake: with the command timeout that took minutes to report)."""
    return {
        "socket_connect_timeout": config.connect_timeout_s,
        "socket_timeout": config.connect_timeout_s if probe else config.socket_timeout_s,
        "health_check_interval": config.health_check_interval_s,
    }


def _unreachable(url: str, attempts: int, last_error: Exception | None) -> RedisUnavailable:
    hint = ""
    if urlsplit(url).scheme == "rediss" and isinstance(last_error, redis.TimeoutError):
        hint = " (no answer to the TLS handshake: is this a plain Redis port? then use redis://)"
    return RedisUnavailable(f"could not reach Redis at {redact_url(url)} after {attempts} attempt(s): "
                            f"{last_error}{hint}")


def _backoff_s(config: RedisConfig, attempt: int) -> float:
    return float(min(config.retry_backoff_s * 2**attempt, config.max_backoff_s))


def _after_failed_ping(config: RedisConfig, url: str, attempt: int, exc: Exception) -> float | None:
    """What follows failed PING number ``attempt`` (from 0): the seconds to wait before the next
    one (logged), or None after the last.

    Raises:
        RedisUnavailable: the server refused the credentials (no retry can help).
    """
    if isinstance(exc, redis.AuthenticationError):
        raise RedisUnavailable(f"Redis at {redact_url(url)} refused the credentials: {exc}") from exc
    if attempt + 1 >= 1 + config.connect_retries:
        return None
    delay_s = _backoff_s(config, attempt)
    logger.warning("Redis at %s not answering (%s); retry in %.2f s", redact_url(url), exc, delay_s)
    return delay_s


def connect(config: RedisConfig | None = None) -> redis.Redis:
    """A connected (PINGed) sync client; bytes in, bytes out.

    Args:
        config: where and how to connect; None = defaults (``REDIS_URL`` or embedded).

    Returns:
        A ``redis.Redis`` with its own connection pool; the caller closes it.

    Raises:
        RedisUnavailable: no PONG after ``1 + connect_retries`` attempts, or bad credentials.
    """
    config = config or RedisConfig()
    url = resolve_url(config)
    probe = redis.Redis.from_url(url, **_client_kwargs(config, probe=True))
    attempts = 1 + config.connect_retries
    last_error: Exception | None = None
    try:
        for attempt in range(attempts):
            try:
                probe.ping()
            except _RETRYABLE as exc:
                last_error = exc
                delay_s = _after_failed_ping(config, url, attempt, exc)
                if delay_s is not None:
                    time.sleep(delay_s)
            else:
                logger.info("connected to Redis at %s", redact_url(url))
                return redis.Redis.from_url(url, **_client_kwargs(config))
    finally:
        probe.close()
    raise _unreachable(url, attempts, last_error) from last_error


async def aconnect(config: RedisConfig | None = None) -> redis.asyncio.Redis:
    """The asyncio twin of :func:`connect` (same resolution, retries and errors)."""
    config = config or RedisConfig()
    url = await asyncio.to_thread(resolve_url, config)  # may start the embedded server
    probe = redis.asyncio.Redis.from_url(url, **_client_kwargs(config, probe=True))
    attempts = 1 + config.connect_retries
    last_error: Exception | None = None
    try:
        for attempt in range(attempts):
            try:
                await probe.ping()
            except _RETRYABLE as exc:
                last_error = exc
                delay_s = _after_failed_ping(config, url, attempt, exc)
                if delay_s is not None:
                    await asyncio.sleep(delay_s)
            else:
                logger.info("connected to Redis at %s", redact_url(url))
                return redis.asyncio.Redis.from_url(url, **_client_kwargs(config))
    finally:
        await probe.aclose()
    raise _unreachable(url, attempts, last_error) from last_error
