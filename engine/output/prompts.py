"""Prompts as a sum type (text, chat messages, token ids) and their tokenization with the model's
tokenizer. No torch; the tokenizer is any Hugging Face tokenizer."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.protocol.outcomes import ErrorCode


@dataclass(frozen=True)
class TextPrompt:
    """Raw text, tokenized as is (no chat template)."""

    text: str


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages (``{"role", "content", ...}``), rendered by the model's chat template with the
    generation prompt added, and the function tools the model may call (OpenAI's
    ``{"type": "function", "function": {"name", "description", "parameters"}}``), rendered by the
    template when it knows tools, else as a system preamble (:func:`tools_preamble`)."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class TokensPrompt:
    """Token ids, used as they are."""

    token_ids: Sequence[int]


Prompt = TextPrompt | ChatPrompt | TokensPrompt
# What the offline API (Engine.generate) also takes: a str, a list of token ids, or a list of messages.
PromptLike = Prompt | str | Sequence[int] | Sequence[Mapping[str, Any]]


class PromptError(ValueError):
    """A prompt that cannot become a request.

    Attributes:
        code: machine-readable reason.
        num_prompt_tokens: the prompt's length when it was tokenized before failing, else 0.
    """

    def __init__(self, code: ErrorCode, message: str, num_prompt_tokens: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.num_prompt_tokens = num_prompt_tokens


def as_prompt(value: PromptLike) -> Prompt:
    """The typed prompt of a loosely given one (the offline API's convenience; the worker builds typed
    prompts from the wire fields directly).

    Raises:
        PromptError: ``value`` is none of the three forms.
    """
    if isinstance(value, (TextPrompt, ChatPrompt, TokensPrompt)):
        return value
    if isinstance(value, str):
        return TextPrompt(value)
    items = list(value)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return TokensPrompt([int(t) for t in items if isinstance(t, int)])
    if items and all(isinstance(m, Mapping) for m in items):
        return ChatPrompt([m for m in items if isinstance(m, Mapping)])
    raise PromptError(ErrorCode.VALIDATION,
                      "prompt must be a string, a non-empty list of token ids or a non-empty list of chat messages")


def tokenize_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt.

    Raises:
        PromptError: empty prompt, malformed messages, or no chat template.
    """
    if isinstance(prompt, TokensPrompt):
        if not prompt.token_ids:
            raise PromptError(ErrorCode.VALIDATION, "prompt is empty")
        return list(prompt.token_ids)
    if isinstance(prompt, TextPrompt):
        if not prompt.text:
            raise PromptError(ErrorCode.VALIDATION, "prompt is empty")
        return _encode(tokenizer, prompt.text)
    if not prompt.messages:
        raise PromptError(ErrorCode.VALIDATION, "prompt is empty")
    return _apply_chat_template(tokenizer, [dict(m) for m in prompt.messages],
                                [dict(t) for t in prompt.tools] if prompt.tools else None)


def _apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None = None) -> list[int]:
    for message in messages:
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise PromptError(ErrorCode.VALIDATION, "each chat message needs string 'role' and 'content'")
    template = getattr(tokenizer, "chat_template", None)
    extra: dict[str, Any] = {}
    if renders_tools(template):
        messages = [_with_parsed_arguments(message) for message in messages]
        if tools:
            extra["tools"] = tools
    else:
        messages = _tool_turns_as_text(messages)
        if tools:
            messages = _with_preamble(messages, tools_preamble(tools))
    if not template:
        # NOTE: producers send plain prompts as one user message by default (chat for instruct
        # models); a base model without a template reads that message's text as the raw prompt.
        if len(messages) == 1 and messages[0]["role"] == "user" and messages[0]["content"]:
            return _encode(tokenizer, messages[0]["content"])
        raise PromptError(ErrorCode.VALIDATION,
                          "this model has no chat template; send a prompt string or token ids")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    except Exception as exc:  # noqa: BLE001 - templates are user Jinja code and can raise anything
        raise PromptError(ErrorCode.VALIDATION, f"chat template failed: {exc}") from None
    # NOTE: as apply_chat_template(tokenize=True) does: the template writes the special tokens itself.
    return _encode(tokenizer, text, add_special_tokens=False)


def _encode(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer(text)``'s ids, computed as a batch of one.

    NOTE: a Hugging Face fast tokenizer releases the GIL while it encodes a batch, not a single
    text: a 3.9 MB prompt held it for 2.4 s, stalling every engine step and every other
    preparation meanwhile (as a batch: 0.2 s at most, for the Python lists of its result).
    """
    ids = tokenizer([text], add_special_tokens=add_special_tokens)["input_ids"][0]
    return list(map(int, ids))  # NOTE: in C: a Python pass cost 9 opcodes a prompt token


def renders_tools(chat_template: Any) -> bool:
    """Whether a chat template renders ``tools`` itself (Hermes, Qwen 2.5, Llama 3.1, Mistral ...):
    a template that never names the variable would drop them silently (SmolLM2's does)."""
    return bool(chat_template) and "tools" in str(chat_template)


# NOTE: the call format asked for here, and written for an assistant's earlier calls (_calls_text), is
# the one producer/openai_compat/tool_calls.py parses back and a forced call's JSON schema produces;
# tests/unit/test_tool_calls.py reads a rendered call back as a call.
_PREAMBLE = """You can call the following functions. Each line is one function: its name, what it does, and \
the JSON Schema of its arguments.
{functions}

To call a function, answer with nothing but a JSON object of this form:
{{"name": "<the function's name>", "arguments": {{<its arguments, as its schema says>}}}}
To call several functions at once, answer with a JSON array of such objects. If no function is needed, \
answer as usual."""


def tools_preamble(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that tells a model whose template knows no tools what it may call and how."""
    functions = [tool.get("function") or {} for tool in tools]
    lines = [json.dumps({key: function[key] for key in ("name", "description", "parameters") if key in function},
                        ensure_ascii=False) for function in functions]
    return _PREAMBLE.format(functions="\n".join(lines))


def _with_preamble(messages: list[dict[str, Any]], preamble: str) -> list[dict[str, Any]]:
    """``preamble`` as the system message, after the conversation's own system text if it has one."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        content = f"{first['content']}\n\n{preamble}" if first["content"] else preamble
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def _arguments(call: Mapping[str, Any]) -> Any:
    """A call's arguments as a value: OpenAI sends them as a JSON string; templates and the
    preamble's format want the object (text that is no JSON stays the text)."""
    arguments = (call.get("function") or {}).get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` with their arguments as objects, as Hugging Face
    templates expect them (a string would be rendered JSON-encoded twice)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    parsed = [{**call, "function": {**(call.get("function") or {}), "arguments": _arguments(call)}}
              if isinstance(call, Mapping) else call for call in calls]
    return {**message, "tool_calls": parsed}


def _tool_turns_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: an assistant's calls become its text, in
    the preamble's format, and each run of ``tool`` results becomes one user message naming the
    function each answers (a template that knows no tools knows no ``tool`` role either)."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from the assistant turns so far
    out: list[dict[str, Any]] = []
    after_tool = False
    for message in messages:
        calls = message.get("tool_calls")
        if message["role"] == "tool":
            name = names.get(str(message.get("tool_call_id")), message.get("name") or "the function")
            line = f"{name} returned: {message['content']}"
            if after_tool:
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line})
            after_tool = True
            continue
        after_tool = False
        if message["role"] == "assistant" and isinstance(calls, list) and calls:
            calls = [call for call in calls if isinstance(call, Mapping)]
            names.update({str(call.get("id")): str((call.get("function") or {}).get("name")) for call in calls})
            message = {key: value for key, value in message.items() if key != "tool_calls"}
            message["content"] = "\n".join(filter(None, [message["content"], _calls_text(calls)]))
        out.append(message)
    return out


def _calls_text(calls: list[Mapping[str, Any]]) -> str:
    """Calls in the preamble's format: one JSON object, or an array of them."""
    written = [{"name": (call.get("function") or {}).get("name"), "arguments": _arguments(call)} for call in calls]
    return json.dumps(written[0] if len(written) == 1 else written, ensure_ascii=False)
