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

from tokenmill.producer import Producer, RedisConfig, RedisUnavailable, connect, embedded

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private TOKENMILL_HOME (short path: unix socket paths are limited to 107 bytes)."""
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    monkeypatch.delenv("REDIS_URL", raising=False)
    yield tmp_path / "redis"
    embedded.stop()


def in_subprocess(code: str) -> str:
    """Run ``code`` in a fresh interpreter (same env, so the same TOKENMILL_HOME); its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=dict(os.environ),
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.strip()


def test_data_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_HOME", raising=False)
    assert embedded.data_dir() == (Path.home() / ".cache" / "tokenmill" / "redis").resolve()
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    assert embedded.data_dir() == tmp_path.resolve() / "redis"
    assert embedded.data_dir(tmp_path / "x") == tmp_path.resolve() / "x"


def test_lifecycle_reuse_and_persistence(home: Path) -> None:
    assert not embedded.status().is_running
    first = embedded.start()
    assert first.is_running and first.version and first.version.startswith("6.2")
    assert first.data_dir == home and first.socket_path.exists() and (home / "redis.conf").exists()
    assert embedded.start().pid == first.pid  # idempotent in-process

    # A second process reuses the server, writes, and exits; the server outlives it.
    pid = in_subprocess("""
        import redis
        from tokenmill.producer import embedded
        status = embedded.start()
        redis.Redis.from_url(status.url).set("tm:persisted", "yes")
        print(status.pid)
    """)
    assert int(pid) == first.pid
    assert embedded.status().is_running

    assert embedded.stop() is True
    assert not embedded.status().is_running and not first.socket_path.exists()
    assert embedded.stop() is False
    assert (home / "appendonly.aof").exists()

    again = embedded.start()
    assert again.pid != first.pid
    client = redis.Redis.from_url(again.url)
    assert client.get("tm:persisted") == b"yes"
    client.close()


def test_concurrent_starts_share_one_server(home: Path) -> None:
    code = "from tokenmill.producer import embedded; print(embedded.start().pid)"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    pids = {proc.communicate(timeout=30)[0].strip() for proc in procs}
    assert len(pids) == 1 and pids == {str(embedded.status().pid)}


def test_nothing_configured_means_embedded(home: Path) -> None:
    with Producer(prefix="tm-embedded") as producer:
        request_id = producer.submit(prompt="x")
        assert producer.client.xlen(producer.keys.lane(1)) == 1
        assert request_id
    assert embedded.status().is_running


def test_acl_user_and_password_in_a_unix_url(home: Path) -> None:
    status = embedded.start()
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
    monkeypatch.setattr(embedded, "server_binary", lambda: Path("/bin/false"))
    with pytest.raises(RedisUnavailable, match="did not start"):
        embedded.start(timeout_s=0.3)
