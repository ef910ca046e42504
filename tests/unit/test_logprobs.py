"""OpenAI-shaped logprobs (engine/output/logprobs.py): token text and exact bytes for byte-level and
SentencePiece vocabularies, the chosen token plus the top alternatives in order."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.tiny_models import build_tokenizer
from tokenmill.engine.output.logprobs import TokenBytes, build_token_logprobs

TEXT = "héllo wörld, 日本語 🙂 ḁ"  # the last character is rare: its three bytes are three tokens


def test_byte_level_bytes_rebuild_the_text_even_across_split_characters() -> None:
    tokenizer = build_tokenizer()
    vocab = TokenBytes(tokenizer)
    ids = tokenizer.encode(TEXT)
    assert b"".join(vocab(i) for i in ids).decode() == TEXT
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert vocab.describe(special, -1.0).token == "<|im_end|>"
    split = [i for i in ids if not _is_utf8(vocab(i))]  # tokens holding part of a character
    assert split and all("\ufffd" in vocab.describe(i, 0.0).token for i in split)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _sentencepiece_tokenizer() -> Any:
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581hello": 257, "\u2581": 258}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_sentencepiece_pieces_and_byte_fallbacks() -> None:
    vocab = TokenBytes(_sentencepiece_tokenizer())
    assert vocab(257) == b" hello" and vocab(258) == b" "
    assert vocab(1 + 0xE6) == b"\xe6"


def test_chosen_token_then_top_alternatives_most_likely_first() -> None:
    tokenizer = build_tokenizer()
    vocab = TokenBytes(tokenizer)
    a, b, c, d = tokenizer.encode("The quick brown fox")[:4]
    raw = [{a: -0.1, b: -3.0, c: -1.0}, {d: -5.0, a: -0.2, b: -0.9}]  # the sampler's entries: chosen first
    out = build_token_logprobs([a, d], raw, 2, vocab)
    assert [t.token_id for t in out] == [a, d] and [t.logprob for t in out] == [-0.1, -5.0]
    assert [[x.token_id for x in t.top_logprobs] for t in out] == [[a, c], [a, b]]
    assert out[1].token == tokenizer.decode([d]) and out[1].bytes == list(tokenizer.decode([d]).encode())
    assert build_token_logprobs([a], raw[:1], 0, vocab)[0].top_logprobs == []
