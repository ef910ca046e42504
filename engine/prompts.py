"""Prompts as a sum type (text, chat messages, token ids) and their tokenization with the model's
tokenizer. No torch; the tokenizer is any Hugging Face tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.outcomes import ErrorCode


@dataclass(frozen=True)
class TextPrompt:
    """Raw text, tokenized as is (no chat template)."""

    text: str


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages (``{"role", "content", ...}``), rendered by the model's chat template with the
    generation prompt added."""

    messages: Sequence[Mapping[str, Any]]


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
    return _apply_chat_template(tokenizer, [dict(m) for m in prompt.messages])


def _apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    for message in messages:
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise PromptError(ErrorCode.VALIDATION, "each chat message needs string 'role' and 'content'")
    if not getattr(tokenizer, "chat_template", None):
        # NOTE: producers send plain prompts as one user message by default (chat for instruct
        # models); a base model without a template reads that message's text as the raw prompt.
        if len(messages) == 1 and messages[0]["role"] == "user" and messages[0]["content"]:
            return _encode(tokenizer, messages[0]["content"])
        raise PromptError(ErrorCode.VALIDATION,
                          "this model has no chat template; send a prompt string or token ids")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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
    return [int(t) for t in ids]
