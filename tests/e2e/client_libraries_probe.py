"""Run by tests/e2e/test_client_libraries.py in a fresh virtualenv holding openai, litellm,
langchain-openai and instructor (nothing of tokenmill): each library's chat, streaming, structured
output (json_schema) and tool-calling paths against ``tokenmill serve``.

Usage: ``python client_libraries_probe.py BASE_URL MODEL REPORT``. Writes REPORT, one JSON object:
per check ``"ok"`` or the failure's traceback, its seconds, and the libraries' versions (a file, since
LiteLLM prints to stdout). The model is tiny, so the checks
are of shapes and schemas, not of answers.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import instructor
import litellm
import openai
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

BASE_URL, MODEL, REPORT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
MAX_TOKENS = 48
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CHECKS: dict[str, Callable[[], None]] = {}


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=24)
    celsius: int = Field(ge=-60, le=60)


GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"22 C in {city}"


def check(function: Callable[[], None]) -> Callable[[], None]:
    CHECKS[function.__name__] = function
    return function


def _weather_args(arguments: str | dict[str, Any]) -> dict[str, Any]:
    """A get_weather call's arguments, checked against its schema (a string city, nothing else)."""
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert isinstance(parsed, dict) and set(parsed) == {"city"} and isinstance(parsed["city"], str), parsed
    assert len(parsed["city"]) <= 24, parsed
    return parsed


def _openai() -> openai.OpenAI:
    return openai.OpenAI(base_url=BASE_URL, api_key="none", max_retries=0)


# -- openai ------------------------------------------------------------------------------------------

@check
def openai_chat_and_stream() -> None:
    client = _openai()
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    content = reply.choices[0].message.content
    assert isinstance(content, str) and content, reply
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stream=True) if chunk.choices)
    assert streamed == content, (streamed, content)


@check
def openai_structured_output() -> None:
    reply = _openai().chat.completions.parse(model=MODEL, messages=WEATHER_QUESTION, response_format=Weather,
                                             max_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(reply.choices[0].message.parsed, Weather), reply


@check
def openai_tool_calls_and_the_next_turn() -> None:
    client = _openai()
    reply = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=[GET_WEATHER], max_tokens=MAX_TOKENS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id, call
    _weather_args(call.function.arguments)
    required = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[GET_WEATHER],
                                              tool_choice="required", max_tokens=MAX_TOKENS, temperature=0)
    calls = required.choices[0].message.tool_calls or []
    assert calls and all(c.function.name == "get_weather" for c in calls), required
    for c in calls:
        _weather_args(c.function.arguments)
    messages: list[Any] = [*WEATHER_QUESTION, choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[GET_WEATHER],
                                            max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls"), answer


@check
def openai_streamed_tool_calls() -> None:
    tools = [openai.pydantic_function_tool(Weather)]
    with _openai().chat.completions.stream(model=MODEL, messages=WEATHER_QUESTION, tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "Weather"}},
                                           max_tokens=MAX_TOKENS, temperature=0) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events, events
    [call] = final.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Weather), call
    assert final.choices[0].finish_reason == "tool_calls", final


# -- litellm -----------------------------------------------------------------------------------------

def _litellm(**kwargs: Any) -> Any:
    return litellm.completion(model=f"openai/{MODEL}", api_base=BASE_URL, api_key="none",
                              max_tokens=MAX_TOKENS, temperature=0, **kwargs)


@check
def litellm_chat_and_stream() -> None:
    content = _litellm(messages=QUESTION).choices[0].message.content
    assert isinstance(content, str) and content, content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in _litellm(messages=QUESTION, stream=True)
                       if chunk.choices)
    assert streamed == content, (streamed, content)


@check
def litellm_structured_output() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "weather", "schema": Weather.model_json_schema()}}
    Weather.model_validate_json(_litellm(messages=WEATHER_QUESTION, response_format=schema).choices[0].message.content)


@check
def litellm_tool_calls() -> None:
    reply = _litellm(messages=WEATHER_QUESTION, tools=[GET_WEATHER],
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather", call
    _weather_args(call.function.arguments)
    streamed = [chunk for chunk in _litellm(messages=WEATHER_QUESTION, tools=[GET_WEATHER], stream=True,
                                            tool_choice="required")]
    rebuilt = litellm.stream_chunk_builder(streamed, messages=WEATHER_QUESTION)
    calls = rebuilt.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls), rebuilt
    for c in calls:
        _weather_args(c.function.arguments)


# -- langchain-openai --------------------------------------------------------------------------------

def _chat_model() -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=BASE_URL, api_key="none", temperature=0, max_tokens=MAX_TOKENS,
                      max_retries=0)


@check
def langchain_chat_and_stream() -> None:
    model = _chat_model()
    content = model.invoke("What is the capital of France?").content
    assert isinstance(content, str) and content, content
    streamed = "".join(str(chunk.content) for chunk in model.stream("What is the capital of France?"))
    assert streamed == content, (streamed, content)


@check
def langchain_structured_output() -> None:
    for method in ("json_schema", "function_calling"):
        answer = _chat_model().with_structured_output(Weather, method=method).invoke("What is the weather in Paris?")
        assert isinstance(answer, Weather), (method, answer)


@check
def langchain_bind_tools() -> None:
    forced = _chat_model().bind_tools([get_weather], tool_choice="get_weather")
    message = forced.invoke([HumanMessage("What is the weather in Paris?")])
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"], call
    _weather_args(call["args"])
    answer = forced.bind(tool_choice="none").invoke(  # the next turn: the call, its result
        [HumanMessage("What is the weather in Paris?"), message, ToolMessage("22 C", tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and not answer.tool_calls, answer
    auto = _chat_model().bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert isinstance(auto.content, str) and all(c["name"] == "get_weather" for c in auto.tool_calls), auto
    merged: AIMessageChunk | None = None
    for chunk in forced.stream("What is the weather in Paris?"):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and [c["name"] for c in merged.tool_calls] == ["get_weather"], merged
    _weather_args(merged.tool_calls[0]["args"])


# -- instructor --------------------------------------------------------------------------------------

@check
def instructor_tools_mode() -> None:
    client = instructor.from_openai(_openai())  # the default: Mode.TOOLS
    assert client.mode == instructor.Mode.TOOLS
    weather = client.chat.completions.create(model=MODEL, response_model=Weather, messages=WEATHER_QUESTION,
                                             max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    assert isinstance(weather, Weather), weather
    partials = list(client.chat.completions.create_partial(
        model=MODEL, response_model=Weather, messages=WEATHER_QUESTION, max_tokens=MAX_TOKENS, temperature=0,
        max_retries=0))
    assert partials and Weather.model_validate(partials[-1].model_dump()), partials


@check
def instructor_json_schema_mode() -> None:
    client = instructor.from_openai(_openai(), mode=instructor.Mode.JSON_SCHEMA)
    weather = client.chat.completions.create(model=MODEL, response_model=Weather, messages=WEATHER_QUESTION,
                                             max_tokens=MAX_TOKENS, temperature=0, max_retries=0)
    assert isinstance(weather, Weather), weather
    raw = client.chat.completions.create(model=MODEL, response_model=None, messages=QUESTION,
                                         max_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(raw.choices[0].message.content, str), raw


def main() -> None:
    report: dict[str, Any] = {"versions": {name: metadata.version(name) for name in
                                           ("openai", "litellm", "langchain-openai", "langchain-core", "instructor")},
                              "checks": {}, "seconds": {}}
    for name, function in CHECKS.items():
        start = time.monotonic()
        try:
            function()
            report["checks"][name] = "ok"
        except Exception:  # noqa: BLE001 - every failure is reported, each check runs
            report["checks"][name] = traceback.format_exc(limit=8)
        report["seconds"][name] = round(time.monotonic() - start, 1)
    REPORT.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
