"""Structured output: compiles a request's ``response_format`` into an xgrammar grammar over the
model's vocabulary, once per distinct spec (an LRU cache, thread-safe, meant to run on the worker's
preparation threads, never on the engine thread; the compile itself runs in a child process under
a time and memory limit: engine/sample/grammar_process.py), and makes per-request matchers from it.

xgrammar (and with it torch) is imported on first use, so importing this module costs nothing.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Protocol

from tokenmill.engine.errors import GrammarError
from tokenmill.engine.sample.grammar_bounds import GrammarBounds, analyze
from tokenmill.engine.sample.grammar_process import CompileLimits, GrammarProcess, compile_spec, describe_native_error
from tokenmill.protocol.sampling import ResponseFormat

DEFAULT_MAX_CACHED = 256


class Grammars(Protocol):
    """What the engine needs of structured output: :class:`GrammarCompiler`, or the echo model's
    ``AnyGrammar`` (engine/echo.py), which accepts every spec."""

    def compile(self, response_format: ResponseFormat) -> Any:
        """Compile ``response_format`` (or find it compiled).

        Raises:
            GrammarError: the spec is invalid or cannot be compiled within the limits.
        """


class GrammarCompiler:
    """Compiles response formats for one tokenizer and caches the results by spec.

    JSON is generated compactly (no free whitespace between tokens, so a small model cannot pad
    an object with newlines until it runs out of tokens) and strictly (no undeclared properties).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: the ids that end a complete output.
        max_cached: compiled grammars kept; the least recently used one goes first.
        limits: compile each spec in a child process under these limits (engine/sample/grammar_process.py);
            None compiles in the calling thread, unbounded (tests of the grammars themselves).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 max_cached: int = DEFAULT_MAX_CACHED, limits: CompileLimits | None = None) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._max_cached = max_cached
        self._limits = limits
        self._info: Any = None  # xgrammar.TokenizerInfo, built on first use
        self._compiler: Any = None  # xgrammar.GrammarCompiler (in-thread compiles)
        self._process: GrammarProcess | None = None  # the child of isolated compiles
        self._cache: OrderedDict[str, tuple[Any, GrammarBounds]] = OrderedDict()  # key -> (compiled, bounds)
        self._lock = threading.Lock()

    def is_cached(self, response_format: ResponseFormat) -> bool:
        """Whether compiling ``response_format`` would be a cache hit (nothing to wait for)."""
        with self._lock:
            return response_format.cache_key in self._cache

    def compile(self, response_format: ResponseFormat) -> Any:
        """The compiled grammar of ``response_format`` (from the cache when it was compiled before).

        Raises:
            GrammarError: the schema, regex or grammar is invalid, its compilation ran past the
                limits, or xgrammar is not installed.
        """
        return self._compiled(response_format)[0]

    def allows_jump_forward(self, response_format: ResponseFormat) -> bool:
        """Whether the grammar's forced continuations are bounded (engine/sample/grammar_bounds.py): only
        then may the grammar-forced drafts walk them (engine/spec/grammar_drafts.py)."""
        return self._compiled(response_format)[1].allows_jump_forward

    def _compiled(self, response_format: ResponseFormat) -> tuple[Any, GrammarBounds]:
        key = response_format.cache_key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            self._prepare()
        kind, spec = _spec_of(response_format)
        if self._process is not None:
            import xgrammar  # noqa: PLC0415 - loaded by _prepare already

            serialized, bounds = self._process.compile(kind, spec)
            entry = xgrammar.CompiledGrammar.deserialize_json(serialized, self._info), bounds
        else:
            try:
                compiled = compile_spec(self._compiler, kind, spec)
            except RuntimeError as exc:
                raise GrammarError(describe_native_error(kind, exc)) from None
            try:
                entry = compiled, analyze(compiled.grammar.serialize_json())
            except GrammarError as exc:
                raise GrammarError(f"invalid response_format {kind}: {exc}") from None
        with self._lock:
            self._cache[key] = entry
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return entry

    def new_matcher(self, response_format: ResponseFormat) -> Any:
        """A fresh matcher (an ``xgrammar.GrammarMatcher``) at the start of the output."""
        import xgrammar  # noqa: PLC0415 - imported with the first structured request

        return xgrammar.GrammarMatcher(self.compile(response_format))

    def warm(self) -> None:
        """Get ready now rather than on the first structured request: build the tokenizer info and start the
        compile child (it imports xgrammar and torch: seconds, tens of them under load). Thread-safe; meant
        for a background thread at worker start (:meth:`engine.Engine.warm_grammars`).

        Raises:
            GrammarError: xgrammar is missing, or the child did not start.
        """
        with self._lock:
            self._prepare()
        if self._process is not None:
            self._process.start()

    def close(self) -> None:
        """Stop the compiler's child process, if one runs."""
        if self._process is not None:
            self._process.close()

    def _prepare(self) -> None:
        """Build the tokenizer info and the compiler (or its child process) on first use."""
        if self._info is not None:
            return
        try:
            import xgrammar  # noqa: PLC0415 - heavy (torch); only structured output needs it
        except ImportError:
            raise GrammarError("structured output needs the xgrammar package (pip install xgrammar)") from None
        self._info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                             stop_token_ids=self._eos_token_ids)
        if self._limits is not None:
            self._process = GrammarProcess(self._info.serialize_json(), self._limits)
        else:
            self._compiler = xgrammar.GrammarCompiler(self._info, cache_enabled=False)


def _spec_of(response_format: ResponseFormat) -> tuple[str, str]:
    """What xgrammar compiles for a response format: (kind, text)."""
    kind = response_format.type
    if kind == "regex" and response_format.regex is not None:
        return kind, response_format.regex
    if kind == "grammar" and response_format.grammar is not None:
        return kind, response_format.grammar
    if kind == "json_object":
        return "json_schema", json.dumps({"type": "object"})
    if kind == "json_schema" and response_format.json_schema is not None:
        return kind, json.dumps(response_format.json_schema.schema_)
    raise GrammarError(f"response_format {kind!r} needs no grammar")
