"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) as tokenmill submit options.

Every field a client may send is either passed through (its value then validated by the wire
schema, :class:`~protocol.sampling.SamplingParams`), accepted as a no-op, or refused with a
:class:`BodyError` naming it: never silently dropped. Pure: no I/O; never imports torch, the
engine, the worker or a web framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenmill.producer.openai_compat.errors import (
    BodyError as BodyError,  # re-exported: bulk input imports it from here
)
from tokenmill.producer.openai_compat.tools import ToolPlan, tool_plan

Endpoint = Literal["chat", "completions"]
ENDPOINTS: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint

# Accepted and ignored: they change nothing about the generation.
_IGNORED = frozenset({"user", "store", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options"})
# Passed through under the same name (OpenAI's sampling fields, and tokenmill extensions as vLLM has them).
_SAME_NAME = ("temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty", "top_k",
              "min_tokens", "stop_token_ids", "ignore_eos", "repetition_penalty", "speculative")
_CHAT_ONLY = frozenset({"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                        "tool_choice", "parallel_tool_calls", "functions", "function_call", "modalities", "audio",
                        "prediction", "reasoning_effort", "web_search_options"})
_COMPLETIONS_ONLY = frozenset({"prompt", "echo", "suffix", "best_of"})


@dataclass
class ParsedBody:
    """A body as submit options plus how to answer it."""

    endpoint: Endpoint
    options: dict[str, Any] = field(default_factory=dict)  # Producer.submit keyword arguments
    model: str | None = None  # the model the client named
    stream: bool = False  # answer with server-sent events
    include_usage: bool = False  # stream_options.include_usage: a last chunk carrying usage
    num_choices: int = 1  # n: the result's samples become the choices
    tools: ToolPlan | None = None  # chat with tools: the answer is read for tool calls


def parse_body(body: Mapping[str, Any], endpoint: Endpoint) -> ParsedBody:
    """Translate one request body.

    Raises:
        BodyError: a field is unknown, malformed, or asks for something this version cannot do.
    """
    parsed = ParsedBody(endpoint)
    handled = {"model", "stream", "max_tokens", "metadata", "priority", "logprobs", *_IGNORED, *_SAME_NAME}
    wrong_endpoint = _COMPLETIONS_ONLY if endpoint == "chat" else _CHAT_ONLY
    for name in body:
        if name in wrong_endpoint or (name not in handled and name not in _CHAT_ONLY | _COMPLETIONS_ONLY):
            raise BodyError(name, f"unknown or unsupported field for {_url(endpoint)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BodyError("model", "must be a string")
    parsed.model = model or None
    parsed.stream = _flag(body, "stream")
    parsed.include_usage = _include_usage(body)
    options = parsed.options
    if parsed.model is not None:
        options["model"] = parsed.model
    options.update({name: body[name] for name in _SAME_NAME if body.get(name) is not None})
    for name in ("metadata", "priority"):
        if body.get(name) is not None:
            options[name] = body[name]
    options["max_tokens"] = _max_tokens(body, endpoint)
    parsed.num_choices = _num_choices(body)
    _response_format(body, options)
    _logprobs(body, endpoint, options)
    if endpoint == "chat":
        _chat(body, options)
        parsed.tools = _tools(body, options)
    else:
        _completions(body, options)
    return parsed


def _url(endpoint: Endpoint) -> str:
    return next(url for url, name in ENDPOINTS.items() if name == endpoint)


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BodyError(name, "must be a boolean")
    return bool(value)


def _include_usage(body: Mapping[str, Any]) -> bool:
    stream_options = body.get("stream_options")
    if stream_options is None:
        return False
    if not isinstance(stream_options, Mapping):
        raise BodyError("stream_options", "must be an object")
    return _flag(stream_options, "include_usage")


def _max_tokens(body: Mapping[str, Any], endpoint: Endpoint) -> Any:
    """``max_completion_tokens`` over ``max_tokens`` (validated with the rest of the request)."""
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    if value is None and endpoint == "completions":
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return value


def _num_choices(body: Mapping[str, Any]) -> int:
    """``n`` (parallel samples of one request: ``SamplingParams.n``), checked against ``best_of``."""
    num_choices = body.get("n")
    if num_choices is None:
        num_choices = 1
    if not isinstance(num_choices, int) or isinstance(num_choices, bool) or num_choices < 1:
        raise BodyError("n", "must be a positive integer")
    best_of = body.get("best_of")
    if best_of is not None and best_of != num_choices:
        raise BodyError("best_of", "must equal n (no server-side best-of selection)")
    return num_choices


def _response_format(body: Mapping[str, Any], options: dict[str, Any]) -> None:
    value = body.get("response_format")
    if value is None:
        return
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise BodyError("response_format", 'must be an object with a "type"')
    if value["type"] == "text":
        return  # plain text is what every generation is
    options["response_format"] = dict(value)


def _logprobs(body: Mapping[str, Any], endpoint: Endpoint, options: dict[str, Any]) -> None:
    """Chat: ``logprobs`` (bool) + ``top_logprobs`` (int); completions: ``logprobs`` (int)."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if endpoint == "chat":
        if value is not None and not isinstance(value, bool):
            raise BodyError("logprobs", "must be a boolean (use top_logprobs for the number of alternatives)")
        if top is not None and not value:
            raise BodyError("top_logprobs", "needs logprobs: true")
        count = (top or 0) if value else None
    else:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BodyError("logprobs", "must be an integer (the number of alternatives per token)")
        count = value
    if count is not None:
        options["logprobs"] = count


def _tools(body: Mapping[str, Any], options: dict[str, Any]) -> ToolPlan | None:
    """The tools as the wire carries them (the worker renders them), and a forced call's schema as
    the response format (producer/openai_compat/tools.py)."""
    plan = tool_plan(body)
    if plan is not None:
        options["tools"] = plan.wire_tools()
        if plan.is_forced:
            options["response_format"] = plan.forced_format()
    return plan


def _chat(body: Mapping[str, Any], options: dict[str, Any]) -> None:
    if body.get("modalities") not in (None, ["text"]):
        raise BodyError("modalities", 'only ["text"] is supported')
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if body.get(name) is not None:
            raise BodyError(name, "not supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BodyError("messages", "must be a non-empty list of messages")
    options["messages"] = [_message(message, i) for i, message in enumerate(messages)]


def _message(message: Any, index: int) -> dict[str, Any]:
    """One chat message with its content as text (``developer`` is templated as ``system``; an
    assistant's ``tool_calls`` and a ``tool`` result's ``tool_call_id`` checked, for the template)."""
    if not isinstance(message, Mapping):
        raise BodyError(f"messages[{index}]", "must be an object")
    out = {key: value for key, value in message.items() if value is not None}
    if out.get("tool_calls") == []:  # NOTE: some clients send an empty list for "no calls"
        del out["tool_calls"]
    _check_tool_turn(out, index)
    content = out.get("content", "")
    if isinstance(content, list):
        out["content"] = "".join(_text_part(part, index) for part in content)
    elif not isinstance(content, str):
        raise BodyError(f"messages[{index}].content", "must be a string or a list of text parts")
    else:
        out["content"] = content
    if out.get("role") == "developer":
        out["role"] = "system"
    return out


def _check_tool_turn(message: Mapping[str, Any], index: int) -> None:
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise BodyError(f"messages[{index}].tool_calls", "only an assistant message has tool_calls, a list")
        for i, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if (not isinstance(call, Mapping) or call.get("type", "function") != "function"
                    or not isinstance(call.get("id"), str) or not isinstance(function, Mapping)
                    or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str)):
                raise BodyError(f"messages[{index}].tool_calls[{i}]",
                                'must be {"id", "type": "function", "function": {"name", "arguments": <JSON text>}}')
    if message.get("role") == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise BodyError(f"messages[{index}].tool_call_id", "a tool message answers a call: its id is required")


def _text_part(part: Any, index: int) -> str:
    text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None
    if isinstance(text, str):
        return text
    raise BodyError(f"messages[{index}].content", "only text parts are supported")


def _completions(body: Mapping[str, Any], options: dict[str, Any]) -> None:
    if body.get("echo"):
        raise BodyError("echo", "echo is not supported")
    if body.get("suffix"):
        raise BodyError("suffix", "suffix (insertion) is not supported")
    prompt = _one_prompt(body.get("prompt"))
    if isinstance(prompt, list):
        options["prompt_token_ids"] = prompt
    else:  # a completions prompt is raw text, never a chat turn (OpenAI's and vLLM's meaning)
        options.update(prompt=prompt, raw=True)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _one_prompt(prompt: Any) -> str | list[int]:
    """The prompt as text or token ids; a list holding one of them is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_ids(prompt[0])):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if _is_token_ids(prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BodyError("prompt", "one prompt per request: send several prompts as several requests")
    raise BodyError("prompt", "must be a non-empty string or a list of token ids")
