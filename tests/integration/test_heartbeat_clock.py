"""Worker liveness is judged by the Redis server's clock, never a worker's nor a reader's.

A worker whose clock ran an hour fast never went stale after it died (its entries stayed pending, ``tokenmill
status`` showed it live at a negative age, a forged far-future ``ts`` stayed live forever); one whose clock was
slow had its live entries reclaimed and run twice. Now the server stamps each beat as it is written and every
reader (reclaim, status and stats, serve, bulk ETAs) judges it against the server's time read with the hash.
"""

from __future__ import annotations

import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import redis
import redis.asyncio
from typer.testing import CliRunner

from tests.worker_helpers import enqueue, start_worker_process, wait_result, wait_until
from tokenmill.cli.app import app
from tokenmill.producer import AsyncProducer, Producer
from tokenmill.protocol.heartbeat import (
    FUTURE_TOLERANCE_S,
    STAMP_LUA,
    Heartbeat,
    decode_heartbeat,
    encode_heartbeat,
)
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys
from tokenmill.serve.live_models import LiveModels
from tokenmill.worker.heartbeat import FORGET_AFTER_S, forget_old, read_workers, write_heartbeat
from tokenmill.worker.reclaim import Reclaimer

HOUR_S = 3600.0
_real_time = time.time


@pytest.fixture
def skew_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Shift this process's ``time.time()`` by the seconds given (a writer or reader with its clock off)."""
    def skew(seconds: float) -> None:
        monkeypatch.setattr(time, "time", lambda: _real_time() + seconds)
    return skew


def _server_now(client: redis.Redis) -> float:
    seconds, microseconds = client.time()
    return seconds + microseconds / 1_000_000


def _stored(client: redis.Redis, keys: Keys, name: str) -> Heartbeat:
    beat = decode_heartbeat(name, client.hget(keys.workers, name))
    assert beat is not None
    return beat


def _forge(client: redis.Redis, keys: Keys, name: str, ts: float) -> None:
    """A beat written with a plain HSET, ``ts`` whatever the writer says (anyone can write to the hash)."""
    client.hset(keys.workers, name, encode_heartbeat(Heartbeat(name=name, ts=ts, model_names=[name])))


@pytest.mark.parametrize("skew_s", [HOUR_S, -HOUR_S], ids=["an-hour-fast", "an-hour-slow"])
def test_a_beat_is_stamped_with_the_servers_time_and_judged_by_it(
        skew_s: float, skew_clock: Callable[[float], None], redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    skew_clock(skew_s)  # the writer's clock, and the reader's below: neither counts
    before = _server_now(redis_client)
    stamped = write_heartbeat(redis_client, keys, Heartbeat(name="w", ts=time.time()))
    after = _server_now(redis_client)
    stored = _stored(redis_client, keys, "w")
    assert before <= stored.ts <= after and stamped == pytest.approx(stored.ts, abs=1e-6)
    beats, now_s = read_workers(redis_client, keys)
    assert after <= now_s <= _server_now(redis_client)
    assert 0.0 <= beats["w"].age_s(now_s) < 5.0 and not beats["w"].is_stale(now_s, 5.0)


def _map32(entries: dict[str, int]) -> bytes:
    """A msgpack map32 (0xdf) of few entries: legal, though msgpack writes the smallest header itself."""
    packed: bytes = msgpack.packb(entries)
    return b"\xdf" + struct.pack(">I", len(entries)) + packed[1:]


@pytest.mark.parametrize("body", [msgpack.packb({}), msgpack.packb({f"k{i}": i for i in range(14)}),
                                  msgpack.packb({f"k{i}": i for i in range(15)}),  # fixmap 15 -> map16 16
                                  msgpack.packb({f"k{i}": i for i in range(20)}), _map32({"k0": 0, "k1": 1})],
                         ids=["empty", "fixmap-14", "fixmap-15", "map16", "map32"])
def test_the_stamp_script_adds_the_servers_ts_to_any_msgpack_map(
        body: bytes, redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    redis_client.eval(STAMP_LUA, 1, keys.workers, "w", body)
    stored = msgpack.unpackb(redis_client.hget(keys.workers, "w"))
    assert stored == {**msgpack.unpackb(body), "ts": pytest.approx(_server_now(redis_client), abs=5.0)}
    for not_a_map in (b"", msgpack.packb([1, 2]), b"\xc1"):
        with pytest.raises(redis.ResponseError, match="a heartbeat is a msgpack map"):
            redis_client.eval(STAMP_LUA, 1, keys.workers, "w", not_a_map)


def test_a_beat_from_the_future_is_stale_and_never_negative() -> None:
    now_s = 1_000_000.0
    assert Heartbeat(name="w", ts=now_s + FUTURE_TOLERANCE_S / 2).age_s(now_s) == 0.0  # the tolerance
    for ahead_s in (2 * FUTURE_TOLERANCE_S, HOUR_S, 1e9):
        beat = Heartbeat(name="w", ts=now_s + ahead_s)
        assert beat.is_from_future(now_s) and beat.age_s(now_s) > 0 and beat.is_stale(now_s, 1e6)
    assert Heartbeat(name="w", ts=now_s - 3.0).age_s(now_s) == 3.0


def test_the_reclaimer_judges_by_the_servers_clock(
        skew_clock: Callable[[float], None], redis_client: redis.Redis, key_prefix: str) -> None:
    """An hour-slow worker that beats keeps its entry; a forged far-future beat loses its entry; the
    reclaimer's own clock (an hour fast here) plays no part."""
    keys = Keys(key_prefix)
    lane = keys.lanes_for([])[0]
    redis_client.xgroup_create(lane.stream, CONSUMER_GROUP, id="0", mkstream=True)
    for consumer in ("slow", "forged"):
        enqueue(redis_client, keys, prompt=consumer)
        redis_client.xreadgroup(CONSUMER_GROUP, consumer, {lane.stream: ">"}, count=1)
    _forge(redis_client, keys, "forged", _server_now(redis_client) + HOUR_S)
    skew_clock(-HOUR_S)
    write_heartbeat(redis_client, keys, Heartbeat(name="slow", ts=time.time()))
    skew_clock(HOUR_S)
    claimed = Reclaimer(redis_client, keys, [lane], "rescuer", stale_after_s=5.0, min_idle_ms=0).reclaim(10)
    assert len(claimed) == 1
    owners = {c["name"].decode(): c["pending"] for c in redis_client.xpending(lane.stream, CONSUMER_GROUP)["consumers"]}
    assert owners == {"slow": 1, "rescuer": 1}, owners


def test_status_and_stats_show_server_ages_and_forged_beats_as_gone(
        skew_clock: Callable[[float], None], redis_client: redis.Redis, redis_url: str, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    skew_clock(HOUR_S)
    write_heartbeat(redis_client, keys, Heartbeat(name="fast-clock", ts=time.time()))
    skew_clock(-HOUR_S)  # the machine running status is an hour slow: its clock does not count either
    write_heartbeat(redis_client, keys, Heartbeat(name="slow-clock", ts=time.time()))
    _forge(redis_client, keys, "forged", _server_now(redis_client) + 10 * 365 * 86_400)
    with Producer(redis_url, prefix=key_prefix) as producer:
        stats = producer.stats(stale_after_s=5.0)
    assert set(stats["workers"]) == {"fast-clock", "slow-clock"} and set(stats["stale_workers"]) == {"forged"}
    assert all(0.0 <= info["age_s"] < 5.0 for info in stats["workers"].values())
    assert stats["stale_workers"]["forged"]["age_s"] is None
    outcome = CliRunner().invoke(app, ["--redis-url", redis_url, "--prefix", key_prefix, "status",
                                       "--stale-after", "5"], env={"COLUMNS": "200"})
    assert outcome.exit_code == 0, outcome.output
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:]]
            for line in outcome.stdout.splitlines() if line.startswith("│ ")}
    assert rows["forged"][0] == "running (gone)" and rows["forged"][2] == "future", outcome.stdout
    for name in ("fast-clock", "slow-clock"):
        assert rows[name][0] == "running (live)" and 0.0 <= float(rows[name][2]) < 5.0, outcome.stdout


async def test_serve_and_the_async_producer_judge_by_the_servers_clock(
        skew_clock: Callable[[float], None], redis_client: redis.Redis, redis_url: str, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    skew_clock(-HOUR_S)
    write_heartbeat(redis_client, keys, Heartbeat(name="slow-clock", ts=time.time(), model_names=["slow-clock"]))
    _forge(redis_client, keys, "forged", _server_now(redis_client) + HOUR_S)
    skew_clock(HOUR_S)  # serve's own clock
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        assert await LiveModels(client, keys, stale_after_s=5.0).names() == frozenset({"slow-clock"})
    finally:
        await client.aclose()
    async with AsyncProducer(redis_url, prefix=key_prefix) as producer:
        stats = await producer.stats(stale_after_s=5.0)
    assert set(stats["workers"]) == {"slow-clock"} and set(stats["stale_workers"]) == {"forged"}


def test_forget_old_counts_by_the_servers_clock(redis_client: redis.Redis, key_prefix: str) -> None:
    """A day's silence (or a day ahead) by the server's clock forgets a beat; an hour ahead stays visible, stale."""
    keys = Keys(key_prefix)
    now_s = _server_now(redis_client)
    for name, ts in {"fresh": now_s, "hour-ahead": now_s + HOUR_S, "years-ahead": now_s + 10 * FORGET_AFTER_S,
                     "silent": now_s - 2 * FORGET_AFTER_S}.items():
        _forge(redis_client, keys, name, ts)
    assert sorted(forget_old(redis_client, keys)) == ["silent", "years-ahead"]
    assert set(read_workers(redis_client, keys).beats) == {"fresh", "hour-ahead"}


# End to end: real worker processes, one with its clock an hour off. Short intervals so it runs in seconds.
STALE_AFTER_S = 2.0
FAST_BEATS = {"TOKENMILL_WORKER__STALE_AFTER_S": str(STALE_AFTER_S), "TOKENMILL_WORKER__HEARTBEAT_INTERVAL_S": "0.25"}
NUM_REQUESTS = 8
# What a loaded 2-core machine may add to the stale interval before the rescuer's next reclaim has run.
RECLAIM_SLACK_S = 10.0


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes the test starts; any still running when it ends (passed or failed) is killed."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _owners(client: redis.Redis, stream: str) -> dict[str, int]:
    """Pending entries by consumer."""
    summary = client.xpending(stream, CONSUMER_GROUP)
    return {consumer["name"].decode(): int(consumer["pending"]) for consumer in summary["consumers"] or []}


@pytest.mark.parametrize("skew_s", [HOUR_S, -HOUR_S], ids=["an-hour-fast", "an-hour-slow"])
def test_a_skewed_worker_keeps_its_entries_while_alive_and_loses_them_once_killed(
        skew_s: float, redis_url: str, redis_client: redis.Redis, key_prefix: str,
        processes: list[subprocess.Popen[bytes]]) -> None:
    """The issue's end-to-end check: a worker with a clock an hour slow is never reclaimed while alive
    (its entries were taken and run twice), and one an hour fast, SIGKILLed, has its entries reclaimed
    within the stale interval (they stayed pending for the hour)."""
    keys = Keys(key_prefix)
    stream = keys.lane(0)
    redis_client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    ids = [enqueue(redis_client, keys, prompt=f"skewed {i}") for i in range(NUM_REQUESTS)]
    # NOTE: 60 s a step: the skewed worker holds every entry, beating, until it is killed
    skewed = start_worker_process(redis_url, key_prefix, "skewed", "--max-waiting", "16", model="echo:step_delay_s=60",
                                  env=FAST_BEATS, clock_skew_s=skew_s)
    processes.append(skewed)
    wait_until(lambda: _owners(redis_client, stream) == {"skewed": NUM_REQUESTS}, timeout_s=120)
    rescuer = start_worker_process(redis_url, key_prefix, "rescuer", env=FAST_BEATS)
    processes.append(rescuer)
    wait_until(lambda: bool(redis_client.hexists(keys.workers, "rescuer")), timeout_s=120)
    watch_until = time.monotonic() + 3 * STALE_AFTER_S  # the rescuer's reclaim looks every 0.25 s meanwhile
    while time.monotonic() < watch_until:
        assert _owners(redis_client, stream) == {"skewed": NUM_REQUESTS}, "a live worker's entries were reclaimed"
        time.sleep(0.1)
    assert skewed.poll() is None and rescuer.poll() is None
    skewed.send_signal(signal.SIGKILL)
    skewed.wait(timeout=30)
    killed_s = time.monotonic()
    wait_until(lambda: _owners(redis_client, stream).get("skewed", 0) == 0, timeout_s=STALE_AFTER_S + RECLAIM_SLACK_S)
    reclaimed_after_s = time.monotonic() - killed_s
    results = [wait_result(redis_client, keys, request_id, timeout_s=60) for request_id in ids]
    assert all(result.ok and result.worker == "rescuer" for result in results), results
    assert reclaimed_after_s >= STALE_AFTER_S - 0.5, f"reclaimed {reclaimed_after_s:.1f} s after the kill: too soon"
