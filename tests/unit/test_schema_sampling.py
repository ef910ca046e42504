"""The sampling wire fields: penalties, response_format and OpenAI-shaped logprobs; encodings of
requests and results that do not use them stay exactly as before (older readers still take them)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from pydantic import BaseModel, ConfigDict

from tests.unit.wire_helpers import as_redis_returns
from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.outcomes import TokenLogprob, TopLogprob
from tokenmill.protocol.sampling import SamplingParams
from tokenmill.protocol.sampling import SamplingParams as EngineSamplingParams
from tokenmill.protocol.schema import (
    GenerationRequest,
    GenerationResult,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
)

SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["a", "b"]}}, "required": ["mood"]}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "m", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("response_format", [
    JSON_SCHEMA_FORMAT, {"type": "json_object"}, {"type": "text"}, {"type": "regex", "regex": "[0-9]+"},
    {"type": "grammar", "grammar": 'root ::= "yes" | "no"'},
])
def test_new_params_round_trip_and_reach_the_engine(response_format: dict[str, Any]) -> None:
    params = SamplingParams.model_validate({"presence_penalty": 0.5, "frequency_penalty": -1.0,
                                            "repetition_penalty": 1.3, "response_format": response_format})
    request = GenerationRequest(prompt="hi", params=params)
    decoded = decode_request(as_redis_returns(encode_request(request)))
    assert decoded == request
    engine = decoded.params  # NOTE: one vocabulary: the engine takes the wire's SamplingParams as they are
    assert isinstance(engine, EngineSamplingParams)
    assert engine.repetition_penalty == 1.3 and engine.presence_penalty == 0.5
    assert engine.response_format is not None and engine.response_format.type == response_format["type"]
    if response_format["type"] == "json_schema":
        assert engine.response_format.json_schema is not None
        assert engine.response_format.json_schema.schema_ == SCHEMA


@pytest.mark.parametrize(("params", "match"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"response_format": {"type": "json_schema"}}, "needs exactly its own spec field"),
    ({"response_format": {"type": "regex", "regex": "a", "grammar": "b"}}, "needs exactly its own spec field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}}, "extra"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "cannot be combined"),
])
def test_new_params_are_strict(params: dict[str, Any], match: str) -> None:
    fields = encode_request(GenerationRequest(prompt="hi"))
    data = msgpack.unpackb(fields["d"])
    data["params"] = params
    with pytest.raises(SchemaError, match=match):
        decode_request(as_redis_returns({"d": msgpack.packb(data), "v": 1}))
    if "frequency_penalty" not in params:  # NOTE: the engine's model coerces types, like its other fields
        with pytest.raises(ValueError):
            EngineSamplingParams.model_validate(params)


def test_unset_sampling_fields_are_left_out_of_the_encoding() -> None:
    data = msgpack.unpackb(encode_request(GenerationRequest(prompt="hi"))["d"])
    assert set(data["params"]) == {"max_tokens", "temperature", "top_p", "top_k", "min_tokens", "stop",
                                   "stop_token_ids", "ignore_eos"}


class _ResultBeforeIssue13(BaseModel):
    """GenerationResult as readers before these fields knew it (unknown fields rejected)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    status: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, int]
    timings: dict[str, float | None]
    worker: str | None
    error: dict[str, str] | None
    metadata: dict[str, Any]
    logprobs: list[dict[int, float]] | None


def test_an_old_reader_decodes_results_of_requests_without_the_new_things() -> None:
    result = GenerationResult(id="r", status="ok", text="x", token_ids=[1], finish_reason="stop",
                              logprobs=[{1: -0.5, 2: -1.5}])
    obj = msgpack.unpackb(encode_result(result), strict_map_key=False)
    obj.pop("v")
    assert _ResultBeforeIssue13.model_validate(obj).text == "x"


def test_token_logprobs_round_trip() -> None:
    alternative = TopLogprob(token_id=7, token="é", bytes=[195, 169], logprob=-2.0)
    chosen = TokenLogprob(token_id=5, token=" a", bytes=[32, 97], logprob=-0.25, top_logprobs=[alternative])
    result = GenerationResult(id="r", status="ok", token_ids=[5], token_logprobs=[chosen])
    assert decode_result(encode_result(result)) == result
