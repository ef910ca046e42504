"""Tool calling through ``tokenmill serve`` and the real openai client, with a real echo worker (it
answers with the messages' contents, so a test writes the model's answer): calls come back as
``tool_calls`` whole and streamed, the worker gets the tools and a forced call's schema, the next
turn's tool messages are taken, and bad tools are refused in OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.serve_helpers import running_server
from tests.worker_helpers import make_settings, running_worker
from tokenmill.engine.engine import Engine
from tokenmill.engine.output.prompts import ChatPrompt, Prompt
from tokenmill.protocol.sampling import SamplingParams

SLOW_ECHO = "echo:step_delay_s=0.005"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


class RecordingEcho(Engine):
    """The echo model's engine, keeping what the worker handed it: prompts and sampling parameters."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[Prompt] = []
        self.params: list[SamplingParams] = []

    def tokenize(self, prompt: Prompt) -> list[int]:
        self.prompts.append(prompt)
        return super().tokenize(prompt)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, length_group: str | None = None,
                    is_handed_off: bool = False, streams: bool = True) -> None:
        self.params.append(params or SamplingParams())
        super().add_request(request_id, prompt_token_ids, params, priority, arrival_time, length_group, is_handed_off,
                            streams)


@pytest.fixture
def echo(redis_url: str, key_prefix: str) -> Iterator[tuple[openai.OpenAI, RecordingEcho]]:
    settings = make_settings(redis_url, key_prefix, model=SLOW_ECHO)
    engine = RecordingEcho.from_config(settings.engine)
    with running_server(redis_url, key_prefix) as url, running_worker(settings, engine=engine), \
            openai.OpenAI(base_url=url, api_key="none", max_retries=0) as client:
        yield client, engine


def _ask(client: openai.OpenAI, content: str, **body: Any) -> Any:
    return client.chat.completions.create(model="echo", messages=[{"role": "user", "content": content}],
                                          max_tokens=200, **body)


def test_an_answer_that_is_a_call_comes_back_as_tool_calls(echo: tuple[openai.OpenAI, RecordingEcho]) -> None:
    client, engine = echo
    [choice] = _ask(client, CALL, tools=[WEATHER, NOW]).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tool_call] = choice.message.tool_calls or []
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    assert tool_call.function.name == "get_weather" and json.loads(tool_call.function.arguments) == {"city": "Paris"}
    [prompt] = engine.prompts
    assert isinstance(prompt, ChatPrompt) and prompt.tools == [WEATHER, NOW], "the worker renders the tools"
    assert engine.params[0].response_format is None, "auto forces nothing"
    [plain] = _ask(client, "It is sunny in Paris.", tools=[WEATHER]).choices
    assert (plain.finish_reason, plain.message.content, plain.message.tool_calls) == (
        "stop", "It is sunny in Paris.", None)


def test_a_required_call_reaches_the_worker_as_the_schema_of_the_calls(
        echo: tuple[openai.OpenAI, RecordingEcho]) -> None:
    client, engine = echo
    named = _ask(client, CALL, tools=[WEATHER, NOW],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    required = _ask(client, f"[{CALL}, " + '{"name": "now", "arguments": {}}]', tools=[WEATHER, NOW],
                    tool_choice="required")
    assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["get_weather"]
    assert [c.function.name for c in required.choices[0].message.tool_calls or []] == ["get_weather", "now"]
    assert [c.index for c in required.choices] == [0] and required.choices[0].finish_reason == "tool_calls"
    schemas = [p.response_format.json_schema.schema_ for p in engine.params
               if p.response_format is not None and p.response_format.json_schema is not None]
    assert schemas[0]["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert schemas[0]["properties"]["arguments"] == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert schemas[1]["type"] == "array" and len(schemas[1]["items"]["anyOf"]) == 2


def test_streamed_calls_accumulate_in_the_sdk(echo: tuple[openai.OpenAI, RecordingEcho]) -> None:
    client, _ = echo
    messages: Any = [{"role": "user", "content": f"Checking. <tool_call>{CALL}</tool_call>"}]
    chunks = list(client.chat.completions.create(model="echo", messages=messages, tools=[WEATHER], stream=True,
                                                 max_tokens=200))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content == "Checking. " and len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    assert [(d.index, d.function.name if d.function else None) for d in deltas] == [(0, "get_weather"), (0, None)]
    assert deltas[0].id is not None and deltas[0].type == "function"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    with client.chat.completions.stream(model="echo", messages=messages, tools=[WEATHER],  # type: ignore[list-item]
                                        max_tokens=200) as stream:
        final = stream.get_final_completion()
    [tool_call] = final.choices[0].message.tool_calls or []
    assert tool_call.function.name == "get_weather" and json.loads(tool_call.function.arguments) == {"city": "Paris"}
    assert final.choices[0].message.content == "Checking. " and final.choices[0].finish_reason == "tool_calls"
    plain = list(client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "No call."}],
                                                tools=[WEATHER], stream=True, max_tokens=200))
    assert "".join(c.choices[0].delta.content or "" for c in plain if c.choices) == "No call."


def test_the_next_turn_carries_the_call_and_its_result(echo: tuple[openai.OpenAI, RecordingEcho]) -> None:
    client, engine = echo
    first = _ask(client, CALL, tools=[WEATHER])
    call = (first.choices[0].message.tool_calls or [])[0]
    messages: Any = [{"role": "user", "content": "Weather in Paris?"}, first.choices[0].message.model_dump(),
                     {"role": "tool", "tool_call_id": call.id, "content": "22 C"}]
    second = client.chat.completions.create(model="echo", messages=messages, tools=[WEATHER], max_tokens=200)
    assert second.choices[0].finish_reason == "stop" and "22 C" in (second.choices[0].message.content or "")
    prompt = engine.prompts[-1]
    assert isinstance(prompt, ChatPrompt)
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "tool"]
    assert prompt.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert prompt.messages[2]["tool_call_id"] == call.id


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_refused_in_openai_shape(echo: tuple[openai.OpenAI, RecordingEcho], body: dict[str, Any],
                                               param: str) -> None:
    client, engine = echo
    with pytest.raises(openai.BadRequestError) as error:
        _ask(client, "hi", **body)
    assert error.value.param == param and error.value.status_code == 400
    assert engine.prompts == [], "nothing was queued"
