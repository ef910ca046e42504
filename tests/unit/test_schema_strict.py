"""The strict wire schema: no coercion, finite numbers, encodable text and
metadata, an exact version field, and ids recovered from payloads with bad UTF-8."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import msgpack
import pytest

from tokenmill.producer.submit_options import build_request
from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import (
    GenerationRequest,
    GenerationResult,
    decode_request,
    encode_request,
    encode_result,
    peek_reply_to,
    peek_request_id,
)
from tokenmill.protocol.values import MAX_ERROR_CHARS, MAX_METADATA_BYTES, MAX_METADATA_DEPTH, safe_text, version_of


def packed(data: Any) -> bytes:
    payload: bytes = msgpack.packb(data, use_bin_type=True)
    return payload


def entry(data: Any, version: Any = b"1") -> dict[bytes, Any]:
    return {b"v": version, b"d": packed(data)}


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


def with_bad_utf8(data: dict[str, Any], field: str) -> bytes:
    """msgpack of ``data`` whose str ``field`` value holds the invalid UTF-8 byte 0xff."""
    payload = packed({**data, field: "@MARKER@"})
    assert payload.count(b"@MARKER@") == 1
    return payload.replace(b"@MARKER@", b"@MA\xffKER@")  # same length: the str header stays right


# Each was accepted (coerced or passed through) before the schema became strict.
LOOSE_OR_POISONED = [
    ({"prompt": "x", "params": {"max_tokens": "10"}}, "params.max_tokens"),
    ({"prompt": "x", "params": {"max_tokens": True}}, "params.max_tokens"),
    ({"prompt": "x", "params": {"max_tokens": 10.0}}, "params.max_tokens"),
    ({"prompt": "x", "params": {"ignore_eos": "yes"}}, "params.ignore_eos"),
    ({"prompt": "x", "params": {"ignore_eos": 1}}, "params.ignore_eos"),
    ({"prompt": "x", "params": {"temperature": "0.5"}}, "params.temperature"),
    ({"prompt": "x", "params": {"temperature": math.nan}}, "params.temperature"),
    ({"prompt": "x", "params": {"top_p": math.inf}}, "params.top_p"),
    ({"prompt": "x", "params": {"seed": "3"}}, "params.seed"),
    ({"prompt": "x", "params": {"stop_token_ids": ["2"]}}, "params.stop_token_ids.0"),
    ({"prompt": "x", "params": {"max_tokens": 2**40}}, "params.max_tokens"),
    ({"prompt": "x", "stream_tokens": 1}, "stream_tokens"),
    ({"prompt": "x", "stream_tokens": "true"}, "stream_tokens"),
    ({"prompt": "x", "priority": "0"}, "priority"),
    ({"prompt": "x", "priority": False}, "priority"),
    ({"prompt": "x", "deadline": math.nan}, "deadline"),
    ({"prompt": "x", "deadline": math.inf}, "deadline"),
    ({"prompt": "x", "deadline": "1e12"}, "deadline"),
    ({"prompt": "x", "submitted_at": -math.inf}, "submitted_at"),
    ({"prompt": b"bytes"}, "prompt"),
    ({"prompt": "x", "id": b"abc"}, "id"),
    ({"prompt": "x", "reply_to": b"tokenmill:default:reply:r"}, "reply_to"),
    ({"prompt": "x", "model": 7}, "model"),
    ({"prompt_token_ids": [1, True]}, "prompt_token_ids.1"),
    ({"prompt_token_ids": ["1"]}, "prompt_token_ids.0"),
    ({"prompt_token_ids": [2**40]}, "prompt_token_ids.0"),
    ({"messages": [{"role": "user", "content": b"hi"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi", "name": b"\xff"}]}, "messages.0"),
    ({"prompt": "x", "metadata": {"b": b"\xff"}}, "metadata"),
    ({"prompt": "x", "metadata": {"t": msgpack.Timestamp(1, 0)}}, "metadata"),
    ({"prompt": "x", "metadata": {"e": msgpack.ExtType(5, b"x")}}, "metadata"),
    ({"prompt": "x", "metadata": {"deep": nested(255)}}, "metadata"),
    ({"prompt": "x", "metadata": {"deep": nested(MAX_METADATA_DEPTH)}}, "metadata"),
    ({"prompt": "x", "metadata": {"n": {1: "int key"}}}, "metadata"),
    ({"prompt": "x", "metadata": {"f": math.nan}}, "metadata"),
    ({"prompt": "x", "metadata": {"big": "x" * MAX_METADATA_BYTES}}, "metadata"),
]


@pytest.mark.parametrize(("data", "where"), LOOSE_OR_POISONED)
def test_malformed_requests_are_validation_errors(data: dict[str, Any], where: str) -> None:
    with pytest.raises(SchemaError) as info:
        decode_request(entry(data))
    assert info.value.code == "validation"
    assert info.value.message.startswith(where + ":"), info.value.message


def test_python_values_that_cannot_be_packed_are_rejected_before_encoding() -> None:
    with pytest.raises(ValueError, match="64 bits"):
        GenerationRequest(prompt="x", metadata={"i": 2**64})


@pytest.mark.parametrize("field", ["prompt", "id", "reply_to", "model"])
def test_invalid_utf8_in_a_string_is_a_validation_error_addressed_to_the_id(field: str) -> None:
    data = {"id": "req-1", "prompt": "hello", "reply_to": "tokenmill:default:reply:r", "model": "m"}
    fields = {b"v": b"1", b"d": with_bad_utf8(data, field)}
    with pytest.raises(SchemaError) as info:
        decode_request(fields)
    assert info.value.code == "validation" and "UTF-8" in info.value.message
    assert peek_request_id(fields) == (None if field == "id" else "req-1")
    assert peek_reply_to(fields) == (None if field == "reply_to" else "tokenmill:default:reply:r")


@pytest.mark.parametrize("options", [
    {"prompt": "\ud800"},
    {"messages": [{"role": "user", "content": "a\udcffb"}]},
    {"messages": [{"role": "user", "content": "a", "name": "\ud800"}]},
    {"prompt": "x", "stop": ["\udc80"]},
    {"prompt": "x", "metadata": {"\ud800": 1}},
    {"prompt": "x", "metadata": {"k": ["\ud800"]}},
    {"prompt": "x", "request_id": "id\ud800"},
])
def test_lone_surrogates_are_refused_at_submit_not_at_encode(options: dict[str, Any]) -> None:
    with pytest.raises(SchemaError) as info:
        build_request(Keys(), options)
    assert info.value.code == "validation"
    info.value.message.encode("utf-8")


def test_error_text_is_always_encodable() -> None:
    data = {"prompt": "x", "\udcff" * 5000: 1, **{f"k{i}": i for i in range(50)}}  # unknown keys, one not UTF-8
    with pytest.raises(SchemaError) as info:
        decode_request({b"v": b"1", b"d": msgpack.packb(data, unicode_errors="surrogatepass")})
    message = info.value.message
    assert len(message) <= MAX_ERROR_CHARS and message.encode("utf-8")
    result = GenerationResult.failure("r", "validation", "bad \ud800 text")
    assert encode_result(result) and safe_text("\ud800") == "\\ud800"


@pytest.mark.parametrize(("raw", "version"), [
    (1, 1), (b"1", 1), ("1", 1), (b"2", 2),
    (b" 1", None), (b"1 ", None), (b"01", None), (b"+1", None), (b"1.0", None), (1.0, None), (True, None),
    (b"\xff", None), ("\u0661", None), (None, None), (b"", None),
])
def test_version_field_is_exactly_the_decimal_text(raw: Any, version: int | None) -> None:
    assert version_of(raw) == version


@pytest.mark.parametrize("raw", [b" 1", b"01", True, 1.0, "1\n"])
def test_loose_versions_are_refused(raw: Any) -> None:
    with pytest.raises(SchemaError) as info:
        decode_request(entry({"prompt": "x"}, raw))
    assert info.value.code == "unknown_version"


def test_version_as_redis_returns_it_is_accepted() -> None:
    request = GenerationRequest(prompt="x")
    fields = encode_request(request)
    assert decode_request({b"v": str(fields["v"]).encode(), b"d": fields["d"]}) == request


def test_peek_request_id_needs_a_valid_id() -> None:
    assert peek_request_id(entry({"id": "a" * 256, "prompt": 3})) == "a" * 256
    assert peek_request_id(entry({"id": "a" * 257})) is None
    assert peek_request_id(entry({"id": ""})) is None
    assert peek_request_id(entry({"id": 5})) is None
    assert peek_request_id({b"d": packed({"id": "x\ty"})}) is None


def test_valid_edge_values_still_pass_and_encode() -> None:
    metadata = {"n": None, "b": True, "i": -(2**63), "f": 1.5, "s": "é", "l": [1, "a", {"k": []}],
                "deep": nested(MAX_METADATA_DEPTH - 1)}
    request = GenerationRequest.model_validate({"prompt": "x", "deadline": 10**10, "metadata": metadata,
                                                "params": {"temperature": 1, "top_p": 1}})
    assert decode_request(encode_request(request)).metadata == metadata


def test_submit_converts_python_sequences_and_mappings() -> None:
    request = build_request(Keys(), {"prompt_token_ids": (1, 2), "stop_token_ids": (3,), "stop": ("a", "b"),
                                     "metadata": MappingProxyType({"k": 1})})
    assert (request.prompt_token_ids, request.params.stop_token_ids, request.params.stop) == ([1, 2], [3], ["a", "b"])
    request = build_request(Keys(), {"messages": (MappingProxyType({"role": "user", "content": "hi"}),)})
    assert request.messages is not None and request.messages[0].content == "hi"
