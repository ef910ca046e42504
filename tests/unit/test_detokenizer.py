"""Unit tests of engine.output.detokenizer with real tokenizers built in code (byte-level BPE and
SentencePiece-style Metaspace): streaming equals full decode, U+FFFD hold-back, stop strings; each for the
reference decoder and the ``DecodeStream`` fast path, and the two compared token for token."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer
from transformers import PreTrainedTokenizerFast

from tokenmill.engine.output.detokenizer import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    make_detokenizer,
    prompt_context,
)

Detokenizer = IncrementalDetokenizer | StreamDetokenizer
New = Callable[..., Detokenizer]

CORPUS = [
    "héllo wörld 日本語 🙂 the quick brown fox jumps over the lazy dog",
    "hello world, hello there. Stop here. STOP! end of text",
    "naïve café señor 東京 ünïcödé ✓ → ∑",
]
MULTI_BYTE_TEXTS = ["héllo wörld 日本語 🙂", "🙂🙂 日本 ok", "€uro ☃ snow 😀 𝄞 clef", "a\u0301 combining", "東京タワー"]


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    # A small vocab keeps multi-byte characters split across several byte tokens.
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 5, vocab_size=300, min_frequency=2, special_tokens=["<|eos|>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|eos|>")


@pytest.fixture(scope="module")
def sp_tokenizer() -> PreTrainedTokenizerFast:
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS * 5, vocab_size=120, min_frequency=2, special_tokens=["</s>", "<unk>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp._tokenizer, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(params=["reference", "stream"])
def new(request: pytest.FixtureRequest) -> Callable[..., Detokenizer]:
    """Makes the decoder under test: the reference (HF ``decode``) or the fast path (``DecodeStream``)."""
    def make(tokenizer: PreTrainedTokenizerFast, prompt: list[int], stop: list[str],
             skip_special_tokens: bool = True) -> Detokenizer:
        if request.param == "reference":
            return IncrementalDetokenizer(tokenizer, prompt, stop, skip_special_tokens)
        detok = make_detokenizer(tokenizer, prompt, stop, skip_special_tokens)
        assert isinstance(detok, StreamDetokenizer)
        return detok
    return make


def full_decode(tokenizer: PreTrainedTokenizerFast, token_ids: list[int]) -> str:
    text = tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)
    return text


def stream(detok: Detokenizer, token_ids: list[int]) -> list[str]:
    deltas = [detok.append([t]) for t in token_ids]
    deltas.append(detok.finish())
    return deltas


def test_multi_byte_texts_stream_exactly(new: New, byte_tokenizer: PreTrainedTokenizerFast) -> None:
    for text in MULTI_BYTE_TEXTS:
        ids = byte_tokenizer.encode(text)
        assert any("\ufffd" in byte_tokenizer.decode([t]) for t in ids), "test needs split characters"
        detok = new(byte_tokenizer, [], [])
        deltas = stream(detok, ids)
        assert "".join(deltas) == text == detok.text
        assert not any("\ufffd" in d for d in deltas)
        assert deltas[-1] == ""  # nothing was left to flush


@pytest.mark.parametrize("tokenizer_name", ["byte_tokenizer", "sp_tokenizer"])
def test_random_ids_concatenate_to_full_decode(new: New, tokenizer_name: str, request: pytest.FixtureRequest) -> None:
    tokenizer: PreTrainedTokenizerFast = request.getfixturevalue(tokenizer_name)
    rng = random.Random(0)
    for trial in range(200):
        # Prompts decode cleanly (a prompt ending in half a character makes "output text" ambiguous).
        prompt = tokenizer.encode(" ".join(rng.sample(CORPUS[0].split(), rng.randrange(0, 4))))
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        detok = new(tokenizer, prompt, [])
        chunks: list[int] = []
        deltas: list[str] = []
        for t in ids:  # feed 1-3 tokens at a time
            chunks.append(t)
            if rng.random() < 0.5:
                deltas.append(detok.append(chunks))
                chunks = []
        deltas.append(detok.append(chunks))
        deltas.append(detok.finish())
        # The output's text is what it adds to the prompt's (the first token may gain a space).
        expected = full_decode(tokenizer, prompt + ids)[len(full_decode(tokenizer, prompt)) :]
        got = "".join(deltas)
        assert got == expected, (trial, prompt, ids)
        assert got == detok.text
        if "\ufffd" not in expected:
            assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("tokenizer_name", ["byte_tokenizer", "sp_tokenizer"])
def test_a_whole_output_in_one_append_decodes_as_token_by_token(new: New, tokenizer_name: str,
                                                                 request: pytest.FixtureRequest) -> None:
    """A request nobody streams is decoded once, when it finishes (engine/output/output_processor.py): the same
    text as streaming it token by token."""
    tokenizer: PreTrainedTokenizerFast = request.getfixturevalue(tokenizer_name)
    rng = random.Random(1)
    for trial in range(100):
        prompt = tokenizer.encode(" ".join(rng.sample(CORPUS[0].split(), rng.randrange(0, 4))))
        ids = tokenizer.encode(rng.choice(CORPUS + MULTI_BYTE_TEXTS))[rng.randrange(0, 3):]
        ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 5))]
        streamed = new(tokenizer, prompt, [])
        stream(streamed, ids)
        at_once = new(tokenizer, prompt, [])
        at_once.append(ids)
        at_once.finish()
        assert at_once.text == streamed.text, (trial, prompt, ids)


def test_special_tokens_skipped_or_kept(new: New, byte_tokenizer: PreTrainedTokenizerFast) -> None:
    eos = byte_tokenizer.eos_token_id
    ids = byte_tokenizer.encode("hello") + [eos, eos] + byte_tokenizer.encode(" world")
    assert "".join(stream(new(byte_tokenizer, [], []), ids)) == "hello world"
    kept = "".join(stream(new(byte_tokenizer, [], [], skip_special_tokens=False), ids))
    assert kept == "hello<|eos|><|eos|> world"


def test_sentencepiece_leading_spaces(new: New, sp_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = sp_tokenizer.encode("hello world the fox")
    assert "".join(stream(new(sp_tokenizer, [], []), ids)) == "hello world the fox"
    prompt = sp_tokenizer.encode("hello")
    # After a prompt, the first word keeps its space: it continues the prompt's text.
    assert "".join(stream(new(sp_tokenizer, prompt, []), ids)) == " hello world the fox"


def run_with_stop(
    new: New,    tokenizer: PreTrainedTokenizerFast, text: str, stop: list[str]
) -> tuple[Detokenizer, list[str]]:
    detok = new(tokenizer, [], stop)
    return detok, stream(detok, tokenizer.encode(text))


def test_stop_spanning_tokens_is_cut_and_never_streamed(new: New, byte_tokenizer: PreTrainedTokenizerFast) -> None:
    detok, deltas = run_with_stop(new, byte_tokenizer, "hello world, Stop here. end of text", ["Stop here"])
    assert detok.stop_matched == "Stop here"
    assert detok.text == "".join(deltas) == "hello world, "
    assert not any("S" in d for d in deltas)
    assert detok.append(byte_tokenizer.encode(" more")) == "" and detok.finish() == ""


def test_stop_at_the_very_start(new: New, byte_tokenizer: PreTrainedTokenizerFast) -> None:
    detok, deltas = run_with_stop(new, byte_tokenizer, "STOP! hello", ["STOP"])
    assert detok.stop_matched == "STOP" and detok.text == "" and deltas == [""] * len(deltas)


def test_two_stop_strings_earliest_wins(new: New, byte_tokenizer: PreTrainedTokenizerFast) -> None:
    detok, _ = run_with_stop(new, byte_tokenizer, "the quick brown fox jumps", ["fox", "quick"])
    assert detok.stop_matched == "quick" and detok.text == "the "
    detok, _ = run_with_stop(new, byte_tokenizer, "the quick brown fox jumps", ["brown fox", "own"])
    assert detok.stop_matched == "own" and detok.text == "the quick br"


def test_stop_prefix_held_then_released(new: New, byte_tokenizer: PreTrainedTokenizerFast) -> None:
    detok = new(byte_tokenizer, [], ["hello!"])
    streamed = "".join(detok.append([t]) for t in byte_tokenizer.encode("say hello"))
    assert streamed == "say "  # "hello" could still become "hello!"
    assert detok.append(byte_tokenizer.encode(" there")) == "hello there"
    detok = new(byte_tokenizer, [], ["hello!"])
    streamed = "".join(detok.append([t]) for t in byte_tokenizer.encode("say hell"))
    assert detok.finish() == "hell" and detok.stop_matched is None
    assert streamed + "hell" == detok.text == "say hell"


def test_multi_byte_stop_string(new: New, byte_tokenizer: PreTrainedTokenizerFast) -> None:
    detok, deltas = run_with_stop(new, byte_tokenizer, "héllo wörld 日本語 🙂", ["本語"])
    assert detok.stop_matched == "本語" and detok.text == "".join(deltas) == "héllo wörld 日"


def test_stop_completing_in_finish(new: New, byte_tokenizer: PreTrainedTokenizerFast) -> None:
    # The last token leaves an incomplete character, so the stop only appears at finish().
    ids = byte_tokenizer.encode("ab 日")
    detok = new(byte_tokenizer, [], ["b \ufffd"])
    for t in ids[:-1]:
        detok.append([t])
    assert detok.finish() == "" and detok.stop_matched == "b \ufffd" and detok.text == "a"


def test_long_output_keeps_window_small(byte_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = byte_tokenizer.encode("the quick brown fox 日本語 🙂 " * 200)
    detok = IncrementalDetokenizer(byte_tokenizer, byte_tokenizer.encode("prompt " * 100), [])
    for t in ids:
        detok.append([t])
        assert len(detok._token_ids) <= 80
    detok.finish()
    assert detok.text == full_decode(byte_tokenizer, ids)


@pytest.mark.parametrize("tokenizer_name", ["byte_tokenizer", "sp_tokenizer"])
def test_the_fast_path_decodes_what_the_reference_decodes(tokenizer_name: str, request: pytest.FixtureRequest) -> None:
    """Token for token: the same deltas' concatenation, the same stop match and text, random ids and stops."""
    tokenizer: PreTrainedTokenizerFast = request.getfixturevalue(tokenizer_name)
    rng = random.Random(1)
    for trial in range(300):
        prompt = tokenizer.encode(" ".join(rng.sample(CORPUS[1].split(), rng.randrange(0, 4))))
        if trial % 3 == 0:  # NOTE: token-id prompts may end inside a character (then the reference decodes)
            prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 8))]
        text_ids = tokenizer.encode(rng.choice(CORPUS + MULTI_BYTE_TEXTS))
        ids = text_ids if rng.random() < 0.5 else [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        stop = rng.sample(["o w", "日本", "the", "STOP", "\ufffd", "🙂"], rng.randrange(0, 3))
        reference = IncrementalDetokenizer(tokenizer, prompt, stop)
        fast = make_detokenizer(tokenizer, prompt, stop)
        ref_text = "".join(reference.append([t]) for t in ids) + reference.finish()
        fast_text = "".join(fast.append([t]) for t in ids) + fast.finish()
        assert (fast_text, fast.text, fast.stop_matched) == (ref_text, reference.text, reference.stop_matched), \
            (trial, prompt, ids, stop)


def test_tokenizers_without_a_fast_backend_get_the_reference() -> None:
    class Plain:
        all_special_ids: list[int] = []

        def decode(self, token_ids: list[int], **_: object) -> str:
            return "".join(map(chr, token_ids))

    assert isinstance(make_detokenizer(Plain(), [], []), IncrementalDetokenizer)


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 6), max_size=30), special=st.frozensets(st.integers(0, 6), max_size=3))
def test_the_prompt_context_is_the_last_ids_that_are_not_special(prompt, special):
    assert prompt_context(prompt, special) == [t for t in prompt if t not in special][-5:]
