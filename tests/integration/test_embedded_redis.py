"""The embedded Redis: start, status, reuse across processes, persistence, stop, ACL URLs.

Every test runs under a temporary TOKENMILL_HOME and stops its server, so the user's
cache is never touched and no server outlives the test session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tokenmill.producer import Producer, RedisConfig, RedisUnavailable, connect
from tokenmill.protocol import embedded_redis

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private TOKENMILL_HOME (short path: unix socket paths are limited to 107 bytes)."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    yield tmp_path / "redis"
    embedded_redis.stop()


def in_subprocess(code: str) -> str:
    """Run ``code`` in a fresh interpreter (same env, so the same TOKENMILL_HOME); its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


def test_data_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_HOME", raising=False)
    assert embedded_redis.data_dir() == (Path.home() / ".cache" / "tokenmill" / "redis").resolve()
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    assert embedded_redis.data_dir() == tmp_path.resolve() / "redis"
    assert embedded_redis.data_dir(tmp_path / "x") == tmp_path.resolve() / "x"


def test_lifecycle_reuse_and_persistence(home: Path) -> None:
    assert not embedded_redis.status().is_running
    first = embedded_redis.start()
    assert first.is_running and first.version and first.version.startswith("6.2")
    assert first.data_dir == home and first.socket_path.exists() and (home / "redis.conf").exists()
    assert embedded_redis.start().pid == first.pid  # idempotent in-process

    # A second process reuses the server, writes, and exits; the server outlives it.
    pid = in_subprocess("""
        import redis
        from tokenmill.protocol import embedded_redis
        status = embedded_redis.start()
        redis.Redis.from_url(status.url).set("tm:persisted", "yes")
        print(status.pid)
    """)
    assert int(pid) == first.pid
    assert embedded_redis.status().is_running

    assert embedded_redis.stop() is True
    assert not embedded_redis.status().is_running and not first.socket_path.exists()
    assert embedded_redis.stop() is False
    assert (home / "appendonly.aof").exists()

    again = embedded_redis.start()
    assert again.pid != first.pid
    client = redis.Redis.from_url(again.url)
    assert client.get("tm:persisted") == b"yes"
    client.close()


def test_concurrent_starts_share_one_server(home: Path) -> None:
    code = "from tokenmill.protocol import embedded_redis; print(embedded_redis.start().pid)"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    pids = {proc.communicate(timeout=30)[0].strip() for proc in procs}
    assert len(pids) == 1 and pids == {str(embedded_redis.status().pid)}


def test_nothing_configured_means_embedded(home: Path) -> None:
    with Producer(prefix="tm-embedded") as producer:
        request_id = producer.submit(prompt="x")
        assert producer.client.xlen(producer.keys.lane(1)) == 1
        assert request_id
    assert embedded_redis.status().is_running


def test_acl_user_and_password_in_a_unix_url(home: Path) -> None:
    status = embedded_redis.start()
    admin = redis.Redis.from_url(status.url)
    admin.acl_setuser("alice", enabled=True, passwords=["+wonderland"], keys=["*"], commands=["+@all"])
    admin.close()
    client = connect(RedisConfig(url=f"unix://alice:wonderland@{status.socket_path}"))
    assert client.acl_whoami() in ("alice", b"alice")
    client.close()
    with pytest.raises(RedisUnavailable, match="refused the credentials") as info:
        connect(RedisConfig(url=f"unix://alice:wrong@{status.socket_path}"))
    assert "wrong" not in str(info.value)


def test_start_failure_quotes_the_log(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded_redis, "server_binary", lambda: Path("/bin/false"))
    with pytest.raises(RedisUnavailable, match="did not start"):
        embedded_redis.start(timeout_s=0.3)
