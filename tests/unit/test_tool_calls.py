"""Tool calling over the OpenAI mapping: a chat body's tools and tool_choice as the wire request and
a forced call's JSON schema, the answer read back as calls (whole and streamed alike), and the
response objects and stream deltas OpenAI clients read."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.producer.openai_compat import BodyError, completion_object, parse_body
from tokenmill.producer.openai_compat.objects import chunk_object, tool_call_deltas
from tokenmill.producer.openai_compat.tool_calls import ParsedAnswer, ToolCall, ToolCallStream, call_id, parse_answer
from tokenmill.producer.openai_compat.tools import tool_plan
from tokenmill.protocol.schema import GenerationRequest, GenerationResult, Sample, decode_request, encode_request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                                  "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
NAMES = frozenset({"get_weather", "add", "now"})
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}


def _schema(body: dict[str, Any]) -> dict[str, Any]:
    options = parse_body({**CHAT, **body}, "chat").options
    schema: dict[str, Any] = options["response_format"]["json_schema"]["schema"]
    return schema


def _is_valid(instance: Any, schema: dict[str, Any]) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_auto_renders_the_tools_and_reads_the_answer_without_forcing_it() -> None:
    parsed = parse_body({**CHAT, "tools": [WEATHER, ADD], "parallel_tool_calls": False}, "chat")
    assert parsed.tools is not None and parsed.tools.names == {"get_weather", "add"}
    assert not parsed.tools.is_forced and parsed.tools.parallel is False
    assert parsed.options["tools"] == [WEATHER, ADD] and "response_format" not in parsed.options
    explicit = parse_body({**CHAT, "tools": [WEATHER], "tool_choice": "auto"}, "chat")
    assert explicit.tools is not None and explicit.tools.choice == "auto"


def test_none_is_as_if_there_were_no_tools() -> None:
    for body in ({"tools": [WEATHER], "tool_choice": "none"}, {"tool_choice": "none"}, {"tool_choice": "auto"},
                 {"tools": []}, {"parallel_tool_calls": True}):
        parsed = parse_body({**CHAT, **body}, "chat")
        assert parsed.tools is None and "tools" not in parsed.options and "response_format" not in parsed.options


def test_a_named_function_forces_one_call_of_it() -> None:
    schema = _schema({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert schema["properties"]["name"] == {"type": "string", "enum": ["add"]}
    assert schema["properties"]["arguments"] == ADD["function"]["parameters"]  # type: ignore[index]
    assert _is_valid({"name": "add", "arguments": {"a": 1, "b": 2}}, schema)
    assert not _is_valid({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)
    assert not _is_valid({"name": "add", "arguments": {"a": 1}}, schema)


def test_required_forces_one_or_more_calls_of_the_tools() -> None:
    schema = _schema({"tools": [WEATHER, ADD, NOW], "tool_choice": "required"})
    assert schema["type"] == "array" and schema["minItems"] == 1
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1, "b": 2}},
             {"name": "now", "arguments": {}}]
    assert _is_valid(calls, schema) and not _is_valid([], schema)
    assert not _is_valid([{"name": "get_weather", "arguments": {"a": 1, "b": 2}}], schema), "a name takes its own args"
    single = _schema({"tools": [WEATHER, ADD], "tool_choice": "required", "parallel_tool_calls": False})
    assert _is_valid(calls[0], single) and not _is_valid(calls[:1], single)


def test_the_subschemas_of_parameters_move_to_the_root_with_their_references() -> None:
    person = {"type": "function", "function": {"name": "save", "parameters": {
        "type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"],
        "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}}
    schema = _schema({"tools": [person], "tool_choice": {"type": "function", "function": {"name": "save"}}})
    assert schema["properties"]["arguments"]["properties"]["who"] == {"$ref": "#/$defs/save.Person"}
    assert _is_valid({"name": "save", "arguments": {"who": {"name": "Ada"}}}, schema)
    assert not _is_valid({"name": "save", "arguments": {"who": {"age": 3}}}, schema)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0]"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [NOW] * 129}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "tool", "content": "22 C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "y",
                                                                         "tool_calls": [{}]}]},
     "messages[1].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0]"),
])
def test_what_tools_cannot_honour_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BodyError) as error:
        parse_body({**CHAT, **body}, "chat")
    assert error.value.param == param, error.value


def test_tools_and_tool_turns_travel_on_the_wire() -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "22 C"}]}]
    options = parse_body({**CHAT, "messages": messages, "tools": [WEATHER, NOW]}, "chat").options
    request = GenerationRequest.model_validate({"messages": options["messages"], "tools": options["tools"]})
    decoded = decode_request(encode_request(request))
    assert decoded == request and decoded.tools is not None
    assert [tool.function.name for tool in decoded.tools] == ["get_weather", "now"]
    dumped = [m.model_dump() for m in decoded.messages or []]
    assert dumped[1]["content"] == "" and dumped[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert dumped[2] == {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}


def test_a_request_without_tools_carries_no_tools_field() -> None:
    import msgpack

    data = msgpack.unpackb(encode_request(GenerationRequest(messages=[{"role": "user", "content": "hi"}]))["d"])
    assert "tools" not in data, "older readers reject unknown fields: unused tools are left out"


@pytest.mark.parametrize("fields", [
    {"prompt": "hi", "tools": [WEATHER]},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, WEATHER]},
    {"messages": [{"role": "user", "content": "hi"}], "tools": []},
    {"messages": [{"role": "user", "content": "hi"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": float("nan")}}}]},
])
def test_the_wire_refuses_tools_it_cannot_render(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GenerationRequest.model_validate(fields)


@pytest.mark.parametrize(("text", "calls"), [
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", '{"city":"Paris"}')]),
    (' \n[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}]\n',
     [("add", '{"a":1,"b":2}'), ("now", "{}")]),
    ('{"name": "get_weather", "parameters": {"city": "Nice"}}', [("get_weather", '{"city":"Nice"}')]),
    ('{"type": "function", "name": "now"}', [("now", "{}")]),
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}', [("get_weather", '{"city":"Rome"}')]),
    ('{"name": "get_weather", "arguments": {"city": "Zürich"}}', [("get_weather", '{"city":"Zürich"}')]),
])
def test_an_answer_that_is_json_calls_is_those_calls(text: str, calls: list[tuple[str, str]]) -> None:
    assert parse_answer(text, NAMES) == ParsedAnswer(None, tuple(ToolCall(*call) for call in calls))


def test_hermes_blocks_are_calls_and_the_text_around_them_content() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": {}}')
    assert parse_answer(text, NAMES) == ParsedAnswer("Let me check.\n", (ToolCall("get_weather", '{"city":"Paris"}'),
                                                                         ToolCall("now", "{}")))
    only = parse_answer('<tool_call>{"name": "now", "arguments": {}}</tool_call>\n', NAMES)
    assert only == ParsedAnswer(None, (ToolCall("now", "{}"),))


@pytest.mark.parametrize("text", [
    "Paris is sunny.",
    '{"name": "delete_everything", "arguments": {}}',  # not an offered function
    '{"name": "now", "arguments": {}, "id": 3}',
    '{"name": "now", "arguments": [1]}',
    '{"name": "now", "arguments": {}, "parameters": {}}',
    '[{"name": "now", "arguments": {}}, {"city": "Paris"}]',
    "[]",
    '{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    'Sure: {"name": "now", "arguments": {}}',
    '<tool_call>{"name": "now", "arguments": {}}</tool_call><tool_call>not json</tool_call>',
    "<tool_call>",
])
def test_anything_else_is_content_never_dropped(text: str) -> None:
    assert parse_answer(text, NAMES) == ParsedAnswer(text)


STREAMED_ANSWERS = [
    "Paris is sunny.", "  leading space, then <b>markup</b> and a < sign", "A <tool_ca", "   ",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}', '{"city": "Paris"}', "[1, 2]",
    'I will call it. <tool_call>{"name": "now", "arguments": {}}</tool_call> done',
    '\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n',
    'Text <tool_call>{"name": "nope", "arguments": {}}</tool_call>',
]


@given(st.sampled_from(STREAMED_ANSWERS), st.lists(st.integers(min_value=0, max_value=80), max_size=8))
def test_a_streamed_answer_reads_as_the_whole_one(text: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(cut, len(text)) for cut in cuts)})
    stream = ToolCallStream(NAMES)
    sent = "".join(stream.feed(text[start:end]) for start, end in zip(bounds, bounds[1:], strict=False))
    rest = stream.finish()
    whole = parse_answer(text, NAMES)
    assert sent + (rest.content or "") == (whole.content or "")
    assert rest.calls == whole.calls


def test_content_streams_at_once_and_a_call_waits_for_its_end() -> None:
    stream = ToolCallStream(NAMES)
    assert [stream.feed(piece) for piece in ("Hel", "lo <tool", "_c", "all>", '{"name": "now"}')] == [
        "Hel", "lo ", "", "", ""]
    assert stream.finish() == ParsedAnswer(None, (ToolCall("now", "{}"),))
    held = ToolCallStream(NAMES)
    assert held.feed(" {") == "" and held.feed('"name": "now"}') == ""
    assert held.finish().calls == (ToolCall("now", "{}"),)


def _result(text: str, **fields: Any) -> GenerationResult:
    return GenerationResult(id="r1", status="ok", text=text, finish_reason="stop", **fields)


def test_a_call_comes_back_as_tool_calls_with_json_text_arguments() -> None:
    plan = tool_plan({"tools": [WEATHER, NOW]})
    body = completion_object("chat", _result('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                             '{"name": "now", "arguments": {}}]'), model="m", created=1, tools=plan)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {"id": call_id("r1", 0, 0), "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city":"Paris"}'}},
        {"id": call_id("r1", 0, 1), "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert call_id("r1", 0, 0) == call_id("r1", 0, 0) != call_id("r1", 1, 0) and call_id("r1", 0, 0).startswith("call_")


def test_an_answer_that_is_no_call_is_content_and_samples_are_read_one_by_one() -> None:
    plan = tool_plan({"tools": [NOW]})
    plain = completion_object("chat", _result("It is noon."), model="m", created=1, tools=plan)["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "It is noon.", "refusal": None}
    assert plain["finish_reason"] == "stop"
    without_tools = completion_object("chat", _result('{"name": "now", "arguments": {}}'), model="m", created=1)
    assert without_tools["choices"][0]["message"]["content"] == '{"name": "now", "arguments": {}}'
    samples = [Sample(index=0, text="No.", finish_reason="stop"),
               Sample(index=1, text='{"name": "now", "arguments": {}}', finish_reason="stop")]
    choices = completion_object("chat", _result("No.", samples=samples), model="m", created=1, tools=plan)["choices"]
    assert [c["finish_reason"] for c in choices] == ["stop", "tool_calls"]
    assert choices[1]["message"]["tool_calls"][0]["id"] == call_id("r1", 1, 0)


def test_streamed_calls_send_the_name_first_then_the_arguments() -> None:
    calls = (ToolCall("get_weather", '{"city":"Paris"}'), ToolCall("now", "{}"))
    deltas = tool_call_deltas("r1", calls)
    assert deltas == [
        {"index": 0, "id": call_id("r1", 0, 0), "type": "function", "function": {"name": "get_weather",
                                                                                  "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city":"Paris"}'}},
        {"index": 1, "id": call_id("r1", 0, 1), "type": "function", "function": {"name": "now", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}}]
    first = chunk_object("chat", "r1", model="m", created=1, tool_call=deltas[0], is_first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None, "tool_calls": [deltas[0]]}
    later = chunk_object("chat", "r1", model="m", created=1, tool_call=deltas[1])
    assert later["choices"][0]["delta"] == {"tool_calls": [deltas[1]]}
