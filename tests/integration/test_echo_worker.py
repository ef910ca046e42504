"""A worker serving ``echo`` runs the production engine: stop strings,
stop token ids and ``min_tokens`` are honoured through Redis, an urgent request preempts a running
one in the real scheduler, and the worker process loads no torch."""

from __future__ import annotations

import subprocess
import sys

import redis

from tests.worker_helpers import ROOT, enqueue, make_settings, running_worker, wait_result
from tokenmill.engine.core.request import PreemptionCause
from tokenmill.engine.engine import Engine
from tokenmill.producer.client import Producer
from tokenmill.protocol.schema import decode_result

SLOW = "echo:step_delay_s=0.01"


def test_stop_strings_stop_ids_and_min_tokens_are_honoured(redis_url: str, redis_client: redis.Redis,
                                                            key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix)
    with running_worker(settings), Producer(client=redis_client, prefix=key_prefix) as producer:
        stopped = producer.submit(prompt="say stop here", stop=["stop"])
        stop_id = producer.submit(prompt="abcd", stop_token_ids=[ord("c")])
        at_least = producer.submit(prompt="xy", min_tokens=5, max_tokens=10)
        results = [producer.result(rid, timeout=5) for rid in (stopped, stop_id, at_least)]
    assert [(r.status, r.finish_reason, r.text) for r in results] == [
        ("ok", "stop", "say "), ("ok", "stop", "ab"), ("ok", "stop", "xyxyx")]
    assert results[2].usage.completion_tokens == 6, "five echoed bytes, then EOS once min_tokens was reached"


def test_an_urgent_request_preempts_a_running_one(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, model=SLOW, engine={"scheduler": {"max_num_seqs": 1}})
    keys = settings.queue.keys
    reply = keys.reply("order")
    engine = Engine.from_config(settings.engine)
    low_prompt = "a long, unhurried request that will be preempted"
    with running_worker(settings, engine=engine), Producer(client=redis_client, prefix=key_prefix) as producer:
        low = producer.submit(prompt=low_prompt, priority="low", stream_tokens=True, reply_to=reply)
        next(iter(producer.stream(low, timeout=5)))  # running: the only sequence the engine may run
        high = producer.submit(prompt="urgent", priority="high", reply_to=reply)
        results = {rid: producer.result(rid, timeout=10) for rid in (low, high)}
    assert [decode_result(fields[b"d"]).id for _, fields in redis_client.xrange(reply)] == [high, low]
    assert results[high].text == "urgent" and results[low].text == low_prompt, "the preempted one resumed whole"
    assert engine.stats().counters.cause_to_num_preemptions[PreemptionCause.PRIORITY] >= 1


def test_a_worker_serving_echo_loads_no_torch(redis_url: str, redis_client: redis.Redis, key_prefix: str) -> None:
    keys = make_settings(redis_url, key_prefix).queue.keys
    rid = enqueue(redis_client, keys, prompt="no torch here")
    sections = {"queue": {"prefix": key_prefix}, "redis": {"url": redis_url}, "engine": {"model": {"name": "echo"}}}
    code = ("import sys\n"
            "from tokenmill.worker.config import Settings\n"
            "from tokenmill.worker.runtime import Worker\n"
            f"exit_code = Worker(Settings.load(None, {sections!r}), handle_signals=False, burst=True).run()\n"
            "print(exit_code, sorted({'torch', 'transformers'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0 []", out.stderr
    assert wait_result(redis_client, keys, rid).text == "no torch here"
