"""Plain prompts travel as one user message by default (chat for instruct models): a model without
a chat template reads that lone message as its raw prompt, and refuses anything more."""

from __future__ import annotations

from typing import Any

import pytest

from tokenmill.engine.output.prompts import ChatPrompt, PromptError, TextPrompt, tokenize_prompt


class _BaseModelTokenizer:
    """A tokenizer with no chat template: token ids are the UTF-8 bytes."""

    chat_template = None

    def __call__(self, texts: list[str], **kwargs: Any) -> dict[str, Any]:
        return {"input_ids": [list(text.encode()) for text in texts]}


def test_a_lone_user_message_is_the_raw_prompt_of_a_model_without_a_chat_template() -> None:
    tokenizer = _BaseModelTokenizer()
    as_chat = tokenize_prompt(tokenizer, ChatPrompt([{"role": "user", "content": "Once upon"}]))
    assert as_chat == tokenize_prompt(tokenizer, TextPrompt("Once upon")) == list(b"Once upon")
    with pytest.raises(PromptError, match="no chat template"):
        tokenize_prompt(tokenizer, ChatPrompt([{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Once upon"}]))
