"""The tokenizer of a model that has none: a random-weight model built from a bare ``config.json``
(``[engine.model] random_init``), run to measure speed at any shape.

Prompts must be token ids: text and chat messages are refused with a ``validation`` error that
says so. Outputs carry their token ids; their text is empty, so stop strings never match. Imports
nothing heavy.
"""

from __future__ import annotations

from typing import Any

from tokenmill.engine.output.prompts import PromptError
from tokenmill.protocol.outcomes import ErrorCode


class NoTokenizer:
    """Stands in for a Hugging Face tokenizer where the engine needs one (prompts, detokenizing,
    logprob token bytes).

    Args:
        model_name: named in the error a text prompt gets.
    """

    chat_template = None
    eos_token_id = None
    all_special_ids: list[int] = []
    added_tokens_decoder: dict[int, Any] = {}

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def __call__(self, text: str, **kwargs: Any) -> Any:
        raise PromptError(ErrorCode.VALIDATION,
                          f"model {self.model_name!r} has no tokenizer (random weights from a config): "
                          "send prompt_token_ids, not text or chat messages")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        return ""

    def convert_ids_to_tokens(self, token_id: int) -> None:
        return None
