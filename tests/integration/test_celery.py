"""Celery tasks end to end: a real Celery worker (threads pool) and a real tokenmill worker on
the session's Redis; broker and result backend keys live under the test's own key prefix.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

pytest.importorskip("celery")

from celery import Celery, chain, chord
from celery.contrib.testing.worker import start_worker

from tests.worker_helpers import FAST_WORKER, make_settings, running_worker
from tokenmill.producer import Producer, ProducerConfig, QueueConfig, RedisConfig
from tokenmill.producer.celery import JSON_ONLY, register_tasks
from tokenmill.producer.errors import JobFailed
from tokenmill.worker.config import Settings

# celery's redis backend calls redis-py's deprecated setex on every state change.
pytestmark = pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")

FAST_POLL: dict[str, Any] = {"poll_interval_s": 0.05, "max_poll_interval_s": 0.2, "timeout_s": 30.0}


def broker_url(redis_url: str) -> str:
    """kombu spells a unix socket ``redis+socket://``."""
    return "redis+socket://" + redis_url.removeprefix("unix://") if redis_url.startswith("unix://") else redis_url


def make_celery(redis_url: str, prefix: str, shards: int = 1, **task_options: Any) -> tuple[Celery, Any]:
    """A JSON-only app (broker + backend keys under ``prefix:celery:``) and its generate task."""
    url = broker_url(redis_url)
    app = Celery(f"tm-test-{prefix}", broker=url, backend=url, set_as_current=False)
    app.conf.update(JSON_ONLY)
    app.conf.update(broker_transport_options={"global_keyprefix": f"{prefix}:celery:"},
                    result_backend_transport_options={"global_keyprefix": f"{prefix}:celery:"},
                    result_expires=600, worker_hijack_root_logger=False)

    def prepare(topic: str) -> dict[str, Any]:
        return {"prompt": f"Q: {topic}", "metadata": {"topic": topic}}

    def postprocess(result: dict[str, Any]) -> dict[str, Any]:
        return {"text": result["text"], "topic": result["metadata"]["topic"],
                "num_tokens": result["usage"]["completion_tokens"]}

    def collect(results: list[dict[str, Any]]) -> list[str]:
        return [r["text"] for r in results]

    for fn in (prepare, postprocess, collect):
        app.task(name=f"test.{fn.__name__}", shared=False)(fn)
    config = ProducerConfig(redis=RedisConfig(url=redis_url), queue=QueueConfig(prefix=prefix, shards=shards))
    generate = register_tasks(app, config, **{**FAST_POLL, **task_options})
    return app, generate


@contextmanager
def celery_worker(app: Celery) -> Iterator[None]:
    with start_worker(app, pool="threads", concurrency=8, perform_ping_check=False, shutdown_timeout=20):
        yield
    app.close()


def lane_entries(client: redis.Redis, prefix: str) -> int:
    """Entries ever added to the lanes (answered entries are deleted, so XLEN would not do)."""
    total = 0
    for k in range(3):
        lane = f"{prefix}:default:lane:{k}"
        if not client.exists(lane):
            continue
        info = client.xinfo_stream(lane)
        if "entries-added" not in info:  # Redis < 7: count the submit markers instead
            return len(list(client.scan_iter(match=f"{prefix}:default:sub:*")))
        total += int(info["entries-added"])
    return total


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("celery-llama") / "llama")


def test_chain_through_a_real_model(redis_url: str, redis_client: redis.Redis, key_prefix: str,
                                    tiny_llama: Path) -> None:
    app, generate = make_celery(redis_url, key_prefix)
    prepare, postprocess = app.tasks["test.prepare"], app.tasks["test.postprocess"]
    settings = make_settings(redis_url, key_prefix, model=str(tiny_llama), engine={
        "model": {"device": "cpu"}, "cache": {"kv_cache_memory": "8MiB", "swap_space": 0}})
    with running_worker(settings), celery_worker(app):
        out = chain(prepare.s("sea"), generate.s(max_tokens=8), postprocess.s()).apply_async().get(timeout=60)
        with Producer(redis_url, prefix=key_prefix) as producer:  # greedy: the same prompt, the same text
            # NOTE: generate sends a plain prompt as a user message (chat by default)
            chat = [{"role": "user", "content": "Q: sea"}]
            direct = producer.result(producer.submit(messages=chat, max_tokens=8), timeout=30)
    assert out == {"text": direct.text, "topic": "sea", "num_tokens": len(direct.token_ids)}
    assert 1 <= out["num_tokens"] <= 8
    assert lane_entries(redis_client, key_prefix) == 2  # re-checks never resubmitted


def test_structured_output_through_a_task(redis_url: str, key_prefix: str, tiny_llama: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "additionalProperties": False, "required": ["mood", "n"],
              "properties": {"mood": {"enum": ["happy", "sad"]}, "n": {"type": "integer", "minimum": 0}}}
    app, generate = make_celery(redis_url, key_prefix)
    settings = make_settings(redis_url, key_prefix, model=str(tiny_llama), engine={
        "model": {"device": "cpu"}, "cache": {"kv_cache_memory": "8MiB", "swap_space": 0}})
    response_format = {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}
    with running_worker(settings), celery_worker(app):
        out = generate.delay("How are you?", max_tokens=40, response_format=response_format,
                             logprobs=1).get(timeout=60)
    jsonschema.validate(json.loads(out["text"]), schema)
    assert len(out["token_logprobs"]) == len(out["token_ids"])


def test_chord_of_twenty_and_result_as_next_prompt(redis_url: str, redis_client: redis.Redis,
                                                   key_prefix: str) -> None:
    app, generate = make_celery(redis_url, key_prefix)
    collect = app.tasks["test.collect"]
    settings = make_settings(redis_url, key_prefix, model="echo:step_delay_s=0.005")
    with running_worker(settings), celery_worker(app):
        texts = chord(generate.s(f"prompt {i}", max_tokens=64) for i in range(20))(collect.s()).get(timeout=60)
        relayed = chain(generate.s({"messages": [{"role": "user", "content": "hi"}]}, max_tokens=64),
                        generate.s(max_tokens=64)).apply_async().get(timeout=30)
        parallel = generate.delay("twice", n=2, max_tokens=8).get(timeout=30)
    assert texts == [f"prompt {i}" for i in range(20)]
    assert [(s["index"], s["text"]) for s in parallel["samples"]] == [(0, "twice"), (1, "twice")]
    assert relayed["status"] == "ok" and relayed["text"]  # the echo of the first result's text
    assert lane_entries(redis_client, key_prefix) == 23


@pytest.mark.parametrize("mode", ["recheck", "blocking"])
def test_llm_error_fails_the_task_with_the_remote_reason(redis_url: str, key_prefix: str, mode: str) -> None:
    app, generate = make_celery(redis_url, key_prefix, mode=mode)
    settings = make_settings(redis_url, key_prefix, engine={"model": {"max_model_len": 16}})
    with running_worker(settings), celery_worker(app):
        async_result = generate.delay("x" * 100, max_tokens=4)
        with pytest.raises(JobFailed) as failed:
            async_result.get(timeout=30)
        assert async_result.state == "FAILURE"
        assert generate.delay("fine", max_tokens=4).get(timeout=30)["text"] == "fine"
    assert failed.value.code == "prompt_too_long"
    assert "max_model_len is 16" in str(failed.value)


@pytest.mark.parametrize("mode", ["recheck", "blocking"])
def test_on_a_sharded_queue_tasks_of_one_template_share_its_shard(redis_url: str, key_prefix: str,
                                                                  mode: str) -> None:
    """A task's request id is derived from its task id, moved to the shard of its prompt's prefix (tasks of one
    template meet the same prefix caches) the same way on every re-check, so the task finds its result."""
    app, generate = make_celery(redis_url, key_prefix, shards=3, mode=mode)
    settings = Settings.load(None, {"queue": {"prefix": key_prefix, "shards": 3}, "redis": {"url": redis_url},
                                    "worker": {**FAST_WORKER, "name": f"w-{uuid.uuid4().hex[:6]}"},
                                    "engine": {"model": {"name": "echo:step_delay_s=0.005"}}})
    template = "Classify the sentiment of this customer message. " * 12
    with running_worker(settings), celery_worker(app):
        results = [generate.delay({"prompt": template + f"message {i}", "raw": True}, max_tokens=8).get(timeout=30)
                   for i in range(6)]
    layout = QueueConfig(prefix=key_prefix, shards=3).layout(False)
    assert all(r["status"] == "ok" and r["id"].startswith("celery-") for r in results)
    assert len({layout.shard_of(r["id"]) for r in results}) == 1
