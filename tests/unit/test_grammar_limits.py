"""Grammar compilation under limits: in a child process, a spec that runs past its time
or memory limit is refused with a clear error and the child replaced; within the limits the child
compiles exactly what the calling thread would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.tiny_models import build_tokenizer
from tokenmill.engine.errors import GrammarError
from tokenmill.engine.sample.grammar import GrammarCompiler
from tokenmill.engine.sample.grammar_process import CompileLimits
from tokenmill.protocol.sampling import MAX_SPEC_CHARS, ResponseFormat

SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "n": {"type": "integer"}},
          "required": ["mood", "n"]}
# Counted repetitions of every length: ~13 s to compile over the tiny vocabulary, 27 s over SmolLM2's
# with only 300 of them, though the spec is only a few KB (the 1 s limit below is 13x shorter).
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 2600)) + ")"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _compiler(tokenizer: Any, limits: CompileLimits | None) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), limits=limits)


@pytest.fixture(scope="module")
def isolated(tokenizer: Any) -> Iterator[GrammarCompiler]:
    compiler = _compiler(tokenizer, CompileLimits(timeout_s=1.0, memory_bytes=1 << 30))
    yield compiler
    compiler.close()


def _format(**spec: Any) -> ResponseFormat:
    return ResponseFormat.model_validate(spec)


@pytest.mark.parametrize("spec", [
    {"type": "json_schema", "json_schema": {"name": "m", "schema": SCHEMA}},
    {"type": "json_object"},
    {"type": "regex", "regex": "[0-9]{3}-[a-z]+"},
    {"type": "grammar", "grammar": 'root ::= "yes" | "no"'},
])
def test_the_child_compiles_what_the_thread_compiles(spec: dict[str, Any], tokenizer: Any,
                                                      isolated: GrammarCompiler) -> None:
    response_format = _format(**spec)
    in_child = isolated.compile(response_format)
    in_thread = _compiler(tokenizer, None).compile(response_format)
    assert in_child.serialize_json() == in_thread.serialize_json()
    assert isolated.is_cached(response_format) and isolated.compile(response_format) is in_child


def test_a_spec_past_the_time_limit_is_refused_and_the_child_replaced(isolated: GrammarCompiler) -> None:
    assert len(SLOW_REGEX) < MAX_SPEC_CHARS  # within the size limit: only the time limit can stop it
    with pytest.raises(GrammarError, match="took longer than 1 s to compile"):
        isolated.compile(_format(type="regex", regex=SLOW_REGEX))
    assert not isolated.is_cached(_format(type="regex", regex=SLOW_REGEX))
    assert isolated.compile(_format(type="regex", regex="[ab]+c")) is not None  # a new child serves on


def test_a_spec_past_the_memory_limit_is_refused(tokenizer: Any) -> None:
    starved = _compiler(tokenizer, CompileLimits(timeout_s=30.0, memory_bytes=1 << 20))
    try:
        with pytest.raises(GrammarError, match="memory"):
            starved.compile(_format(type="regex", regex="(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 400)) + ")"))
    finally:
        starved.close()


def test_an_invalid_spec_says_why_as_the_thread_does(tokenizer: Any, isolated: GrammarCompiler) -> None:
    bad = _format(type="grammar", grammar="root ::= undefined_rule")
    with pytest.raises(GrammarError) as in_child:
        isolated.compile(bad)
    with pytest.raises(GrammarError) as in_thread:
        _compiler(tokenizer, None).compile(bad)
    assert str(in_child.value) == str(in_thread.value) and "undefined_rule" in str(in_child.value)


def test_specs_beyond_the_size_limit_never_reach_a_compiler() -> None:
    with pytest.raises(ValueError, match="at most 65536"):
        _format(type="regex", regex="a" * (MAX_SPEC_CHARS + 1))
