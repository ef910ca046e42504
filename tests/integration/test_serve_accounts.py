"""Files and batches belong to the API key that created them: with two keys, each lists, reads,
deletes and cancels only its own (another's is a 404, as if it did not exist), batch outputs
belong to the batch's key, and Redis holds a hash of the key, never the key."""

from __future__ import annotations

import hashlib
import json
import time

import openai
import pytest
import redis

from tests.serve_helpers import running_server
from tests.worker_helpers import make_settings, running_worker
from tokenmill.protocol.keys import Keys

KEY_A, KEY_B = "sk-alice-0123456789", "sk-bob-9876543210"


def _batch_input() -> bytes:
    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}}
    return json.dumps(line).encode() + b"\n"


def _finished(client: openai.OpenAI, batch_id: str) -> openai.types.Batch:
    deadline = time.monotonic() + 30
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"batch stuck in {batch.status}"
        time.sleep(0.05)
    return batch


def test_each_key_sees_only_its_own_files_and_batches(redis_url: str, key_prefix: str,
                                                      redis_client: redis.Redis) -> None:
    with running_server(redis_url, key_prefix, api_keys=[KEY_A, KEY_B]) as url, \
            running_worker(make_settings(redis_url, key_prefix)), \
            openai.OpenAI(base_url=url, api_key=KEY_A) as alice, openai.OpenAI(base_url=url, api_key=KEY_B) as bob:
        mine = alice.files.create(file=("a.jsonl", _batch_input()), purpose="batch")
        theirs = bob.files.create(file=("b.jsonl", _batch_input()), purpose="batch")
        batch = alice.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = _finished(alice, batch.id)
        assert done.status == "completed" and done.output_file_id is not None

        assert [f.id for f in alice.files.list().data] == [done.output_file_id, mine.id]
        assert [f.id for f in bob.files.list().data] == [theirs.id]
        assert [b.id for b in alice.batches.list().data] == [batch.id]
        assert bob.batches.list().data == []
        for call in (lambda: bob.files.retrieve(mine.id), lambda: bob.files.content(mine.id),
                     lambda: bob.files.content(done.output_file_id or ""), lambda: bob.files.delete(mine.id),
                     lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                     lambda: bob.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert alice.files.retrieve(mine.id).id == mine.id, "bob's delete did nothing"
        assert json.loads(alice.files.content(done.output_file_id).text)["custom_id"] == "q"
        assert alice.files.delete(mine.id).deleted

    keys = Keys(prefix=key_prefix)
    accounts = {redis_client.hget(keys.file(theirs.id), "account"), redis_client.hget(keys.batch(batch.id), "account")}
    assert accounts == {hashlib.sha256(KEY_B.encode()).hexdigest().encode(),
                        json.dumps(hashlib.sha256(KEY_A.encode()).hexdigest()).encode()}
    for key in redis_client.scan_iter(match=f"{key_prefix}:*"):
        if redis_client.type(key) == b"hash":
            assert not any(KEY_A.encode() in value or KEY_B.encode() in value
                           for value in redis_client.hgetall(key).values()), "a key was stored"


def test_without_keys_everything_belongs_to_one_anonymous_account(redis_url: str, key_prefix: str) -> None:
    with running_server(redis_url, key_prefix) as url, openai.OpenAI(base_url=url, api_key="one") as first, \
            openai.OpenAI(base_url=url, api_key="another") as second:
        uploaded = first.files.create(file=("a.jsonl", _batch_input()), purpose="batch")
        assert [f.id for f in second.files.list().data] == [uploaded.id]
        assert second.files.content(uploaded.id).content == _batch_input()
