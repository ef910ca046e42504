"""The wire contract: round trips and every error code of decode_request / decode_result."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from tests.unit.wire_helpers import as_redis_returns
from tokenmill.producer.errors import JobFailed
from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.protocol.schema import (
    SCHEMA_VERSION,
    GenerationRequest,
    GenerationResult,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    peek_request_id,
)


@pytest.mark.parametrize("prompt", [{"prompt": "Hi"}, {"messages": [{"role": "user", "content": "Hi", "name": "a"}]},
                                    {"prompt_token_ids": [1, 2, 3]}])
def test_request_round_trip(prompt: dict[str, Any]) -> None:
    request = GenerationRequest(
        **prompt, params=SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_tokens=1, seed=3,
                                        stop=["\n"], stop_token_ids=[2], ignore_eos=True, logprobs=2),
        priority=2, deadline=1e10, reply_to="replies", stream_tokens=True, model="m", metadata={"x": [1, "y"]},
    )
    fields = encode_request(request)
    assert fields["v"] == SCHEMA_VERSION
    assert decode_request(as_redis_returns(fields)) == request
    assert decode_request(fields) == request  # str keys work as well


def test_max_tokens_none_travels_as_the_rest_of_the_context() -> None:
    request = GenerationRequest(prompt="Hi", params=SamplingParams(max_tokens=None))
    assert decode_request(as_redis_returns(encode_request(request))).params.max_tokens is None
    assert decode_request(as_redis_returns(encode_request(GenerationRequest(prompt="Hi")))).params.max_tokens == 256


def test_result_round_trip_with_logprobs() -> None:
    result = GenerationResult(id="r", status="ok", text="héllo", token_ids=[5, 6], finish_reason="length",
                              logprobs=[{5: -0.1, 9: -2.0}], metadata={"k": 1}, worker="w1")
    assert decode_result(encode_result(result)) == result


def test_failure_result_and_job_failed() -> None:
    result = GenerationResult.failure("r", ErrorCode.PROMPT_TOO_LONG, "4096 > 2048")
    assert (result.status, result.ok, result.error and result.error.code) == ("error", False, "prompt_too_long")
    error = JobFailed(decode_result(encode_result(result)))
    assert (error.code, error.reason) == ("prompt_too_long", "4096 > 2048")
    assert "request r error: [prompt_too_long] 4096 > 2048" in str(error)
    assert GenerationResult.failure("c", "cancelled", "by user", status="cancelled").finish_reason == "abort"


def test_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="END").stop == ["END"]


def packed(data: Any) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


@pytest.mark.parametrize(("fields", "code", "match"), [
    ({b"v": b"1"}, "undecodable", "no 'd' field"),
    ({b"v": b"1", b"d": b"\xc1\xc1"}, "undecodable", "not valid msgpack"),
    ({b"v": b"1", b"d": packed([1, 2])}, "undecodable", "must decode to a mapping"),
    ({b"d": packed({"prompt": "x"})}, "unknown_version", "None"),
    ({b"v": b"2", b"d": packed({"prompt": "x"})}, "unknown_version", "'2'|b'2'"),
    ({b"v": b"one", b"d": packed({"prompt": "x"})}, "unknown_version", "one"),
    ({b"v": b"1", b"d": packed({})}, "validation", "exactly one of prompt"),
    ({b"v": b"1", b"d": packed({"prompt": "x", "prompt_token_ids": [1]})}, "validation", "exactly one"),
    ({b"v": b"1", b"d": packed({"prompt_token_ids": []})}, "validation", "non-empty"),
    ({b"v": b"1", b"d": packed({"messages": []})}, "validation", "messages must not be empty"),
    ({b"v": b"1", b"d": packed({"prompt": "x", "params": {"max_tokens": 0}})}, "validation", "params.max_tokens"),
    ({b"v": b"1", b"d": packed({"prompt": "x", "params": {"max_tokens": 2, "min_tokens": 3}})},
     "validation", "min_tokens must not exceed"),
    ({b"v": b"1", b"d": packed({"prompt": "x", "params": {"stop": [""]}})}, "validation", "stop strings"),
    ({b"v": b"1", b"d": packed({"prompt": "x", "id": "a b"})}, "validation", "whitespace"),
    ({b"v": b"1", b"d": packed({"prompt": "x", "priority": -1})}, "validation", "priority"),
    ({b"v": b"1", b"d": packed({"prompt": "x", "surprise": 1})}, "validation", "surprise"),
])
def test_decode_request_error_codes(fields: dict[bytes, bytes], code: str, match: str) -> None:
    with pytest.raises(SchemaError, match=match) as info:
        decode_request(fields)
    assert info.value.code == code
    assert code in {c.value for c in ErrorCode}


@pytest.mark.parametrize(("data", "code"), [
    (b"\xc1", "undecodable"),
    (packed("text"), "undecodable"),
    (packed({"id": "r", "status": "ok", "v": 99}), "unknown_version"),
    (packed({"id": "r", "status": "maybe", "v": 1}), "validation"),
])
def test_decode_result_errors(data: bytes, code: str) -> None:
    with pytest.raises(SchemaError) as info:
        decode_result(data)
    assert info.value.code == code


def test_peek_request_id_recovers_an_address() -> None:
    assert peek_request_id({b"v": b"9", b"d": packed({"id": "abc", "prompt": 3})}) == "abc"
    assert peek_request_id({b"d": b"\xc1"}) is None
    assert peek_request_id({b"d": packed({"id": "has space"})}) is None
    assert peek_request_id({}) is None
