"""Turns a prompt (text, token ids or chat messages) into token ids with the model's tokenizer.
No torch; the tokenizer is any Hugging Face tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]


class PromptError(ValueError):
    """A prompt that cannot become a request.

    Attributes:
        code: machine-readable reason (``validation``, ``prompt_too_long``).
        num_prompt_tokens: the prompt's length when it was tokenized before failing, else 0.
    """

    def __init__(self, code: str, message: str, num_prompt_tokens: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.num_prompt_tokens = num_prompt_tokens


def tokenize_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt.

    Chat messages go through the tokenizer's chat template with the generation prompt added.

    Raises:
        PromptError: empty prompt, malformed messages, or no chat template.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("validation", "prompt is empty")
        return list(tokenizer(prompt)["input_ids"])
    items = list(prompt)
    if not items:
        raise PromptError("validation", "prompt is empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [t for t in items if isinstance(t, int)]
    if all(isinstance(m, Mapping) for m in items):
        return _apply_chat_template(tokenizer, [dict(m) for m in items if isinstance(m, Mapping)])
    raise PromptError("validation", "prompt must be a string, a list of token ids or a list of chat messages")


def _apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    for message in messages:
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise PromptError("validation", "each chat message needs string 'role' and 'content'")
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("validation", "this model has no chat template; send a prompt string or token ids")
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # noqa: BLE001 - templates are user Jinja code and can raise anything
        raise PromptError("validation", f"chat template failed: {exc}") from None
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]
