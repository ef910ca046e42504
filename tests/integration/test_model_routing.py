"""Model routing (docs/design.md, "Redis keys"): a request naming a model waits in that model's lanes,
which only workers serving it read, so two models on one queue answer every request; stats, reclaim
and dead-letter requeue know the model lanes."""

from __future__ import annotations

import time

import redis
from typer.testing import CliRunner

from tests.worker_helpers import announce, serving_models
from tokenmill.cli.app import app
from tokenmill.producer import Producer, dead_letters
from tokenmill.protocol.keys import CONSUMER_GROUP, Keys
from tokenmill.protocol.schema import GenerationRequest, encode_request

MODELS = ("alpha", "beta")


def test_two_models_on_one_queue_answer_every_request(redis_url: str, key_prefix: str) -> None:
    with serving_models(redis_url, key_prefix, *MODELS) as worker_of, \
            Producer(redis_url, prefix=key_prefix) as producer:
        asked = {producer.submit(prompt=f"request {i}", model=MODELS[i % 2], max_tokens=16): MODELS[i % 2]
                 for i in range(40)}
        results = producer.wait_all(list(asked), timeout=30)
    assert [r.status for r in results] == ["ok"] * 40, [r.error for r in results if not r.ok]
    assert [(r.model, r.worker) for r in results] == [(asked[r.id], worker_of[asked[r.id]]) for r in results]


def test_stats_and_locate_count_the_model_lanes(producer: Producer, keys: Keys, redis_client: redis.Redis) -> None:
    """No worker yet: the producers registered the models, so their lanes are found."""
    alpha = [producer.submit(prompt="a", model="alpha", priority=p) for p in ("high", "normal", "normal")]
    shared = producer.submit(prompt="s")
    [first_submit] = producer.submit_once([{"prompt": "o", "model": "org/beta:1", "request_id": "once-1"}])
    assert first_submit > 0 and redis_client.xlen(keys.lane(1, "org/beta:1")) == 1
    stats = producer.stats()
    assert stats["models"] == ["alpha", "org/beta:1"] and stats["depth"] == 5
    depth_of = {(lane["lane"], lane["model"]): lane["depth"] for lane in stats["lanes"]}
    assert depth_of == {(0, None): 0, (1, None): 1, (2, None): 0, (0, "alpha"): 1, (1, "alpha"): 2, (2, "alpha"): 0,
                        (0, "org/beta:1"): 0, (1, "org/beta:1"): 1, (2, "org/beta:1"): 0}
    assert {lane["stream"] for lane in stats["lanes"] if lane["model"] == "alpha"} == {
        keys.lane(k, "alpha") for k in range(3)}
    queued = [*alpha, shared, "once-1"]
    assert producer.locate([*queued, "nope"]) == {**dict.fromkeys(queued, "queued"), "nope": "unknown"}


def test_a_dead_workers_model_lane_entries_go_to_a_worker_serving_that_model(
        redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix)
    stream = keys.lane(0, "alpha")
    redis_client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
    with Producer(redis_url, prefix=key_prefix) as producer:
        request_id = producer.submit(prompt="orphan", model="alpha", priority="high")
        redis_client.xreadgroup(CONSUMER_GROUP, "ghost", {stream: ">"}, count=1)  # never beats: dead once idle
        with serving_models(redis_url, key_prefix, "beta"):
            time.sleep(1.5)  # three times stale_after_s: beta's reclaimer looked many times
            ghost_ids = [p["message_id"] for p in redis_client.xpending_range(stream, CONSUMER_GROUP, "-", "+", 10,
                                                                              consumername="ghost")]
            assert len(ghost_ids) == 1 and producer.get(request_id) is None, "a worker of another model took it"
        with serving_models(redis_url, key_prefix, "alpha") as worker_of:
            result = producer.result(request_id, timeout=10)
    assert (result.status, result.text, result.worker, result.model) == ("ok", "orphan", worker_of["alpha"], "alpha")
    assert redis_client.xpending(stream, CONSUMER_GROUP)["pending"] == 0


def test_a_dead_letter_of_a_model_lane_is_requeued_to_that_lane(redis_url: str, redis_client: redis.Redis,
                                                                 key_prefix: str) -> None:
    keys = Keys(key_prefix)
    request = GenerationRequest(id="dead-m", prompt="revived", priority=1, model="alpha")
    redis_client.xadd(keys.dead, {"reason": "max_deliveries: delivered 6 times", "stream": keys.lane(1, "alpha"),
                                  "entry_id": "1-0", **encode_request(request)})  # type: ignore[dict-item]
    [letter] = dead_letters.read(redis_client, keys)
    new_id = dead_letters.requeue(redis_client, keys, letter)
    assert [eid.decode() for eid, _ in redis_client.xrange(keys.lane(1, "alpha"))] == [new_id]
    assert redis_client.smembers(keys.models) == {b"alpha"} and redis_client.xlen(keys.lane(1)) == 0
    with serving_models(redis_url, key_prefix, "alpha") as worker_of, \
            Producer(redis_url, prefix=key_prefix) as producer:
        result = producer.result("dead-m", timeout=10)
    assert (result.status, result.worker) == ("ok", worker_of["alpha"])


def test_submit_warns_when_no_live_worker_serves_its_model(redis_url: str, redis_client: redis.Redis,
                                                           key_prefix: str) -> None:
    announce(redis_client, Keys(key_prefix), "alive", "alpha")
    submit = ["--redis-url", redis_url, "--prefix", key_prefix, "submit", "hi", "--no-wait", "--model"]
    served, elsewhere = (CliRunner().invoke(app, [*submit, model]) for model in ("alpha", "beta"))
    assert (served.exit_code, served.stderr) == (0, "")
    assert (elsewhere.exit_code, elsewhere.stderr) == (0, f"warning: no live worker serves model 'beta' on queue "
                                                          f"{key_prefix}:default; the request waits until one starts\n")
    assert redis_client.xlen(Keys(key_prefix).lane(1, "beta")) == 1
