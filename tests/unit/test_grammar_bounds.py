"""Grammars whose forced continuation never ends cannot reach xgrammar's jump-forward: a grammar that can
never end is refused at compile time (in the child and in the thread alike), and one whose forced parts are
long drafts nothing, so no request can make the engine thread walk a continuation without end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import xgrammar

from tests.tiny_models import build_tokenizer
from tokenmill.engine.core.request import Request
from tokenmill.engine.errors import GrammarError
from tokenmill.engine.sample.grammar import GrammarCompiler
from tokenmill.engine.sample.grammar_bounds import MAX_FORCED_RULE_BYTES, analyze
from tokenmill.engine.sample.grammar_process import CompileLimits
from tokenmill.engine.spec.grammar_drafts import GrammarForcedProposer
from tokenmill.protocol.sampling import ResponseFormat, SamplingParams

SELF_REFERENCE = 'root ::= "a" root'
# A tool whose parameters require a property that is the whole schema again (the chat body's tool plan
# wraps it in the array of calls, so "#" is that array: no finite JSON satisfies it).
ENDLESS_TOOL_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["name", "arguments"],
    "properties": {"name": {"type": "string", "enum": ["f"]},
                   "arguments": {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}}}}


def _bounds(ebnf: str) -> Any:
    return analyze(xgrammar.Grammar.from_ebnf(ebnf).serialize_json())


@pytest.mark.parametrize("ebnf", [SELF_REFERENCE, 'root ::= "b" | [a-z] loop\nloop ::= "x" loop',
                                  'root ::= "{" root "}"', 'root ::= item{2, 3}\nitem ::= "i" item'])
def test_a_grammar_that_can_never_end_is_refused(ebnf: str) -> None:
    with pytest.raises(GrammarError, match="can never end"):
        _bounds(ebnf)


@pytest.mark.parametrize("ebnf", ['root ::= "yes" | "no"', 'root ::= "(" root ")" | "x"',
                                  'root ::= [a-z]* "." | item+\nitem ::= "i" item | "j"'])
def test_grammars_that_can_end_allow_jump_forward(ebnf: str) -> None:
    bounds = _bounds(ebnf)
    assert bounds.allows_jump_forward and 0 <= bounds.longest_rule_bytes <= MAX_FORCED_RULE_BYTES


@pytest.mark.parametrize("ebnf", [
    'root ::= "y" | "z" "' + "q" * (MAX_FORCED_RULE_BYTES + 1) + '"',  # short overall, long once "z" is chosen
    f'root ::= r{{{MAX_FORCED_RULE_BYTES + 1}}}\nr ::= "x"',
    'root ::= a a\na ::= b b\nb ::= c c\nc ::= d d\nd ::= "' + "x" * 300 + '"',  # 16 x 300 bytes forced
])
def test_grammars_with_long_forced_parts_draft_nothing(ebnf: str) -> None:
    bounds = _bounds(ebnf)
    assert not bounds.allows_jump_forward and bounds.longest_rule_bytes > MAX_FORCED_RULE_BYTES


def test_a_grammar_format_it_does_not_know_drafts_nothing() -> None:
    serialized = json.loads(xgrammar.Grammar.from_ebnf('root ::= "yes"').serialize_json())
    serialized["__VERSION__"] = "v999"
    assert not analyze(json.dumps(serialized)).allows_jump_forward


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module", params=["child", "thread"])
def compiler(request: pytest.FixtureRequest, tokenizer: Any) -> Iterator[GrammarCompiler]:
    limits = CompileLimits(timeout_s=30.0, memory_bytes=1 << 30) if request.param == "child" else None
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), limits=limits)
    yield compiler
    compiler.close()


@pytest.mark.parametrize("spec", [
    {"type": "grammar", "grammar": SELF_REFERENCE},
    {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": ENDLESS_TOOL_SCHEMA}},
    {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}}},
])
def test_the_compiler_refuses_endless_specs_with_a_clear_error(spec: dict[str, Any], compiler: GrammarCompiler) -> None:
    response_format = ResponseFormat.model_validate(spec)
    with pytest.raises(GrammarError, match=f"invalid response_format {spec['type']}: the grammar can never end"):
        compiler.compile(response_format)
    assert not compiler.is_cached(response_format)


def _draft(compiler: GrammarCompiler, ebnf: str) -> list[int] | None:
    params = SamplingParams(max_tokens=64, response_format={"type": "grammar", "grammar": ebnf})
    request = Request("r", [1, 2, 3], params, arrival_time_s=0.0)
    drafts = GrammarForcedProposer(compiler).propose([(request, [], 8)])
    return drafts.get("r")


def test_forced_drafts_only_where_the_forced_parts_are_bounded(compiler: GrammarCompiler) -> None:
    assert _draft(compiler, 'root ::= "hello world, hello world"')  # a forced literal is drafted
    long_literal = "hello world " * (MAX_FORCED_RULE_BYTES // 12 + 1)
    assert _draft(compiler, f'root ::= "{long_literal}"') is None  # too long to walk: nothing drafted
