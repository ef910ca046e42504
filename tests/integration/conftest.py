"""Integration fixtures: an async producer on the session's real Redis (the keys and the producer of a test's
prefix are tests/conftest.py's), a local Redis Cluster, and a simulated worker that writes results exactly as
the wire contract says (result key + one done push + reply stream).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from tests.cluster_helpers import LocalCluster, start_cluster
from tokenmill.producer import AsyncProducer
from tokenmill.protocol.keys import DONE_TTL_S, Keys
from tokenmill.protocol.schema import SCHEMA_VERSION, GenerationResult, encode_result


class FakeWorker:
    """Writes results and token streams the way the real worker does, from any thread."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._threads: list[threading.Thread] = []

    def finish(self, request_id: str, text: str = "done", *, status: str = "ok",
               reply_to: str | None = None, notify: bool = True) -> GenerationResult:
        """Store the result, push the done list once, XADD to ``reply_to``: one MULTI."""
        if status == "ok":
            result = GenerationResult(id=request_id, status="ok", text=text, finish_reason="stop")
        else:
            result = GenerationResult.failure(
                request_id, "internal", f"boom: {text}", status=status  # type: ignore[arg-type]
            )
        payload = encode_result(result)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.result(request_id), payload, ex=600)
        if notify:
            pipe.lpush(self.keys.done(request_id), b"1")
            pipe.expire(self.keys.done(request_id), DONE_TTL_S)
        if reply_to:
            pipe.xadd(reply_to, {"d": payload, "v": SCHEMA_VERSION})
        pipe.execute()
        return result

    def emit(self, request_id: str, chunks: list[bytes], *, end: bool = True) -> None:
        for chunk in chunks:
            self.client.xadd(self.keys.tokens(request_id), {"t": chunk})
        if end:
            self.client.xadd(self.keys.tokens(request_id), {"end": b"1", "status": b"ok"})

    def later(self, delay_s: float, fn: object, *args: object, **kwargs: object) -> None:
        """Run ``fn(*args, **kwargs)`` on a thread after ``delay_s`` (joined at teardown)."""
        def run() -> None:
            time.sleep(delay_s)
            fn(*args, **kwargs)  # type: ignore[operator]

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=10)


@pytest.fixture
async def aproducer(redis_url: str, key_prefix: str) -> AsyncIterator[AsyncProducer]:
    async with AsyncProducer(redis_url, prefix=key_prefix) as client:
        yield client


@pytest.fixture
def fake_worker(redis_url: str, keys: Keys) -> Iterator[FakeWorker]:
    client = redis.Redis.from_url(redis_url)
    fake = FakeWorker(client, keys)
    yield fake
    fake.join()
    client.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A Redis Cluster of 3 primaries with one replica each on free loopback ports (tests/cluster_helpers.py),
    for the whole session; tests use their own key prefixes (and may fail primaries over or move slots)."""
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def producer_warnings() -> Iterator[list[str]]:
    """The warnings producers log (``tokenmill.producer``: producer/worker_check.py) during the test, in order."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    logger, handler = logging.getLogger("tokenmill.producer"), Collect()
    # NOTE: an earlier test may have set up a worker's or serve's logging (the "tokenmill" level, say ERROR), or
    # a dictConfig may have disabled existing loggers: this logger is made to emit warnings for this test.
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.WARNING)
    logger.disabled = False
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)
    logger.setLevel(level)
    logger.disabled = disabled
