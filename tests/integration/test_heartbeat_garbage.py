"""Any bytes in the workers hash (any producer can write there) kill no worker and break no reader:
workers started on it and running while more arrives keep serving, reclaim and trimming skip it
and say so, and ``Producer.stats`` / ``tokenmill status`` show it as undecodable."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import msgpack
import redis

from tests.worker_helpers import ROOT, enqueue, start_worker_process, wait_result
from tokenmill.producer import Producer
from tokenmill.protocol.keys import Keys


def _packed(value: object) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


GARBAGE: dict[bytes, bytes] = {
    b"evil": _packed({"ts": "x"}),
    b"not-msgpack": b"\xc1\xff\x00 not msgpack at all",
    b"not-a-map": _packed([1, 2, 3]),
    b"nan-ts": _packed({"ts": float("nan"), "state": "running"}),
    b"wrong-types": _packed({"ts": 1.0, "running": "many", "pid": [1]}),
    b"huge": _packed({"ts": "y" * (2 << 20)}),
    b"huge-bytes": b"\x00" * (2 << 20),
    b"name-\xff\xfe": _packed({"ts": None}),
}
LATER: dict[bytes, bytes] = {b"evil-later": _packed({"ts": {"nested": "x"}}), b"empty": b""}


def test_garbage_heartbeats_are_skipped_by_workers_and_readers(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    redis_client.hset(keys.workers, mapping=GARBAGE)  # type: ignore[arg-type]
    workers = [start_worker_process(redis_url, key_prefix, name) for name in ("w1", "w2")]
    try:
        assert all(wait_result(redis_client, keys, enqueue(redis_client, keys, prompt=f"before {i}"),
                               timeout_s=30).ok for i in range(10))
        redis_client.hset(keys.workers, mapping=LATER)  # type: ignore[arg-type]
        time.sleep(1.0)  # NOTE: a few heartbeat intervals: each worker's reclaim reads the hash again
        assert all(wait_result(redis_client, keys, enqueue(redis_client, keys, prompt=f"after {i}"),
                               timeout_s=30).ok for i in range(10))
        assert all(process.poll() is None for process in workers), "a worker died"
        with Producer(redis_url, prefix=key_prefix) as producer:
            stats = producer.stats()
        status = subprocess.run([sys.executable, "-m", "tokenmill.cli", "--redis-url", redis_url,
                                 "--prefix", key_prefix, "status", "--json"],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        table = subprocess.run([sys.executable, "-m", "tokenmill.cli", "--redis-url", redis_url, "--prefix", key_prefix,
                                "status"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        for process in workers:
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=20) for process in workers]
    logs = [process.stderr.read().decode() if process.stderr else "" for process in workers]
    assert codes == [0, 0], logs
    assert set(stats["workers"]) == {"w1", "w2"} and stats["num_live_workers"] == 2
    garbage = {name.decode(errors="backslashreplace") for name in [*GARBAGE, *LATER]}
    assert {name for name, info in stats["stale_workers"].items() if info == {"undecodable": True}} == garbage
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["num_live_workers"] == 2
    assert table.returncode == 0 and "w1" in table.stdout and "evil" in table.stdout, table.stderr
    for log in logs:  # skipped, and said so (once per name)
        assert log.count("skipping a value in the workers hash that is not a heartbeat") == len(garbage), log
