"""Raw clients against the strict wire schema, through a real (echo) worker: bad UTF-8 and loose
types are answered ``validation`` at the request's own id, and the worker goes on serving."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import redis

from tests.worker_helpers import enqueue, make_settings, running_worker, wait_result
from tokenmill.protocol.keys import Keys


def _xadd(client: redis.Redis, keys: Keys, payload: bytes, version: Any = 1) -> None:
    client.xadd(keys.lane(0), {"d": payload, "v": version})


def _with_bad_utf8_prompt(request_id: str) -> bytes:
    payload: bytes = msgpack.packb({"id": request_id, "prompt": "@MARKER@"}, use_bin_type=True)
    return payload.replace(b"@MARKER@", b"@MA\xffKER@")


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


POISONED: dict[str, dict[str, Any]] = {
    "str-int": {"prompt": "x", "params": {"max_tokens": "10"}},
    "bool-int": {"prompt": "x", "params": {"max_tokens": True}},
    "str-bool": {"prompt": "x", "params": {"ignore_eos": "yes"}},
    "nan-deadline": {"prompt": "x", "deadline": math.nan},
    "bytes-prompt": {"prompt": b"hello"},
    "bytes-metadata": {"prompt": "x", "metadata": {"b": b"\xff"}},
    "timestamp-metadata": {"prompt": "x", "metadata": {"t": msgpack.Timestamp(1, 0)}},
    "deep-metadata": {"prompt": "x", "metadata": {"deep": _nested(300)}},
}


def test_bad_input_is_answered_at_its_id_and_the_worker_serves_on(redis_url: str, redis_client: redis.Redis,
                                                                  key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix)
    keys = settings.queue.keys
    _xadd(redis_client, keys, _with_bad_utf8_prompt("bad-utf8"))
    for request_id, data in POISONED.items():
        _xadd(redis_client, keys, msgpack.packb({"id": request_id, **data}, use_bin_type=True))
    _xadd(redis_client, keys, msgpack.packb({"id": "spaced-version", "prompt": "x"}), version=" 1")
    with running_worker(settings):
        codes = {request_id: wait_result(redis_client, keys, request_id).error.code  # type: ignore[union-attr]
                 for request_id in ["bad-utf8", *POISONED, "spaced-version"]}
        assert wait_result(redis_client, keys, enqueue(redis_client, keys, prompt="still here")).text == "still here"
    assert codes == {"bad-utf8": "validation", **dict.fromkeys(POISONED, "validation"),
                     "spaced-version": "unknown_version"}
    assert redis_client.xlen(keys.dead) == 0
