"""Bulk jobs end to end against a real Redis and an in-process echo worker: every input format,
bad records, retries, results recovered from Redis, deterministic ids, the predicted ETA."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.integration.bulk_helpers import NUM_ITEMS, item_ids, read_jsonl, write_input
from tests.integration.conftest import FakeWorker
from tests.worker_helpers import FAST_WORKER, make_settings, running_worker
from tokenmill.producer import Producer, bulk
from tokenmill.producer.bulk import BulkJob, BulkOptions
from tokenmill.producer.bulk.options import job_id_of, request_id_of
from tokenmill.producer.config import ProducerConfig
from tokenmill.producer.eta import Eta
from tokenmill.protocol.config import QueueConfig, RedisConfig
from tokenmill.protocol.heartbeat import Heartbeat, JobBacklog, encode_heartbeat
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import GenerationResult, Usage, decode_request, encode_result
from tokenmill.worker.config import Settings

SUFFIXES = {"jsonl": "jsonl", "openai": "jsonl", "csv": "csv", "parquet": "parquet"}


@pytest.fixture
def echo_worker(redis_url: str, key_prefix: str) -> Iterator[None]:
    with running_worker(make_settings(redis_url, key_prefix)):
        yield


@pytest.mark.parametrize("fmt", ["jsonl", "openai", "csv", "parquet"])
def test_every_format_completes_in_its_output_shape(fmt: str, tmp_path: Path, producer: Producer,
                                                    echo_worker: None) -> None:
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    source = write_input(tmp_path / f"in.{SUFFIXES[fmt]}", fmt)
    out = tmp_path / "out.jsonl"
    summary = bulk.run(source, out, producer=producer, max_in_flight=32)
    assert summary.is_complete and summary.num_ok == NUM_ITEMS and summary.num_invalid == 0
    assert summary.completion_tokens == 4 * NUM_ITEMS
    lines = read_jsonl(out)
    assert sorted(item_ids(lines)) == sorted(f"q{i}" for i in range(NUM_ITEMS))
    assert read_jsonl(summary.errors_path) == []
    if fmt == "openai":
        line = next(r for r in lines if r["custom_id"] == "q7")
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "echo"
        assert body["choices"][0]["message"]["content"] == "item"
        assert body["usage"]["completion_tokens"] == 4
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 4
    else:
        line = next(r for r in lines if r["id"] == "q7")
        assert line["status"] == "ok" and line["text"] == "item" and line["index"] == 7
        assert line["usage"]["completion_tokens"] == 4 and line["finish_reason"] == "length"
        assert (line.get("metadata") == {"topic": "t"}) == (fmt == "csv")


def test_plain_lines_ask_for_samples_and_logprobs(tmp_path: Path, redis_url: str, key_prefix: str,
                                                  producer: Producer) -> None:
    """``n`` and ``logprobs`` in plain JSONL reach the worker and come back in the line (never dropped);
    an ``n`` the wire refuses is a per-line error. The line names the served model."""
    source = tmp_path / "in.jsonl"
    records = [{"id": "two", "prompt": "hey", "n": 2, "logprobs": 0, "max_tokens": 8},
               {"id": "nested", "prompt": "hey", "params": {"n": 2}, "model": "echo"},
               {"id": "many", "prompt": "hey", "n": 99}]
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    with running_worker(make_settings(redis_url, key_prefix, served_model_name="house-echo")):
        summary = bulk.run(source, tmp_path / "out.jsonl", producer=producer, raw=True)
    assert summary.num_ok == 2 and summary.num_invalid == 1
    lines = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    for line in lines.values():
        assert line["model"] == "house-echo" and line["text"] == "hey"
        assert [(s["index"], s["text"]) for s in line["samples"]] == [(0, "hey"), (1, "hey")]
        assert line["usage"]["completion_tokens"] == 8  # two samples of "hey", each ending with EOS
    assert [t["token"] for t in lines["two"]["token_logprobs"]] == ["h", "e", "y", "</s>"]
    assert [t["token"] for t in lines["two"]["samples"][1]["token_logprobs"]] == ["h", "e", "y", "</s>"]
    [many] = read_jsonl(summary.errors_path)
    assert many["id"] == "many" and "params.n" in many["error"]["message"]


def test_plain_prompts_are_user_messages_unless_raw(tmp_path: Path, producer: Producer, echo_worker: None) -> None:
    """The echo model answers chat with the messages' contents, one per line: the system message shows."""
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "hey", "max_tokens": 32}) + "\n")
    bulk.run(source, tmp_path / "chat.jsonl", producer=producer, system="Be brief.")
    bulk.run(source, tmp_path / "raw.jsonl", producer=producer, raw=True)
    assert [r["text"] for r in read_jsonl(tmp_path / "chat.jsonl")] == ["Be brief.\nhey"]
    assert [r["text"] for r in read_jsonl(tmp_path / "raw.jsonl")] == ["hey"]


def test_bad_records_go_to_the_errors_file_with_line_numbers(tmp_path: Path, producer: Producer,
                                                             echo_worker: None) -> None:
    lines = [
        {"id": "ok1", "prompt": "fine"},
        "this is not json",
        {"id": "neg", "prompt": "x", "temperature": -1},
        {"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        {"id": "typo", "prompt": "x", "max_tokns": 3},
        {"id": "ok1", "prompt": "duplicate"},
        {"prompt": "no id: the line number is the id"},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    summary = bulk.run(source, tmp_path / "out.jsonl", producer=producer)
    assert summary.num_ok == 2 and summary.num_invalid == 5 and summary.is_complete
    assert sorted(item_ids(read_jsonl(tmp_path / "out.jsonl"))) == ["7", "ok1"]
    errors = {r["line"]: r for r in read_jsonl(summary.errors_path)}
    assert sorted(errors) == [2, 3, 4, 5, 6]
    assert "invalid JSON" in errors[2]["error"]["message"]
    assert "temperature" in errors[3]["error"]["message"]
    assert "exactly one of" in errors[4]["error"]["message"]
    assert "max_tokns" in errors[5]["error"]["message"]
    assert "duplicate id" in errors[6]["error"]["message"]
    assert all(r["error"]["code"] == "validation" for r in errors.values())


def test_missing_input_and_missing_column_are_clear(tmp_path: Path, producer: Producer) -> None:
    with pytest.raises(bulk.BulkInputError, match="does not exist"):
        bulk.run(tmp_path / "nope.jsonl", tmp_path / "out.jsonl", producer=producer)
    source = tmp_path / "in.csv"
    source.write_text("id,text\n1,hello\n")
    with pytest.raises(bulk.BulkInputError, match="no prompt column 'prompt'"):
        bulk.run(source, tmp_path / "out.jsonl", producer=producer)


def _flaky_worker(client: redis.Redis, keys: Keys, stop: threading.Event) -> None:
    """Answers attempt 0 of every request with a retryable error; later attempts ok, except ids 'doomed'."""
    fake, last = FakeWorker(client, keys), "0"
    lane = keys.lane(2)
    while not stop.is_set():
        reply = client.xread({lane: last}, count=100, block=100)
        for entry_id, fields in reply[0][1] if reply else []:
            last = entry_id
            request = decode_request(fields)
            is_doomed = request.metadata.get("doomed") or request.id.endswith("-0")
            fake.finish(request.id, "ok after retry", status="error" if is_doomed else "ok", reply_to=request.reply_to)


def test_retryable_failures_are_retried_with_new_ids_then_reported(tmp_path: Path, redis_url: str,
                                                                   producer: Producer, keys: Keys) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n"
                      + json.dumps({"id": "b", "prompt": "y", "metadata": {"doomed": True}}) + "\n")
    client, stop = redis.Redis.from_url(redis_url), threading.Event()
    thread = threading.Thread(target=_flaky_worker, args=(client, keys, stop), daemon=True)
    thread.start()
    try:
        summary = bulk.run(source, tmp_path / "out.jsonl", producer=producer, retries=2)
    finally:
        stop.set()
        thread.join(5)
        client.close()
    assert summary.num_ok == 1 and summary.status_counts["error"] == 1
    assert summary.num_submitted == 2 + 1 + 2 and summary.num_retried == 3
    [ok] = read_jsonl(tmp_path / "out.jsonl")
    assert ok["id"] == "a" and ok["text"] == "ok after retry"
    [failed] = read_jsonl(summary.errors_path)
    assert failed["id"] == "b" and failed["attempts"] == 3 and failed["error"]["code"] == "internal"
    assert failed["line"] == 2


def test_results_left_in_redis_are_picked_up_not_regenerated(tmp_path: Path, producer: Producer,
                                                             fake_worker: FakeWorker, echo_worker: None) -> None:
    source = write_input(tmp_path / "in.jsonl", "jsonl", num_items=20)
    out = tmp_path / "out.jsonl"
    job = job_id_of(out)
    for i in range(5):  # NOTE: as if a killed run's requests finished while it was dead
        result = GenerationResult(id=request_id_of(job, f"q{i}", 0), status="ok", text="from before",
                                  usage=Usage(completion_tokens=100))
        fake_worker.client.set(fake_worker.keys.result(result.id), encode_result(result))
    summary = bulk.run(source, out, producer=producer)
    assert summary.num_recovered == 5 and summary.num_submitted == 15 and summary.num_ok == 20
    assert (summary.recovered_tokens, summary.completion_tokens) == (500, 15 * 4), "rates count new tokens only"
    texts = {r["id"]: r["text"] for r in read_jsonl(out)}
    assert [texts[f"q{i}"] for i in range(5)] == ["from before"] * 5
    assert texts["q5"] == "item"


def test_rerun_of_a_finished_job_does_nothing_and_reply_stream_is_deleted(
        tmp_path: Path, producer: Producer, echo_worker: None, redis_client: redis.Redis) -> None:
    source = write_input(tmp_path / "in.jsonl", "jsonl", num_items=10)
    out = tmp_path / "out.jsonl"
    first = bulk.run(source, out, producer=producer)
    assert first.num_ok == 10
    assert not redis_client.exists(f"{producer.keys.base}:bulk:{job_id_of(out)}")
    with out.open("a") as handle:
        handle.write('{"id": "q3", "sta')  # a torn last line, as a kill mid-write leaves it
    second = bulk.run(source, out, producer=producer)
    assert second.num_skipped == 10 and second.num_submitted == 0 and second.is_complete
    assert sorted(item_ids(read_jsonl(out))) == sorted(f"q{i}" for i in range(10))


def test_a_job_predicts_its_eta_from_the_workers_heartbeats(tmp_path: Path, producer: Producer,
                                                            redis_client: redis.Redis, echo_worker: None) -> None:
    """What the progress bar and a batch object show: the job's rows in the workers' engines (its reply stream in
    their heartbeats), plus its other unanswered rows at the workers' predicted mean length, at the fleet's rate;
    nothing left once the run is done."""
    source = write_input(tmp_path / "in.jsonl", "jsonl", num_items=10)
    job = BulkJob(producer, source, tmp_path / "out.jsonl", BulkOptions(), track_eta=True)
    assert job.eta is None
    beat = Heartbeat(name="predicting", ts=time.time(), tokens_per_s=100.0,
                     jobs={job.reply_stream: JobBacklog(num_requests=4, backlog_tokens=400.0, mean_length=50.0)})
    redis_client.hset(producer.keys.workers, beat.name, encode_heartbeat(beat))  # beside the idle echo worker's
    job.summary.num_total = 10  # NOTE: what run() counts first
    job._renew_eta()
    assert job.eta == Eta(400 + (10 - 4) * 50, 100.0, 7.0)
    assert job.run().num_ok == 10
    assert job.eta == Eta(0.0, 0.0, 0.0)


def test_request_ids_are_deterministic_per_output_and_attempt(tmp_path: Path) -> None:
    job = job_id_of(tmp_path / "out.jsonl")
    assert job == job_id_of(tmp_path / "." / "out.jsonl")
    assert job != job_id_of(tmp_path / "other.jsonl")
    first = request_id_of(job, "q 1", 0)
    assert first == request_id_of(job, "q 1", 0) != request_id_of(job, "q 1", 1)
    assert " " not in first and len(first) < 64
    GenerationResult(id=first, status="ok")  # a valid wire id


def test_on_a_sharded_queue_rows_go_to_their_prompt_s_shard_and_a_rerun_finds_them(
        tmp_path: Path, redis_url: str, key_prefix: str, redis_client: redis.Redis) -> None:
    """Rows of one template land on one shard (their prompt prefix's: one set of prefix caches), under ids derived
    from the rows' deterministic ids; a rerun that lost its output derives the same ids and recovers every result
    from Redis instead of generating it again."""
    templates = ["Translate this product review into French. " * 15, "Extract every date from this memo. " * 15]
    rows = [{"id": f"q{i}", "prompt": templates[i % 2] + f"row {i}", "max_tokens": 4} for i in range(12)]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    out = tmp_path / "out.jsonl"
    config = ProducerConfig(redis=RedisConfig(url=redis_url), queue=QueueConfig(prefix=key_prefix, shards=3))
    settings = Settings.load(None, {"queue": {"prefix": key_prefix, "shards": 3}, "redis": {"url": redis_url},
                                    "worker": {**FAST_WORKER, "name": f"w-{uuid.uuid4().hex[:6]}"},
                                    "engine": {"model": {"name": "echo"}}})
    with Producer.from_config(config) as producer, running_worker(settings):
        first = bulk.run(source, out, producer=producer)
        assert first.num_ok == 12
        layout, job = producer.layout, job_id_of(out)
        shard_of_row = {}
        for i in range(12):
            base = request_id_of(job, f"q{i}", 0)
            found = [request_id for request_id in [base, *(f"{base}.{n}" for n in range(1, 200))]
                     if redis_client.exists(layout.for_id(request_id).result(request_id))]
            assert len(found) == 1, found
            shard_of_row[i] = layout.shard_of(found[0])
        assert len({shard_of_row[i] for i in range(0, 12, 2)}) == 1
        assert len({shard_of_row[i] for i in range(1, 12, 2)}) == 1
        out.unlink()
        second = bulk.run(source, out, producer=producer)
    assert second.num_recovered == 12 and second.num_submitted == 0 and second.num_ok == 12
    assert sorted(item_ids(read_jsonl(out))) == sorted(f"q{i}" for i in range(12))
