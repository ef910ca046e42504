"""Structured output: compiles a request's ``response_format`` into an xgrammar grammar over the
model's vocabulary, once per distinct spec (an LRU cache, thread-safe, meant to run on the worker's
tokenizer thread, never on the engine thread), and makes per-request matchers from it.

xgrammar (and with it torch) is imported on first use, so importing this module costs nothing.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from engine.errors import GrammarError
from protocol.sampling import ResponseFormat

DEFAULT_MAX_CACHED = 256
# xgrammar's C++ errors start with "[time] /path/file.cc:line: " (and sometimes a failed check): drop that.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+: (Check failed: \(.*?\) is false: )?")


class GrammarCompiler:
    """Compiles response formats for one tokenizer and caches the results by spec.

    JSON is generated compactly (no free whitespace between tokens, so a small model cannot pad
    an object with newlines until it runs out of tokens) and strictly (no undeclared properties).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the ids that end a complete output.
        max_cached: compiled grammars kept; the least recently used one goes first.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 max_cached: int = DEFAULT_MAX_CACHED) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._max_cached = max_cached
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on first use
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, response_format: ResponseFormat) -> Any:
        """The compiled grammar of ``response_format`` (from the cache when it was compiled before).

        Raises:
            GrammarError: the schema, regex or grammar is invalid, or xgrammar is not installed.
        """
        key = response_format.cache_key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, response_format)
        except RuntimeError as exc:
            message = _NATIVE_PREFIX.sub("", str(exc).strip()).splitlines()[0]
            raise GrammarError(f"invalid response_format {response_format.type}: {message}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, response_format: ResponseFormat) -> Any:
        """A fresh matcher (an ``xgrammar.GrammarMatcher``) at the start of the output."""
        import xgrammar  # noqa: PLC0415 - imported with the first structured request

        return xgrammar.GrammarMatcher(self.compile(response_format))

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar  # noqa: PLC0415 - heavy (torch); only structured output needs it
            except ImportError:
                raise GrammarError("structured output needs the xgrammar package (pip install xgrammar)") from None
            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self._eos_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def _compile(compiler: Any, response_format: ResponseFormat) -> Any:
    kind = response_format.type
    if kind == "regex":
        return compiler.compile_regex(response_format.regex)
    if kind == "grammar":
        return compiler.compile_grammar(response_format.grammar)
    if kind == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    elif kind == "json_schema" and response_format.json_schema is not None:
        schema = response_format.json_schema.schema_
    else:
        raise GrammarError(f"response_format {kind!r} needs no grammar")
    return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
