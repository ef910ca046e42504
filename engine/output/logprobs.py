"""Log-probabilities as users expect them (OpenAI's shape): for every generated token its id, text,
bytes and logprob, and the most likely alternatives (the vocabulary's TokenLogprob); the tokenizer is any
Hugging Face tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tokenmill.protocol.outcomes import TokenLogprob, TopLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback pieces


class TokenBytes:
    """The bytes each token id stands for, looked up on demand and cached.

    Byte-level BPE pieces (GPT-2, Llama 3, Qwen, SmolLM) map back through GPT-2's byte alphabet;
    SentencePiece pieces have ``▁`` for a space and ``<0xNN>`` byte fallbacks; special and added
    tokens are their own text.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._is_byte_level = _is_byte_level(tokenizer)
        self._added_ids = set(getattr(tokenizer, "added_tokens_decoder", {}))
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        if token_id not in self._cache:
            self._cache[token_id] = self._bytes_of(token_id)
        return self._cache[token_id]

    def describe(self, token_id: int, logprob: float) -> TopLogprob:
        data = self(token_id)
        return TopLogprob(token_id=token_id, token=data.decode("utf-8", errors="replace"), bytes=list(data),
                          logprob=logprob)

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._is_byte_level:
            return bytes(_BYTE_DECODER[ch] if ch in _BYTE_DECODER else ord(ch) % 256 for ch in piece)
        byte_token = _BYTE_TOKEN.fullmatch(piece)
        if byte_token:
            return bytes([int(byte_token.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


def build_token_logprobs(token_ids: Sequence[int], raw_logprobs: Sequence[dict[int, float]], num_top: int,
                         vocab: TokenBytes) -> list[TokenLogprob]:
    """OpenAI-shaped logprobs of one sequence of generated tokens.

    Args:
        token_ids: the generated tokens.
        raw_logprobs: the sampler's entries, one per token: the token's own logprob plus at least
            the ``num_top`` most likely tokens' (``RequestOutput.logprobs``).
        num_top: alternatives to keep per position (``SamplingParams.logprobs``).
        vocab: token bytes of the model's tokenizer.

    Returns:
        One entry per token (as many as both sequences have).
    """
    result: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, raw_logprobs):
        chosen = vocab.describe(token_id, entry[token_id])
        ranked = sorted(entry.items(), key=lambda item: -item[1])[:num_top]
        top = [vocab.describe(tid, value) for tid, value in ranked]
        result.append(TokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return result


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("decoder"))


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte alphabet, inverted: printable bytes stand for themselves, the rest are
    shifted to U+0100 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_BYTE_DECODER = _byte_decoder()
