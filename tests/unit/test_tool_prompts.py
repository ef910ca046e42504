"""Tools in the prompt: a chat template that renders tools gets them (and earlier calls' arguments as
objects); one that does not gets a system preamble describing the functions and the call format,
and the earlier calls and their results as text that the answer parser reads back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.tiny_models import CHAT_TEMPLATE, build_tokenizer
from tokenmill.engine.output.prompts import ChatPrompt, renders_tools, tokenize_prompt, tools_preamble
from tokenmill.producer.openai_compat.tool_calls import ToolCall, parse_answer
from tokenmill.protocol.schema import GenerationRequest
from tokenmill.worker.convert import engine_prompt

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
CALLED = [{"role": "user", "content": "Weather in Paris and the time?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
              {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
          {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
# A Hermes-style template, as Qwen 2.5's renders tools and calls.
HERMES = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _rendered(tokenizer: Any, template: str, messages: list[dict[str, Any]],
              tools: list[dict[str, Any]] | None) -> str:
    tokenizer.chat_template = template
    text: str = tokenizer.decode(tokenize_prompt(tokenizer, ChatPrompt(messages, tools=tools)))
    return text


def test_a_template_without_tools_gets_a_preamble_as_its_system_message(tokenizer: Any) -> None:
    assert not renders_tools(CHAT_TEMPLATE)
    text = _rendered(tokenizer, CHAT_TEMPLATE, [{"role": "user", "content": "Weather in Paris?"}], [WEATHER, NOW])
    preamble = tools_preamble([WEATHER, NOW])
    assert text == f"<|im_start|>system\n{preamble}<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert json.dumps(WEATHER["function"]) in preamble and '{"name": "now"}' in preamble
    assert '"arguments"' in preamble and "JSON array" in preamble, "the call format is spelt out"
    with_system = _rendered(tokenizer, CHAT_TEMPLATE, [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Hi"}], [NOW])
    assert with_system.startswith(f"<|im_start|>system\nBe brief.\n\n{tools_preamble([NOW])}<|im_end|>\n")
    assert with_system.count("<|im_start|>system") == 1


def test_earlier_calls_and_results_render_as_text_the_parser_reads_back(tokenizer: Any) -> None:
    text = _rendered(tokenizer, CHAT_TEMPLATE, CALLED, [WEATHER, NOW])
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_answer(assistant, frozenset({"get_weather", "now"})).calls == (
        ToolCall("get_weather", '{"city":"Paris"}'), ToolCall("now", "{}"))
    assert "<|im_start|>user\nget_weather returned: 22 C\nnow returned: noon<|im_end|>\n<|im_start|>assistant\n" \
           in text, "the results are one user turn naming their functions"
    assert "<|im_start|>tool" not in text
    no_tools = _rendered(tokenizer, CHAT_TEMPLATE, CALLED, None)
    assert "<|im_start|>system" not in no_tools and "get_weather returned: 22 C" in no_tools


def test_a_template_that_renders_tools_gets_them_and_calls_with_object_arguments(tokenizer: Any) -> None:
    assert renders_tools(HERMES)
    text = _rendered(tokenizer, HERMES, CALLED, [WEATHER])
    assert text.startswith(f"<|im_start|>system\n<tools>{json.dumps(WEATHER)}</tools><|im_end|>\n")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text, \
        "arguments as an object, not JSON text encoded again"
    assert "<|im_start|>tool\n22 C<|im_end|>" in text, "the template's own tool role"
    assert "You can call" not in text


def test_the_worker_hands_the_wire_tools_to_the_template() -> None:
    request = GenerationRequest.model_validate({"messages": CALLED, "tools": [WEATHER, NOW]})
    prompt = engine_prompt(request)
    assert isinstance(prompt, ChatPrompt) and prompt.tools == [WEATHER, NOW]
    assert prompt.messages[1]["tool_calls"] == CALLED[1]["tool_calls"]
    plain = engine_prompt(GenerationRequest.model_validate({"messages": CALLED[:1]}))
    assert isinstance(plain, ChatPrompt) and plain.tools is None
