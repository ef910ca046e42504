"""Structured output without a model: grammars compiled and cached by spec, one-line errors, and
the sampler's masks over random logits (with the tiny in-code tokenizer)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from tests.tiny_models import build_tokenizer
from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.engine.errors import GrammarError, InvariantError
from tokenmill.engine.sample.context import SamplingContext
from tokenmill.engine.sample.grammar import GrammarCompiler
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.protocol.sampling import ResponseFormat, SamplingParams

SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}, "n": {"type": "integer"}},
          "required": ["mood", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))


def fmt(**spec: Any) -> ResponseFormat:
    return ResponseFormat.model_validate(spec)


def json_format(schema: dict[str, Any], name: str = "x") -> ResponseFormat:
    return fmt(type="json_schema", json_schema={"name": name, "schema": schema})


def test_response_format_needs_exactly_its_spec() -> None:
    assert not fmt().is_structured and fmt(type="json_object").is_structured
    for bad in ({"type": "regex"}, {"type": "text", "regex": "a"}, {"type": "json_object", "grammar": "x"},
                {"type": "yaml"}):
        with pytest.raises(ValueError):
            fmt(**bad)
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(response_format={"type": "json_object"}, ignore_eos=True)


def test_grammars_are_cached_by_spec(tokenizer: Any) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), max_cached=2)
    first = compiler.compile(json_format(SCHEMA, name="a"))
    assert compiler.compile(json_format(dict(reversed(SCHEMA.items())), name="b")) is first  # name, key order
    compiler.compile(fmt(type="regex", regex="[ab]+"))
    compiler.compile(fmt(type="json_object"))  # evicts the least recently used: the schema
    assert compiler.compile(json_format(SCHEMA)) is not first


@pytest.mark.parametrize(("spec", "message"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, 'Unsupported type "strng"'),
    ({"type": "regex", "regex": "a("}, "parenthesis"),
    ({"type": "grammar", "grammar": "root ::= foo"}, 'Rule "foo" is not defined'),
])
def test_invalid_specs_raise_one_line_errors(compiler: GrammarCompiler, spec: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(message)) as info:
        compiler.compile(fmt(**spec))
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"invalid response_format {spec['type']}: ") and ".cc:" not in text


def _walk(compiler: GrammarCompiler, tokenizer: Any, params: SamplingParams, seed: int, max_tokens: int = 60) -> str:
    """Samples one structured row (next to an unconstrained one) from random logits until EOS."""
    sampler = Sampler(compiler)
    generator = torch.Generator().manual_seed(seed)
    eos = frozenset({tokenizer.eos_token_id})
    state = SamplingState([1, 2], [])
    for _ in range(max_tokens):
        logits = torch.randn(2, len(tokenizer), generator=generator) * 5
        contexts = [SamplingContext(SamplingParams(), 0, eos),
                    SamplingContext(params, len(state.output_token_ids), eos, state)]
        token_ids = sampler(logits, contexts).token_ids
        assert token_ids[0] == int(logits[0].argmax())  # the unconstrained row is untouched
        if token_ids[1] in eos:
            return str(tokenizer.decode(state.output_token_ids))
        state.output_token_ids.append(token_ids[1])
    raise AssertionError(f"no EOS after {max_tokens} tokens: {tokenizer.decode(state.output_token_ids)!r}")


@pytest.mark.parametrize("seed", range(3))
def test_masked_rows_follow_their_grammar(compiler: GrammarCompiler, tokenizer: Any, seed: int) -> None:
    text = _walk(compiler, tokenizer, SamplingParams(response_format=json_format(SCHEMA)), seed)
    value = json.loads(text)
    assert value["mood"] in ("happy", "sad") and isinstance(value["n"], int) and set(value) == {"mood", "n"}
    regex = SamplingParams(temperature=1.0, seed=seed, response_format=fmt(type="regex", regex="(ab|c)[0-9]{2}"))
    assert re.fullmatch("(ab|c)[0-9]{2}", _walk(compiler, tokenizer, regex, seed))


def test_matcher_replays_tokens_it_has_not_seen(compiler: GrammarCompiler, tokenizer: Any) -> None:
    """A state whose matcher is new (or behind) catches up with the output before masking."""
    params = SamplingParams(response_format=fmt(type="regex", regex="hello [a-z]+"))
    state = SamplingState([1], tokenizer.encode("hello wo"))
    logits = torch.zeros(1, len(tokenizer))
    logits[0, tokenizer.convert_tokens_to_ids("Ġ")] = 5.0  # a space: not allowed after "hello wo"
    out = Sampler(compiler)(logits, [SamplingContext(params, len(state.output_token_ids), frozenset(), state)])
    assert state.num_matched_tokens == len(state.output_token_ids)
    assert out.token_ids == [tokenizer.eos_token_id] or re.fullmatch("[a-z]+", tokenizer.decode(out.token_ids))
    state.output_token_ids.append(tokenizer.convert_tokens_to_ids("0"))  # a token the mask would never allow
    with pytest.raises(InvariantError, match="against the grammar"):
        Sampler(compiler)(logits, [SamplingContext(params, len(state.output_token_ids), frozenset(), state)])
