"""Incremental token-to-text decoding for one request, with stop-string matching and hold-back.

Two decoders with one behaviour: :class:`IncrementalDetokenizer`, the reference, over any tokenizer with a
Hugging Face ``decode`` (two decodes of a short window per step, ~7 us a token with SmolLM2's tokenizer), and
:class:`StreamDetokenizer`, the fast path, over the ``tokenizers`` library's own streaming decoder
(``DecodeStream``, the same prefix/read-offset algorithm in Rust, under 1 us a token) for fast tokenizers.
:func:`make_detokenizer` picks; tests compare the two on the same tokens. Imports neither torch nor
transformers.
"""

from __future__ import annotations

from typing import Any, Protocol

# Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5 as well).
_NUM_PROMPT_CONTEXT_TOKENS = 5
# Drop consumed ids once this many sit before the decode window, so memory stays O(window).
_MAX_DEAD_TOKENS = 64
_REPLACEMENT_CHAR = "\ufffd"


def prompt_context(prompt_token_ids: list[int], special_ids: frozenset[int]) -> list[int]:
    """The prompt's last few ids that decode to text (special ones dropped): the first output tokens' context. Found
    from the end, so a request's decoder costs the same whatever its prompt's length."""
    tail = prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:]
    if special_ids.isdisjoint(tail):  # NOTE: the common case, in C (a pass per id cost 100 opcodes a request)
        return tail
    context: list[int] = []
    for token_id in reversed(prompt_token_ids):
        if token_id not in special_ids:
            context.append(token_id)
            if len(context) == _NUM_PROMPT_CONTEXT_TOKENS:
                break
    context.reverse()
    return context


def _dropped_ids(tokenizer: Any, skip_special_tokens: bool, special_ids: frozenset[int] | None) -> frozenset[int]:
    """The ids a decoder drops from the text: none when special tokens are kept, else the tokenizer's special ids
    (``special_ids`` where the caller keeps them; asked of the tokenizer otherwise)."""
    if not skip_special_tokens:
        return frozenset()
    return frozenset(tokenizer.all_special_ids) if special_ids is None else special_ids


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer this module uses."""

    @property
    def all_special_ids(self) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs: Any) -> Any: ...


class _StopStrings:
    """Stop strings and hold-back over the text a decoder produces (:meth:`_release`); the decoders below
    differ only in how token ids become text (``_decode_new``)."""

    _stop: list[str]
    _pending: str  # decoded text held back because it may start a stop string
    text: str  # all final text so far (stop string and what follows cut)
    stop_matched: str | None  # the stop string that matched, once one has

    def _init_stops(self, stop: list[str]) -> None:
        self._stop = list(stop)
        self._pending = ""
        self.text = ""
        self.stop_matched = None

    def _release(self, new_text: str, is_final: bool) -> str:
        """Appends decoded text, applies stop strings and returns what became final."""
        if not self._stop:  # NOTE: nothing to look for or hold back (most requests, every step)
            self.text += new_text
            return new_text
        pending = self._pending + new_text
        match_start, match = self._find_stop(pending)
        if match is not None:
            self.stop_matched = match
            delta, self._pending = pending[:match_start], ""
        else:
            num_held = 0 if is_final else self._num_stop_prefix_chars(pending)
            delta, self._pending = pending[: len(pending) - num_held], pending[len(pending) - num_held :]
        self.text += delta
        return delta

    def _find_stop(self, text: str) -> tuple[int, str | None]:
        """Earliest stop-string match in ``text`` (ties: first in ``stop``), as (start, stop)."""
        best_start, best = len(text), None
        for s in self._stop:
            start = text.find(s)
            if start != -1 and start < best_start:
                best_start, best = start, s
        return best_start, best

    def _num_stop_prefix_chars(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class IncrementalDetokenizer(_StopStrings):
    """Turns a request's output tokens into text, one step at a time (the reference decoder).

    Token level (prefix/read offsets, as vLLM and TGI do): ``ids[prefix_offset:read_offset]``
    is already-emitted context and ``ids[read_offset:]`` the new tokens. Each step decodes the
    window with and without the new tokens and emits the difference, so decoders whose output
    depends on neighbours (SentencePiece's leading "▁") get context, and each step costs
    O(window), not O(output)::

        ids:  ... | emitted earlier | context          | new tokens |
                                    ^prefix_offset     ^read_offset ^len(ids)

    The new text is held (offsets unchanged) while it ends in U+FFFD: byte-level BPE may have
    emitted only part of a multi-byte character.

    Text level: while the tail of the decoded text is a proper prefix of a stop string it is
    held back, so a stop string is never streamed out. Once a stop string matches, it and
    everything after are cut and further tokens are ignored.

    Invariant: ``text`` plus the held-back text equals
    ``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
    (for an empty prompt; a prompt only adds context), until a stop string matches.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        special_ids: frozenset[int] | None = None,
    ) -> None:
        """Prepares decoding after ``prompt_token_ids``.

        Args:
            tokenizer: decodes id lists to text (a transformers tokenizer).
            prompt_token_ids: the prompt; only its last few tokens are kept, as context.
            stop: stop strings, non-empty; the earliest match in the text wins.
            skip_special_tokens: drop special tokens from the text.
            special_ids: the tokenizer's special ids, where the caller keeps them (a tokenizer makes the list
                anew on each ask); None: asked here.
        """
        self._tokenizer = tokenizer
        self._init_stops(stop)
        self._skip_special_tokens = skip_special_tokens
        # NOTE: skipped special ids are dropped on entry: they decode to nothing, and keeping
        # them would stall the offsets and grow the window on runs of special tokens.
        self._special_ids = _dropped_ids(tokenizer, skip_special_tokens, special_ids)
        self._token_ids = prompt_context(prompt_token_ids, self._special_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def append(self, token_ids: list[int]) -> str:
        """Adds newly generated tokens.

        Args:
            token_ids: the tokens generated this step (usually one).

        Returns:
            The text that became final with them ("" while held back or after a stop matched).
        """
        if self.stop_matched is not None:
            return ""
        special_ids = self._special_ids
        # NOTE: the common case, no special id among them, tested in C (a request's whole output comes at once when
        # nobody streams it)
        self._token_ids += token_ids if special_ids.isdisjoint(token_ids) else [t for t in token_ids
                                                                                  if t not in special_ids]
        return self._release(self._decode_new(is_final=False), is_final=False)

    def finish(self) -> str:
        """Flushes everything held back, at the end of generation.

        Returns:
            The rest of the text (incomplete characters decode as U+FFFD), minus any stop string
            that completes within it; "" if a stop string had already matched.
        """
        if self.stop_matched is not None:
            return ""
        return self._release(self._decode_new(is_final=True), is_final=True)

    def _decode(self, token_ids: list[int]) -> str:
        text: str = self._tokenizer.decode(
            token_ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
        return text

    def _decode_new(self, is_final: bool) -> str:
        """Returns the text the tokens after ``read_offset`` add, advancing the offsets if final."""
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if not is_final and (len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR)):
            return ""  # NOTE: nothing new yet, or a multi-byte character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        if self._prefix_offset > _MAX_DEAD_TOKENS:
            del self._token_ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full_text[len(prefix_text) :]


class StreamDetokenizer(_StopStrings):
    """:class:`IncrementalDetokenizer`'s behaviour over ``tokenizers.decoders.DecodeStream`` (the fast path).

    ``DecodeStream.step`` returns the text a token completes, or None while a character is incomplete; the ids
    it holds back so are kept here, so :meth:`finish` decodes them as the reference does (U+FFFD for the
    incomplete bytes). Special ids are dropped on entry, as the reference drops them.

    Args:
        backend: the fast tokenizer's ``tokenizers.Tokenizer`` (``tokenizer.backend_tokenizer``).
        special_ids: ids dropped from the text (the tokenizer's special ids; empty keeps them).
        prompt_token_ids, stop: as :class:`IncrementalDetokenizer`'s.
    """

    def __init__(self, backend: Any, special_ids: frozenset[int], prompt_token_ids: list[int],
                 stop: list[str], skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream  # noqa: PLC0415 - only fast tokenizers come here

        self._backend = backend
        self._special_ids = special_ids
        self._init_stops(stop)
        context = prompt_context(prompt_token_ids, special_ids)
        self._skip_special_tokens = skip_special_tokens
        # NOTE: tokens the tokenizer itself marks special (added tokens) are skipped by it, as HF decode skips them
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # the last ids whose text is out (the last _NUM_PROMPT_CONTEXT_TOKENS of them: a final decode's context)
        self._emitted = list(context)
        self._held: list[int] = []  # ids the stream holds back (an incomplete character)

    def append(self, token_ids: list[int]) -> str:
        """As :meth:`IncrementalDetokenizer.append`."""
        if self.stop_matched is not None:
            return ""
        pieces = []
        stream, backend, special_ids, held, emitted = self._stream, self._backend, self._special_ids, self._held, \
            self._emitted
        for token_id in token_ids:
            if token_id in special_ids:
                continue
            piece = stream.step(backend, token_id)
            if piece is None:
                held.append(token_id)
                continue
            pieces.append(piece)
            if held:
                emitted += held
                held.clear()
            emitted.append(token_id)
        if len(emitted) > 4 * _NUM_PROMPT_CONTEXT_TOKENS:  # NOTE: trimmed now and then, not per token
            del emitted[:-_NUM_PROMPT_CONTEXT_TOKENS]
        return self._release(pieces[0] if len(pieces) == 1 else "".join(pieces), is_final=False)

    def finish(self) -> str:
        """As :meth:`IncrementalDetokenizer.finish`."""
        if self.stop_matched is not None:
            return ""
        rest = ""
        if self._held:
            context = self._emitted[-_NUM_PROMPT_CONTEXT_TOKENS:]
            prefix = self._backend.decode(context, skip_special_tokens=self._skip_special_tokens)
            rest = self._backend.decode(context + self._held,
                                        skip_special_tokens=self._skip_special_tokens)[len(prefix):]
            self._held = []
        return self._release(rest, is_final=True)


def make_detokenizer(tokenizer: Any, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                     special_ids: frozenset[int] | None = None) -> IncrementalDetokenizer | StreamDetokenizer:
    """The request's text decoder: the streaming fast path for a fast (``tokenizers``-backed) tokenizer, the
    reference otherwise (the echo model's byte tokenizer, slow tokenizers).

    Args:
        special_ids: the tokenizer's special ids, where the caller keeps them; None: asked of the tokenizer.
    """
    special_ids = _dropped_ids(tokenizer, skip_special_tokens, special_ids)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, stop, skip_special_tokens, special_ids)
    context = prompt_context(prompt_token_ids, special_ids)
    # NOTE: a prompt whose last tokens end inside a character (token ids given directly) makes DecodeStream emit
    # the context's own bytes with the first token; the reference handles it (rare: one decode to tell).
    if backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT_CHAR):
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, stop, skip_special_tokens, special_ids)
    return StreamDetokenizer(backend, special_ids, prompt_token_ids, stop, skip_special_tokens)
