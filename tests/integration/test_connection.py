"""The connection factory's failures are quick and say what is wrong."""

from __future__ import annotations

import time

import pytest

from tokenmill.protocol.config import RedisConfig
from tokenmill.protocol.connection import connect
from tokenmill.protocol.errors import RedisUnavailable


def test_tls_to_a_plain_port_fails_fast_with_a_hint(redis_url: str) -> None:
    """``rediss://`` to a plain Redis: the handshake is never answered. It used to wait the full
    command timeout per attempt (187 s by default); the probe waits the connect timeout."""
    if not redis_url.startswith("redis://"):
        pytest.skip("needs a TCP Redis")
    url = redis_url.replace("redis://", "rediss://", 1)
    started = time.monotonic()
    with pytest.raises(RedisUnavailable, match="plain Redis port"):
        connect(RedisConfig(url=url, connect_timeout_s=0.5, connect_retries=1))
    assert time.monotonic() - started < 5


def test_a_working_server_gets_the_configured_command_timeout(redis_url: str) -> None:
    client = connect(RedisConfig(url=redis_url, connect_timeout_s=0.5, socket_timeout_s=42.0))
    try:
        assert client.ping()
        assert client.connection_pool.connection_kwargs["socket_timeout"] == 42.0
    finally:
        client.close()
