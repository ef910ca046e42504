"""The OpenAI Files + Batch workflow against ``tokenmill serve`` with the real openai client and a
real echo worker: upload, create, poll to ``completed``, download in OpenAI's output shape; a running
batch's predicted ETA (the object's ``tokenmill`` extension); cancel a running batch; a batch whose
server died is finished by another."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis.asyncio

from tests.serve_helpers import running_server
from tests.worker_helpers import make_settings, running_worker
from tokenmill.producer.bulk import pipeline
from tokenmill.protocol.keys import Keys
from tokenmill.serve import batch_runner
from tokenmill.serve.batch_store import BatchStore
from tokenmill.serve.guard import ANONYMOUS

NUM_LINES = 20


def _batch_input(num_lines: int = NUM_LINES, max_tokens: int = 16) -> bytes:
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "echo", "messages": [{"role": "user", "content": f"question {i}"}],
                       "max_tokens": max_tokens, "presence_penalty": 0, "logprobs": False}}
             for i in range(num_lines)]
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


def _wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 30.0) -> openai.types.Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.05)


@pytest.fixture
def base_url(redis_url: str, key_prefix: str) -> Iterator[str]:
    with running_server(redis_url, key_prefix) as url:
        yield url


def test_a_batch_runs_to_completed_in_openai_shape(base_url: str, redis_url: str, key_prefix: str) -> None:
    with running_worker(make_settings(redis_url, key_prefix)), openai.OpenAI(base_url=base_url, api_key="x") as client:
        uploaded = client.files.create(file=("questions.jsonl", _batch_input()), purpose="batch")
        assert client.files.retrieve(uploaded.id).bytes == len(_batch_input())
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"run": "test"})
        assert batch.status == "validating" and batch.metadata == {"run": "test"}
        done = _wait_for(client, batch.id, {"completed", "failed", "cancelled", "expired"})
        assert done.status == "completed" and done.error_file_id is None and done.output_file_id is not None
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (20, 20, 0)
        lines = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
        assert [b.id for b in client.batches.list().data] == [batch.id]
        assert client.files.delete(uploaded.id).deleted
    assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(NUM_LINES))
    usages = [line["response"]["body"]["usage"] for line in lines]
    assert done.model == "echo" and done.usage is not None
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usages) > 0
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usages) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    for line in lines:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == "echo"
        number = line["custom_id"].removeprefix("req-")
        assert body["choices"][0]["message"]["content"] == f"question {number}"
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_a_completions_batch_names_the_serving_model_and_reports_bad_lines(base_url: str, redis_url: str,
                                                                          key_prefix: str) -> None:
    """``n`` gives n choices, logprobs come with token strings, the output names the served model (not
    the name the line used), and lines that cannot run land in the error file, each with its reason."""
    def line(custom_id: str, url: str = "/v1/completions", **body: object) -> dict[str, object]:
        return {"custom_id": custom_id, "method": "POST", "url": url,
                "body": {"model": "echo", "prompt": custom_id, "max_tokens": 8, **body}}

    chat = {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}}
    lines = [line("two", n=2, logprobs=1), line("unnamed", model=None), line("zero", n=0),
             line("elsewhere", model="gpt-4o"), chat]
    data = "\n".join(json.dumps(item) for item in lines).encode()
    with running_worker(make_settings(redis_url, key_prefix, served_model_name="house-echo")), \
            openai.OpenAI(base_url=base_url, api_key="x") as client:
        uploaded = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        done = _wait_for(client, batch.id, {"completed", "failed", "cancelled", "expired"})
        assert done.status == "completed" and done.output_file_id is not None and done.error_file_id is not None
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 2, 3)
        output, errors = ({r["custom_id"]: r for r in map(json.loads, client.files.content(file_id).text.splitlines())}
                          for file_id in (done.output_file_id, done.error_file_id))
    assert sorted(output) == ["two", "unnamed"] and sorted(errors) == ["chat", "elsewhere", "zero"]
    assert done.model == "house-echo", "the served name the results give, not the lines' name"
    assert done.usage is not None and done.usage.output_tokens == 2 * len("two.") + len("unnamed."), "each with EOS"
    two = output["two"]["response"]["body"]
    assert two["object"] == "text_completion" and two["model"] == "house-echo"
    assert [(c["index"], c["text"]) for c in two["choices"]] == [(0, "two"), (1, "two")]
    assert all(c["logprobs"]["tokens"] == ["t", "w", "o", "</s>"] for c in two["choices"])
    assert two["usage"]["completion_tokens"] == 8
    assert output["unnamed"]["response"]["body"]["model"] == "house-echo"
    assert errors["zero"]["error"]["code"] == "validation" and "n" in errors["zero"]["error"]["message"]
    assert "endpoint" in errors["chat"]["error"]["message"]
    refused = errors["elsewhere"]["response"]
    assert refused["status_code"] == 404 and refused["body"]["error"]["code"] == "model_not_found"


def test_a_running_batch_shows_its_predicted_eta(base_url: str, redis_url: str, key_prefix: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``tokenmill: {backlog_tokens, eta_s}`` beside OpenAI's fields while the batch runs (the openai client keeps it
    in ``model_extra``), null before the first prediction and once the batch is done."""
    monkeypatch.setattr(pipeline, "ETA_INTERVAL_S", 0.1)  # NOTE: the batch runs for about 2 s
    # NOTE: results land every 0.2 s, so a beat's token rate (of the results of its interval) is never 0 while it runs
    settings = make_settings(redis_url, key_prefix, model="echo:step_delay_s=0.02", heartbeat_interval_s=0.5,
                             stale_after_s=1.0,
                             engine={"scheduler": {"max_num_seqs": 2}, "speculative": {"method": "off"}})
    with running_worker(settings), openai.OpenAI(base_url=base_url, api_key="x") as client:
        uploaded = client.files.create(file=("in.jsonl", _batch_input(max_tokens=10)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert batch.model_extra == {"tokenmill": None}
        while True:
            running = client.batches.retrieve(batch.id)
            prediction: dict[str, Any] | None = (running.model_extra or {}).get("tokenmill")
            if prediction is not None and prediction["backlog_tokens"] and prediction["eta_s"]:
                break
            assert running.status in {"validating", "in_progress"}, "done before any prediction was shown"
            time.sleep(0.02)
        done = _wait_for(client, batch.id, {"completed", "failed", "cancelled", "expired"})
    assert running.status == "in_progress" and set(prediction) == {"backlog_tokens", "eta_s"}
    assert 0 < prediction["backlog_tokens"] <= NUM_LINES * 10, "at most every line's max_tokens"
    assert prediction["eta_s"] < 60
    assert done.status == "completed" and done.model_extra == {"tokenmill": None}


def test_cancel_a_running_batch(base_url: str, redis_url: str, key_prefix: str) -> None:
    # NOTE: one token per step (no speculation), so the lines take long enough to cancel some of them
    settings = make_settings(redis_url, key_prefix, model="echo:step_delay_s=0.02",
                             engine={"scheduler": {"max_num_seqs": 2}, "speculative": {"method": "off"}})
    with running_worker(settings), openai.OpenAI(base_url=base_url, api_key="x") as client:
        uploaded = client.files.create(file=("in.jsonl", _batch_input(max_tokens=10)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        running = _wait_for(client, batch.id, {"in_progress"})
        assert running.model == "echo" and running.usage is None, "the lines' model until the results are summed"
        while (client.batches.retrieve(batch.id).request_counts or running.request_counts).completed < 2:
            time.sleep(0.05)
        assert client.batches.cancel(batch.id).status == "cancelling"
        cancelled = _wait_for(client, batch.id, {"cancelled", "completed"})
        assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
        assert cancelled.request_counts is not None and 2 <= cancelled.request_counts.completed < NUM_LINES
        assert cancelled.output_file_id is not None  # what finished before the cancel
        partial = client.files.content(cancelled.output_file_id).text.splitlines()
    assert len(partial) == cancelled.request_counts.completed


def test_a_batch_whose_server_died_is_finished_by_another(redis_url: str, key_prefix: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """...even when the other's first look for orphans meets a Redis error (the next look retries)."""
    monkeypatch.setattr(batch_runner, "ORPHAN_AFTER_S", 1.0)
    monkeypatch.setattr(batch_runner, "ORPHAN_SCAN_S", 0.2)
    with running_server(redis_url, key_prefix) as url, openai.OpenAI(base_url=url, api_key="x") as client:
        uploaded = client.files.create(file=("in.jsonl", _batch_input(num_lines=5)), purpose="batch")

    async def orphan() -> str:  # what a server that died right after accepting the batch leaves
        client = redis.asyncio.Redis.from_url(redis_url)
        batch = await BatchStore(client, Keys(prefix=key_prefix), 3600).create(
            uploaded.id, "/v1/chat/completions", "24h", None, account=ANONYMOUS, owner="dead-server")
        await BatchStore(client, Keys(prefix=key_prefix), 3600).update(batch["id"], {"owner_ts": 0.0})
        await client.aclose()
        return str(batch["id"])

    batch_id = asyncio.run(orphan())
    failures = [redis.ConnectionError("injected: Redis went away for a moment")]
    ids = BatchStore.ids

    async def flaky_ids(self: BatchStore, **kwargs: Any) -> list[str]:
        if failures:
            raise failures.pop()
        return await ids(self, **kwargs)

    monkeypatch.setattr(BatchStore, "ids", flaky_ids)
    with running_server(redis_url, key_prefix) as other_url, running_worker(make_settings(redis_url, key_prefix)), \
            openai.OpenAI(base_url=other_url, api_key="x") as client:
        done = _wait_for(client, batch_id, {"completed", "failed"})
    assert not failures, "the first look failed"
    assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 5
