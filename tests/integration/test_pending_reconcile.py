"""A live worker's pending list is checked against what it holds: entries whose
delivery never reached it (the connection dropped after XREADGROUP ran, before the reply came)
are taken back and answered without a restart, and nothing it still holds runs twice."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.worker_helpers import enqueue, make_settings, running_worker, wait_result
from tokenmill.engine.engine import Engine
from tokenmill.protocol.keys import CONSUMER_GROUP
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.worker.dispatch import Dispatcher
from tokenmill.worker.lane_reads import READ_LANES_LUA, LaneReads
from tokenmill.worker.messages import Entry

# NOTE: a worker reads its lanes through a script (worker/lane_reads.py), a blocking read with XREADGROUP itself
_READ_COMMANDS = (b"XREADGROUP", hashlib.sha1(READ_LANES_LUA.encode()).hexdigest().upper().encode())


class ReplyCutter:
    """A TCP proxy in front of Redis that forwards everything, except that the first reply to a
    read of the lanes holding entries never reaches the client: the proxy closes that connection instead."""

    def __init__(self, upstream: dict[str, Any]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/{upstream.get('db', 0)}"
        self.num_cut = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _connect_upstream(self) -> socket.socket:
        if "path" in self._upstream:
            server = socket.socket(socket.AF_UNIX)
            server.connect(self._upstream["path"])
            return server
        return socket.create_connection((self._upstream["host"], self._upstream["port"]))

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = self._connect_upstream()
            asked = threading.Event()  # an XREADGROUP went up this connection, its reply is next
            threading.Thread(target=self._up, args=(client, server, asked), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, asked), daemon=True).start()

    @staticmethod
    def _up(client: socket.socket, server: socket.socket, asked: threading.Event) -> None:
        while data := _recv(client):
            if any(command in data.upper() for command in _READ_COMMANDS):
                asked.set()
            server.sendall(data)
        _close(client, server)

    def _down(self, server: socket.socket, client: socket.socket, asked: threading.Event) -> None:
        while data := _recv(server):
            if asked.is_set():
                asked.clear()
                # NOTE: RESP2 (an array) or RESP3 (a map); an empty read is a null or an empty one
                has_entries = data[:1] in (b"*", b"%") and not data.startswith((b"*-1", b"*0\r\n", b"%0\r\n"))
                with self._lock:
                    cut = has_entries and self.num_cut == 0
                    self.num_cut += cut
                if cut:
                    break
            try:
                client.sendall(data)
            except OSError:
                break
        _close(client, server)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


@pytest.fixture
def cutter(redis_url: str) -> Iterator[ReplyCutter]:
    proxy = ReplyCutter(redis.Redis.from_url(redis_url).connection_pool.connection_kwargs)
    yield proxy
    proxy.close()


@pytest.fixture
def additions(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often each request id was added to the engine."""
    counts: Counter[str] = Counter()
    original = Engine.add_request

    def counting(self: Engine, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 priority: int = 0, arrival_time: float | None = None, length_group: str | None = None,
                 is_handed_off: bool = False, streams: bool = True) -> None:
        counts[request_id] += 1
        original(self, request_id, prompt_token_ids, params, priority, arrival_time, length_group, is_handed_off,
                 streams)

    monkeypatch.setattr(Engine, "add_request", counting)
    return counts


@pytest.fixture
def dispatches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the reader handed on each entry (by entry id)."""
    counts: Counter[str] = Counter()
    original = Dispatcher.dispatch

    def counting(self: Dispatcher, entries: list[Entry]) -> None:
        counts.update(entry.entry_id for entry in entries)
        original(self, entries)

    monkeypatch.setattr(Dispatcher, "dispatch", counting)
    return counts


def test_entries_stranded_by_a_lost_reply_are_answered_after_the_reconnect(
        redis_client: redis.Redis, key_prefix: str, cutter: ReplyCutter, additions: Counter[str]) -> None:
    # NOTE: no periodic check in this test's time: only the reconnect can find them
    settings = make_settings(cutter.url, key_prefix, pending_check_interval_s=600.0)
    keys = settings.queue.keys
    ids = [enqueue(redis_client, keys, prompt=f"stranded {i}") for i in range(5)]
    with running_worker(settings):
        results = [wait_result(redis_client, keys, rid, timeout_s=20) for rid in ids]
    assert cutter.num_cut == 1
    assert all(result.ok for result in results)
    assert additions == Counter(ids)
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0


def test_the_periodic_check_takes_back_lost_entries_and_never_reruns_held_ones(
        redis_url: str, redis_client: redis.Redis, key_prefix: str, additions: Counter[str],
        dispatches: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    settings = make_settings(redis_url, key_prefix, model="echo:step_delay_s=0.01",
                             pending_check_interval_s=0.05)
    keys, name = settings.queue.keys, settings.worker.name
    redis_client.xgroup_create(keys.lane(0), CONSUMER_GROUP, id="0", mkstream=True)
    held = [enqueue(redis_client, keys, prompt=f"held {i}",
                    params={"max_tokens": 200, "ignore_eos": True}) for i in range(3)]
    with running_worker(settings):
        deadline = time.monotonic() + 10
        while redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        def reads_nothing_new(self: LaneReads, count: int, block_ms: int | None) -> list[Entry]:
            time.sleep(0.01)
            return []

        monkeypatch.setattr(LaneReads, "read", reads_nothing_new)
        lost = [enqueue(redis_client, keys, prompt=f"lost {i}") for i in range(5)]
        # a delivery to this worker's name that never reached it
        redis_client.xreadgroup(CONSUMER_GROUP, name, {keys.lane(0): ">"}, count=10)
        results = [wait_result(redis_client, keys, rid, timeout_s=20) for rid in [*lost, *held]]
    assert all(result.ok for result in results)
    assert set(dispatches.values()) == {1} and len(dispatches) == 8, "an entry the worker held was taken again"
    assert additions == Counter([*held, *lost])
    assert redis_client.xpending(keys.lane(0), CONSUMER_GROUP)["pending"] == 0
