"""OpenAI request bodies as submit options, and results as OpenAI objects: every field is passed
through, accepted as a no-op, or refused naming itself, never dropped."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.producer.openai_compat import BodyError, completion_object, parse_body, result_error
from tokenmill.producer.openai_compat.objects import chunk_object
from tokenmill.producer.submit_options import build_request
from tokenmill.protocol.errors import SchemaError
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.outcomes import TokenLogprob, TopLogprob
from tokenmill.protocol.schema import GenerationResult, Sample, Usage

CHAT: dict[str, Any] = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}


def _request(body: dict[str, Any], endpoint: str = "chat") -> Any:
    return build_request(Keys(), parse_body(body, endpoint).options)  # type: ignore[arg-type]


def test_chat_fields_map_onto_the_wire() -> None:
    request = _request({**CHAT, "max_completion_tokens": 9, "max_tokens": 3, "temperature": 0.5, "top_p": 0.9,
                        "seed": 3, "stop": "END", "user": "u", "store": False, "presence_penalty": 0,
                        "frequency_penalty": 0, "response_format": {"type": "text"}, "n": 1, "top_k": 4})
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.stop, params.top_k) == (
        9, 0.5, 0.9, 3, ["END"], 4)
    assert request.model == "smollm2-135m" and request.messages[0].content == "Hi"


def test_content_parts_and_developer_messages() -> None:
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    request = _request({**CHAT, "messages": messages})
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "Hello there")]


def test_completions_prompts() -> None:
    once = _request({"prompt": "Once"}, "completions")
    assert (once.prompt, once.messages) == ("Once", None)  # raw text: no chat template
    assert _request({"prompt": ["Once"]}, "completions").params.max_tokens == 16  # OpenAI's default there
    assert _request({"prompt": [[1, 2, 3]]}, "completions").prompt_token_ids == [1, 2, 3]
    with pytest.raises(BodyError, match="one prompt per request") as several:
        parse_body({"prompt": ["a", "b"]}, "completions")
    assert several.value.param == "prompt"


@pytest.mark.parametrize(("body", "param"), [
    ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
    ({**CHAT, "logit_bias": {"1": 5}}, "logit_bias"),
    ({**CHAT, "prompt": "x"}, "prompt"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "logprobs": 3}, "logprobs"),
    ({**CHAT, "best_of": 2}, "best_of"),
    ({**CHAT, "mystery": 1}, "mystery"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BodyError) as refused:
        parse_body(body, "chat")
    assert refused.value.param == param


@pytest.mark.parametrize(("name", "value"), [("n", 2), ("presence_penalty", 0.5), ("frequency_penalty", -0.5),
                                             ("repetition_penalty", 1.2)])
def test_sampling_fields_pass_through(name: str, value: float) -> None:
    assert getattr(_request({**CHAT, name: value}).params, name) == value


def test_n_is_the_number_of_choices_and_the_wire_bounds_it() -> None:
    assert parse_body({**CHAT, "n": 3}, "chat").num_choices == 3
    assert parse_body({"prompt": "x", "n": 2, "best_of": 2}, "completions").num_choices == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(BodyError) as refused:
            parse_body({**CHAT, "n": bad}, "chat")
        assert refused.value.param == "n"
    with pytest.raises(SchemaError, match="params.n"):  # more samples than a request may ask for
        _request({**CHAT, "n": 17})


def test_json_response_formats_pass_through() -> None:
    response_format = _request({**CHAT, "response_format": {"type": "json_object"}}).params.response_format
    assert response_format is not None and response_format.type == "json_object"
    assert _request({**CHAT, "response_format": {"type": "text"}}).params.response_format is None


def test_logprobs_ask_for_alternatives() -> None:
    assert _request({**CHAT, "logprobs": True, "top_logprobs": 3}).params.logprobs == 3
    assert _request({**CHAT, "logprobs": True}).params.logprobs == 0
    assert _request({"prompt": "x", "logprobs": 2}, "completions").params.logprobs == 2
    assert _request({**CHAT, "logprobs": False}).params.logprobs is None


def _result(**fields: Any) -> GenerationResult:
    return GenerationResult(id="r1", status="ok", text="Hi!", finish_reason="length", model="served",
                            usage=Usage(prompt_tokens=4, completion_tokens=2), **fields)


def test_objects_name_the_served_model_and_both_logprob_shapes() -> None:
    top = TopLogprob(token_id=5, token="Hi", bytes=[72, 105], logprob=-0.1)
    token_logprobs = [TokenLogprob(token_id=5, token="Hi", bytes=[72, 105], logprob=-0.1, top_logprobs=[top]),
                      TokenLogprob(token_id=6, token="!", bytes=[33], logprob=-0.5)]
    chat = completion_object("chat", _result(token_logprobs=token_logprobs), model="asked", created=1)
    assert (chat["id"], chat["object"], chat["model"]) == ("chatcmpl-r1", "chat.completion", "served")
    assert chat["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    [choice] = chat["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Hi!"
    assert choice["logprobs"]["content"][0] == {"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                                                "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}
    text = completion_object("completions", _result(token_logprobs=token_logprobs), model="asked", created=1)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "Hi!"
    assert text["choices"][0]["logprobs"] == {"tokens": ["Hi", "!"], "token_logprobs": [-0.1, -0.5],
                                              "top_logprobs": [{"Hi": -0.1}, {}], "text_offset": [0, 2]}


def test_chunks_and_errors() -> None:
    first = chunk_object("chat", "r1", model="m", created=1, text="He", is_first=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant",
                                                                                           "content": "He"}
    last = chunk_object("chat", "r1", model="m", created=1, finish_reason="stop")
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    status, body = result_error(GenerationResult.failure("r1", "model_not_served", "serves x, not y"))
    assert status == 404 and body == {"error": {"message": "serves x, not y", "type": "invalid_request_error",
                                                "param": None, "code": "model_not_found"}}
    assert result_error(GenerationResult.failure("r1", "internal", "boom"))[0] == 500
    assert result_error(GenerationResult.failure("r1", "expired", "late", status="expired"))[0] == 408


def test_samples_become_choices() -> None:
    samples = [Sample(index=i, text=f"s{i}", finish_reason="stop") for i in range(2)]
    chat = completion_object("chat", _result(samples=samples), model="asked", created=1)
    assert [(c["index"], c["message"]["content"]) for c in chat["choices"]] == [(0, "s0"), (1, "s1")]
    text = completion_object("completions", _result(samples=samples), model="asked", created=1)
    assert [(c["index"], c["text"]) for c in text["choices"]] == [(0, "s0"), (1, "s1")]
