"""The dashboard at scale: 1 million queued requests, 100 workers' heartbeats, an hour of rate counters and 10,000
dead letters in a private Redis. The overview renders in under 300 ms with a fixed number of Redis commands
(counted by the server: ``INFO commandstats``), and never reads a range of a lane."""

from __future__ import annotations

import statistics
import time
from typing import Any

import redis
import requests

from tests.serve_helpers import running_server
from tokenmill.protocol.heartbeat import Heartbeat, encode_heartbeat
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.rates import RATE_TTL_S, field, minute_of
from tokenmill.protocol.schema import GenerationRequest, encode_request

NUM_QUEUED = 1_000_000
NUM_WORKERS = 100
NUM_DEAD = 10_000
KEY = "load-key"
# XADD n copies of one entry server-side (a pipeline of a million XADDs takes a minute on two cores).
FILL_LUA = """
for i = 1, tonumber(ARGV[1]) do redis.call('XADD', KEYS[1], '*', 'd', ARGV[2], 'v', '1') end
return redis.call('XLEN', KEYS[1])
"""


def _commands(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}


def _fill(client: redis.Redis, keys: Keys) -> None:
    request = GenerationRequest(prompt="summarize this document " * 8, priority=1)
    payload = encode_request(request)["d"]
    fill = client.register_script(FILL_LUA)
    for _ in range(NUM_QUEUED // 100_000):
        fill(keys=[keys.lane(1)], args=[100_000, payload])
    client.xgroup_create(keys.lane(1), "workers", id="0", mkstream=True)
    client.xreadgroup("workers", "w-000", {keys.lane(1): ">"}, count=200)  # some running
    now = time.time()
    pipe = client.pipeline(transaction=False)
    for n in range(NUM_WORKERS):
        beat = Heartbeat(name=f"w-{n:03d}", ts=now - (n % 7), model="llama", served_model_name="llama",
                         running=8, waiting=4, tokens_per_s=950.0, backlog_tokens=4000.0, mean_length=300.0)
        pipe.hset(keys.workers, beat.name, encode_heartbeat(beat))
    for minute in range(minute_of(now) - 60, minute_of(now)):  # the full minutes of the hour
        pipe.hset(keys.rates(minute), mapping={field("o", keys.lane(1)): 3000, field("t", keys.lane(1)): 900_000,
                                                field("a", keys.lane(1)): f"{minute * 60_000}:{minute * 4000}"})
        pipe.expire(keys.rates(minute), RATE_TTL_S)
    dead = {"reason": "max_deliveries: delivered 6 times", "stream": keys.lane(1), "entry_id": "1-0", "d": payload,
            "v": "1"}
    for _ in range(NUM_DEAD):
        pipe.xadd(keys.dead, dead)  # type: ignore[arg-type]
    pipe.execute()
    assert client.xlen(keys.lane(1)) == NUM_QUEUED and client.xlen(keys.dead) == NUM_DEAD


def test_the_overview_stays_fast_and_bounded_at_a_million_queued(private_redis_url: str) -> None:
    client = redis.Redis.from_url(private_redis_url)
    keys = Keys(prefix="load")
    _fill(client, keys)
    with running_server(private_redis_url, "load", api_keys=[KEY]) as base, requests.Session() as http:
        http.headers["Authorization"] = f"Bearer {KEY}"
        url = base.removesuffix("/v1") + "/dashboard"
        assert http.get(url).status_code == 200  # warm: templates compiled, connections open
        time.sleep(0.5)  # NOTE: the sampler's first round (then every 20 s) is done: it is not counted below
        before = _commands(client)
        response = http.get(url)
        after = _commands(client)
        timings = []
        for _ in range(5):
            start = time.perf_counter()
            page = http.get(url)
            timings.append(time.perf_counter() - start)
            assert page.status_code == 200
        overview = http.get(url + "/api/overview").json()
        dead_start = time.perf_counter()
        dead = http.get(url + "/api/dead").json()
        dead_s = time.perf_counter() - dead_start
    used = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
    used.pop("info", None)
    total = sum(used.values())
    print(f"\noverview: best {min(timings) * 1000:.0f} ms, median {statistics.median(timings) * 1000:.0f} ms, "
          f"{total} Redis commands {used}; dead letters page {dead_s * 1000:.0f} ms")
    assert response.status_code == 200 and "1000000" in response.text
    assert overview["totals"]["depth"] == NUM_QUEUED and overview["totals"]["dead"] == NUM_DEAD
    assert len(overview["workers"]) == NUM_WORKERS and overview["totals"]["live_workers"] == NUM_WORKERS
    assert 25 < overview["totals"]["out_per_s"] <= 50.0  # 3000 a minute (the current one: none yet)
    assert min(timings) < 0.3, timings
    assert total <= 120, used  # fixed: ~5 per lane (6 request lanes here) + one per minute of the hour + a few
    assert not {"xrange", "xrevrange", "xread", "scan", "keys"} & set(used), used
    assert len(dead["letters"]) == 50 and dead["total"] == NUM_DEAD and dead_s < 1.0
