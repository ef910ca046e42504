"""Tool calling with the real SmolLM2-135M-Instruct behind ``tokenmill serve``: its chat template
knows no tools, so they reach it as a system preamble; a named ``tool_choice`` and ``required`` are
forced through the grammar engine, so even this tiny model answers calls whose arguments follow
the function's schema; the next turn's call and ``tool`` result are rendered into the prompt the
worker runs (its token count is the one the server reports)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.serve_helpers import running_server
from tests.worker_helpers import make_settings, running_worker
from tokenmill.engine.model.model_loader import resolve_model_path
from tokenmill.engine.output.prompts import ChatPrompt, renders_tools, tokenize_prompt
from tokenmill.producer.openai_compat import parse_body
from tokenmill.producer.submit_options import build_request
from tokenmill.protocol.keys import Keys
from tokenmill.worker.convert import engine_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-135m"
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris? And what is 2 + 3?"}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (ADD, WEATHER)}  # type: ignore[index]


def _arguments(call: Any) -> dict[str, Any]:
    """A call's arguments: JSON text of an object that follows its function's schema."""
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return dict(arguments)


def test_forced_calls_follow_the_schema_and_the_result_renders_on_the_next_turn(redis_url: str,
                                                                                key_prefix: str) -> None:
    settings = make_settings(redis_url, key_prefix, model=MODEL, engine={
        "model": {"device": "cpu"}, "cache": {"kv_cache_memory": "64MiB", "swap_space": 0}})
    with running_worker(settings), running_server(redis_url, key_prefix) as url, \
            openai.OpenAI(base_url=url, api_key="none") as client:
        named = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, ADD], max_tokens=64,
                                               tool_choice={"type": "function", "function": {"name": "add"}})
        required = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, ADD],
                                                  tool_choice="required", max_tokens=96)
        [call] = named.choices[0].message.tool_calls or []
        next_turn: list[Any] = [*QUESTION, named.choices[0].message.model_dump(exclude_none=True),
                                {"role": "tool", "tool_call_id": call.id, "content": "The sum is 5."}]
        answer = client.chat.completions.create(model=MODEL, messages=next_turn, tools=[WEATHER, ADD],
                                                tool_choice="none", max_tokens=32)
    assert named.choices[0].finish_reason == "tool_calls" and named.choices[0].message.content is None
    assert call.function.name == "add" and call.id.startswith("call_") and set(_arguments(call)) == {"a", "b"}
    calls = required.choices[0].message.tool_calls or []
    assert calls and required.choices[0].finish_reason == "tool_calls", required
    for each in calls:
        _arguments(each)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    tokenizer = _smollm2_tokenizer()
    assert not renders_tools(tokenizer.chat_template), "SmolLM2's template drops tools: the preamble carries them"
    prompt = engine_prompt(build_request(Keys(), parse_body({"model": MODEL, "messages": next_turn,
                                                             "tool_choice": "none"}, "chat").options))
    assert isinstance(prompt, ChatPrompt) and prompt.tools is None, "tool_choice none: the tools are not rendered"
    token_ids = tokenize_prompt(tokenizer, prompt)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(token_ids), "the worker ran this prompt"
    text = tokenizer.decode(token_ids)
    written_call = json.dumps({"name": "add", "arguments": json.loads(call.function.arguments)})
    assert f"<|im_start|>assistant\n{written_call}<|im_end|>" in text, text
    assert "<|im_start|>user\nadd returned: The sum is 5.<|im_end|>\n<|im_start|>assistant\n" in text, text


def _smollm2_tokenizer() -> Any:
    gguf = resolve_model_path(MODEL)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # type: ignore[union-attr]
