"""What reaches the wire for a plain prompt, from every entry point: the user's message (after a system
message when one is given), or with ``raw`` the text as it is. The Python producers (sync and asyncio,
``submit``, ``submit_many`` and ``submit_once`` dicts), the CLI, bulk and Celery's ``generate`` agree."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from typer.testing import CliRunner

from tokenmill.cli.app import app
from tokenmill.producer import AsyncProducer, GenerationRequest, Producer, SchemaError
from tokenmill.producer.bulk import BulkJob, BulkOptions
from tokenmill.producer.celery import request_options
from tokenmill.producer.openai_compat import parse_body
from tokenmill.producer.submit_options import build_request
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import decode_request

USER_HI = [{"role": "user", "content": "Hi"}]
SYSTEM_HI = [{"role": "system", "content": "Be brief."}, *USER_HI]


def _wire(request: GenerationRequest) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(raw prompt, messages) of a request as a worker reads it."""
    messages = None if request.messages is None else [m.model_dump(exclude_none=True) for m in request.messages]
    return request.prompt, messages


def _lane(client: redis.Redis, keys: Keys, lane: int = 1) -> dict[str, tuple[str | None, Any]]:
    return {request.id: _wire(request) for request in (decode_request(fields) for _, fields in
                                                       client.xrange(keys.lane(lane)))}


def test_producer_submit_sends_a_plain_prompt_as_a_user_message(producer: Producer, redis_client: redis.Redis,
                                                                keys: Keys) -> None:
    chat = producer.submit(prompt="Hi")
    with_system = producer.submit(prompt="Hi", system="Be brief.")
    raw = producer.submit(prompt="Hi", raw=True)
    given = producer.submit(messages=USER_HI, raw=True)  # raw concerns plain prompts only
    sent = _lane(redis_client, keys)
    assert sent[chat] == (None, USER_HI)
    assert sent[with_system] == (None, SYSTEM_HI)
    assert sent[raw] == ("Hi", None)
    assert sent[given] == (None, USER_HI)


def test_submit_many_and_submit_once_dicts_read_a_prompt_as_submit_does(producer: Producer,
                                                                        redis_client: redis.Redis,
                                                                        keys: Keys) -> None:
    ids = producer.submit_many([{"prompt": "Hi"}, {"prompt": "Hi", "raw": True},
                                GenerationRequest(id="as-is", prompt="Hi", priority=1)])
    producer.submit_once([{"prompt": "Hi", "system": "Be brief.", "request_id": "once-chat"},
                          {"prompt": "Hi", "raw": True, "request_id": "once-raw"}])
    sent = _lane(redis_client, keys)
    assert [sent[i] for i in ids] == [(None, USER_HI), ("Hi", None), ("Hi", None)]  # a request object: the wire's
    assert (sent["once-chat"], sent["once-raw"]) == ((None, SYSTEM_HI), ("Hi", None))


@pytest.mark.parametrize(("options", "match"), [
    ({"prompt": "Hi", "raw": True, "system": "x"}, "system: goes with a plain prompt"),
    ({"messages": USER_HI, "system": "x"}, "system: goes with a plain prompt"),
    ({"prompt_token_ids": [1, 2], "system": "x"}, "system: goes with a plain prompt"),
    ({"prompt": "Hi", "raw": "yes"}, "raw: must be true or false"),
    ({"prompt": "Hi", "raw": 1}, "raw: must be true or false"),
    ({"prompt": "Hi", "system": ["x"]}, "system: must be a string"),
])
def test_a_system_message_that_would_be_dropped_is_refused_and_nothing_is_sent(
        options: dict[str, Any], match: str, producer: Producer, redis_client: redis.Redis, keys: Keys) -> None:
    with pytest.raises(SchemaError, match=match):
        producer.submit(**options)
    with pytest.raises(SchemaError, match=match):
        producer.submit_many([{"prompt": "fine"}, options])
    assert redis_client.xlen(keys.lane(1)) == 0


async def test_the_async_producer_agrees(aproducer: AsyncProducer, redis_client: redis.Redis, keys: Keys) -> None:
    chat = await aproducer.submit(prompt="Hi")
    raw = await aproducer.submit(prompt="Hi", raw=True)
    many = await aproducer.submit_many([{"prompt": "Hi", "system": "Be brief."}, {"prompt": "Hi", "raw": True}])
    sent = _lane(redis_client, keys)
    assert (sent[chat], sent[raw]) == ((None, USER_HI), ("Hi", None))
    assert [sent[i] for i in many] == [(None, SYSTEM_HI), ("Hi", None)]
    with pytest.raises(SchemaError, match="system: goes with a plain prompt"):
        await aproducer.submit(prompt="Hi", raw=True, system="x")


def test_the_cli_sends_what_the_producer_sends(redis_url: str, key_prefix: str, redis_client: redis.Redis,
                                               producer: Producer, keys: Keys) -> None:
    runner = CliRunner()
    common = ["--redis-url", redis_url, "--prefix", key_prefix, "submit", "Hi", "--no-wait"]
    from_cli = {" ".join(flags): runner.invoke(app, [*common, *flags]).stdout.strip()
                for flags in ([], ["--system", "Be brief."], ["--raw"])}
    from_python = {"": producer.submit(prompt="Hi"),
                   "--system Be brief.": producer.submit(prompt="Hi", system="Be brief."),
                   "--raw": producer.submit(prompt="Hi", raw=True)}
    sent = _lane(redis_client, keys)
    assert {flags: sent[rid] for flags, rid in from_cli.items()} == {flags: sent[rid] for flags, rid in
                                                                      from_python.items()}


def _bulk_requests(producer: Producer, tmp_path: Path, lines: list[dict[str, Any]], *, model: str | None = None,
                   **options: Any) -> list[tuple[str | None, Any]]:
    """The requests a bulk job queues for ``lines`` naming ``model`` (no worker: the job is stopped once they
    are queued)."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = BulkJob(producer, source, tmp_path / f"out-{len(list(tmp_path.iterdir()))}.jsonl",
                  BulkOptions.model_validate(options))
    runner = threading.Thread(target=job.run)
    runner.start()
    lane = producer.keys.lane(2, model)  # bulk's default priority: low
    while producer.client.xlen(lane) < len(lines) and runner.is_alive():
        runner.join(0.01)
    job.stopping.set()
    runner.join(timeout=30)
    requests = [decode_request(fields) for _, fields in producer.client.xrange(lane)]
    producer.client.delete(lane)
    return [_wire(request) for request in requests]


def test_bulk_sends_what_the_producer_sends(producer: Producer, tmp_path: Path) -> None:
    plain = [{"id": "a", "prompt": "Hi"}, {"id": "b", "messages": USER_HI}]
    assert _bulk_requests(producer, tmp_path, plain) == [(None, USER_HI), (None, USER_HI)]
    assert _bulk_requests(producer, tmp_path, plain, system="Be brief.") == [(None, SYSTEM_HI), (None, USER_HI)]
    assert _bulk_requests(producer, tmp_path, plain, raw=True) == [("Hi", None), (None, USER_HI)]
    openai = [{"custom_id": "c", "url": "/v1/chat/completions", "body": {"model": "m", "messages": USER_HI}},
              {"custom_id": "d", "url": "/v1/completions", "body": {"model": "m", "prompt": "Hi"}}]
    # as the HTTP API takes them; in the lanes of the model they name
    assert _bulk_requests(producer, tmp_path, openai, model="m") == [(None, USER_HI), ("Hi", None)]


def test_bulk_refuses_a_system_message_with_raw(producer: Producer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="system goes before plain prompts sent as chat, not with raw"):
        BulkOptions(raw=True, system="Be brief.")


def test_celery_generate_sends_a_plain_prompt_as_a_user_message(keys: Keys) -> None:
    assert _wire(build_request(keys, request_options("Hi", {}))) == (None, USER_HI)
    assert _wire(build_request(keys, request_options("Hi", {"system": "Be brief."}))) == (None, SYSTEM_HI)


def test_celery_generate_sends_raw_text_with_raw(keys: Keys) -> None:
    assert _wire(build_request(keys, request_options("Hi", {"raw": True}))) == ("Hi", None)


def test_a_completions_body_is_raw_text_as_serve_submits_it(keys: Keys) -> None:
    assert _wire(build_request(keys, parse_body({"model": "m", "prompt": "Hi"}, "completions").options)) == (
        "Hi", None)
