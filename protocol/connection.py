"""The one Redis connection factory of tokenmill, sync and asyncio: the producer, the worker and the server reach
the wire through it.

Picks the server (config url > $REDIS_URL > embedded Redis), then retries with backoff,
PINGs and logs. With ``[redis] cluster = true`` or a ``redis+cluster://`` / ``rediss+cluster://`` URL
the client is redis-py's cluster client (it follows MOVED/ASK and refreshes its slot map after a
failover); it is typed as ``redis.Redis`` for the callers, which use only commands both serve, each
naming keys of one slot (protocol/shards.py).

One of protocol/'s two transport modules (with embedded_redis.py): the only ones that import redis. Never imports
torch, the engine, the producer or the worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.cluster
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ClusterError, RedisClusterException, TryAgainError
from redis.retry import Retry

from tokenmill.protocol import embedded_redis
from tokenmill.protocol.config import CLUSTER_SCHEMES, RedisConfig
from tokenmill.protocol.errors import RedisUnavailable

logger = logging.getLogger("tokenmill.connection")

# Everything a call of either client may raise for Redis' sake: the cluster client's own exceptions
# (a slot no node covers, no node reachable) are not RedisErrors.
REDIS_ERRORS = (redis.RedisError, RedisClusterException)
# A cluster in transition: a failover (CLUSTERDOWN, MASTERDOWN, READONLY from a demoted primary), a slot
# migration (TRYAGAIN for a multi-key command, MOVED / ASK the client did not follow), no node reachable
# for a moment. They pass on their own: retried with backoff like a lost connection.
# NOTE: redis-py strips the error code from these exceptions' messages: match the classes, not the text.
CLUSTER_TRANSIENT_ERRORS = (
    ClusterError, TryAgainError, redis.exceptions.AskError, redis.ReadOnlyError, RedisClusterException)
_RETRYABLE = (redis.ConnectionError, redis.TimeoutError, OSError, *CLUSTER_TRANSIENT_ERRORS)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` passes on its own (a lost connection, a cluster failing over or resharding)."""
    return isinstance(exc, (redis.ConnectionError, redis.TimeoutError, *CLUSTER_TRANSIENT_ERRORS))


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
    if config.cluster:
        raise RedisUnavailable("[redis] cluster = true needs a url (a node of the cluster); the embedded Redis is one "
                               "instance")
    return embedded_redis.start(config.embedded_dir).url


def node_url(url: str) -> str:
    """``url`` with a ``+cluster`` scheme as the plain one redis-py reads (``redis+cluster://`` is ``redis://``)."""
    parts = urlsplit(url)
    if parts.scheme in CLUSTER_SCHEMES:
        return urlunsplit(parts._replace(scheme=parts.scheme.removesuffix("+cluster")))
    return url


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


def _cluster_kwargs(config: RedisConfig, *, is_async: bool = False) -> dict[str, Any]:
    """The cluster client's own retry: it re-sends a command after MOVED / ASK / TRYAGAIN / CLUSTERDOWN and a
    lost node (refreshing its slot map), with our backoff, for about as long as a failover takes
    (``cluster-node-timeout`` plus an election); what outlasts it reaches our own retry loops."""
    retry_class = redis.asyncio.retry.Retry if is_async else Retry
    retry = retry_class(ExponentialWithJitterBackoff(base=config.retry_backoff_s, cap=config.max_backoff_s),
                        retries=max(3, config.connect_retries))
    return {"retry": retry, "require_full_coverage": False}


def _sync_client(url: str, config: RedisConfig, *, probe: bool = False) -> redis.Redis:
    if config.is_cluster:
        cluster = redis.cluster.RedisCluster.from_url(node_url(url), **_client_kwargs(config, probe=probe),
                                                      **_cluster_kwargs(config))
        return cast(redis.Redis, cluster)
    return redis.Redis.from_url(url, **_client_kwargs(config, probe=probe))


def _async_client(url: str, config: RedisConfig, *, probe: bool = False) -> redis.asyncio.Redis:
    if config.is_cluster:
        kwargs = {**_client_kwargs(config, probe=probe), **_cluster_kwargs(config, is_async=True)}
        kwargs.pop("health_check_interval")  # NOTE: per-node connections of the asyncio cluster client take none
        cluster = redis.asyncio.cluster.RedisCluster.from_url(node_url(url), **kwargs)
        return cast(redis.asyncio.Redis, cluster)
    return redis.asyncio.Redis.from_url(url, **_client_kwargs(config, probe=probe))


class _Pings:
    """The PINGs one connect sends before it gives up: ``1 + connect_retries`` of them, the wait after each failed
    one, and the error that ends them all; shared by :func:`connect` and :func:`aconnect`, which only send them."""

    def __init__(self, config: RedisConfig, url: str) -> None:
        self.config, self.url = config, url
        self.num_attempts = 1 + config.connect_retries
        self.last_error: Exception | None = None

    def failed(self, attempt: int, exc: Exception) -> float | None:
        """After failed PING number ``attempt`` (from 0): the seconds to wait before the next one (logged), or
        None after the last.

        Raises:
            RedisUnavailable: the server refused the credentials (no retry can help).
        """
        self.last_error = exc
        if isinstance(exc, redis.AuthenticationError):
            raise RedisUnavailable(f"Redis at {redact_url(self.url)} refused the credentials: {exc}") from exc
        if attempt + 1 >= self.num_attempts:
            return None
        delay_s = float(min(self.config.retry_backoff_s * 2**attempt, self.config.max_backoff_s))
        logger.warning("Redis at %s not answering (%s); retry in %.2f s", redact_url(self.url), exc, delay_s)
        return delay_s

    def answered(self) -> None:
        logger.info("connected to Redis at %s", redact_url(self.url))

    def unreachable(self) -> RedisUnavailable:
        """The error to raise (from :attr:`last_error`) when no PING was answered."""
        hint = ""
        if urlsplit(self.url).scheme == "rediss" and isinstance(self.last_error, redis.TimeoutError):
            hint = " (no answer to the TLS handshake: is this a plain Redis port? then use redis://)"
        return RedisUnavailable(f"could not reach Redis at {redact_url(self.url)} after {self.num_attempts} "
                                f"attempt(s): {self.last_error}{hint}")


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
    pings = _Pings(config, resolve_url(config))
    for attempt in range(pings.num_attempts):
        try:
            # NOTE: inside the loop: the cluster client reads the slot map when it is built
            probe = _sync_client(pings.url, config, probe=True)
            try:
                probe.ping()
            finally:
                probe.close()
        except _RETRYABLE as exc:
            delay_s = pings.failed(attempt, exc)
            if delay_s is not None:
                time.sleep(delay_s)
        else:
            pings.answered()
            return _sync_client(pings.url, config)
    raise pings.unreachable() from pings.last_error


async def aconnect(config: RedisConfig | None = None) -> redis.asyncio.Redis:
    """The asyncio twin of :func:`connect` (same resolution, retries and errors)."""
    config = config or RedisConfig()
    pings = _Pings(config, await asyncio.to_thread(resolve_url, config))  # may start the embedded server
    for attempt in range(pings.num_attempts):
        try:
            probe = _async_client(pings.url, config, probe=True)
            try:
                await probe.ping()
            finally:
                await probe.aclose()
        except _RETRYABLE as exc:
            delay_s = pings.failed(attempt, exc)
            if delay_s is not None:
                await asyncio.sleep(delay_s)
        else:
            pings.answered()
            return _async_client(pings.url, config)
    raise pings.unreachable() from pings.last_error
