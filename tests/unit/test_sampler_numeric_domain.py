"""Numeric domains: no value the vocabulary accepts makes the sampler fail or answer
garbage, and rows that truly admit no token are named, never turned into token 0."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.engine.errors import SamplingError
from tokenmill.engine.sample.context import SamplingContext
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.protocol.sampling import (
    GREEDY_TEMPERATURE,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)

VOCAB_SIZE = 64
EOS_ID = 3
PROMPT = [5, 9, 9, 12]


def _context(params: SamplingParams, num_output_tokens: int = 0, output: list[int] | None = None) -> SamplingContext:
    output = output if output is not None else [7] * num_output_tokens
    return SamplingContext(params, len(output), frozenset({EOS_ID}), SamplingState(list(PROMPT), output))


def _logits(rows: int, seed: int, scale: float = 4.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB_SIZE, generator=generator) * scale).to(dtype)


# Every float the schema accepts, the edges and subnormals included.
def _floats(low: float, high: float, *, exclude_low: bool = False) -> st.SearchStrategy[float]:
    edges = [x for x in (low, high, 1e-300, 1e-46, 1e-38, 5e-324, 1e-5, 0.999999) if low <= x <= high]
    if exclude_low:
        edges = [x for x in edges if x > low]
    return st.one_of(st.sampled_from(edges),
                     st.floats(low, high, exclude_min=exclude_low, allow_nan=False, allow_infinity=False))


PARAMS = st.builds(
    dict,
    temperature=_floats(0.0, MAX_TEMPERATURE),
    top_p=_floats(0.0, 1.0, exclude_low=True),
    top_k=st.one_of(st.just(0), st.integers(1, VOCAB_SIZE + 5), st.just(2**31 - 1)),
    repetition_penalty=_floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    presence_penalty=_floats(-2.0, 2.0),
    frequency_penalty=_floats(-2.0, 2.0),
    min_tokens=st.integers(0, 3),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fields=st.lists(PARAMS, min_size=1, max_size=4), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
       num_output_tokens=st.integers(0, 4))
def test_every_accepted_value_samples_a_valid_token(fields: list[dict[str, Any]], seed: int, dtype: torch.dtype,
                                                      num_output_tokens: int) -> None:
    params = [SamplingParams(max_tokens=8, **f) for f in fields]
    contexts = [_context(p, num_output_tokens) for p in params]
    out = Sampler()(_logits(len(params), seed, dtype=dtype), contexts)
    assert all(0 <= token < VOCAB_SIZE for token in out.token_ids)
    for p, token, logprobs in zip(params, out.token_ids, out.logprobs):
        if p.min_tokens > num_output_tokens:
            assert token != EOS_ID
        assert (logprobs is None) == (p.logprobs is None)


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 5e-324, GREEDY_TEMPERATURE / 2])
def test_a_temperature_below_the_floor_is_greedy(temperature: float) -> None:
    logits = _logits(3, seed=1)
    params = SamplingParams(temperature=temperature, top_p=0.9)
    assert params.is_greedy
    out = Sampler()(logits, [_context(params) for _ in range(3)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-300, 1e-9])
def test_a_vanishing_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    logits = _logits(4, seed=2)
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=s) for s in range(4)]
    out = Sampler()(logits, [_context(p) for p in params])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_with_the_largest_temperature_draws_among_the_top_k() -> None:
    logits = _logits(1, seed=3)
    top = set(logits[0].topk(5).indices.tolist())
    params = [SamplingParams(temperature=MAX_TEMPERATURE, top_k=5, seed=s) for s in range(50)]
    out = Sampler()(logits.expand(50, -1).contiguous(), [_context(p) for p in params])
    assert set(out.token_ids) <= top and len(set(out.token_ids)) > 1


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 1e-300), ("repetition_penalty", 0.0), ("repetition_penalty", 1e300),
    ("repetition_penalty", MIN_REPETITION_PENALTY / 2), ("temperature", -1e-300), ("temperature", 100.5),
    ("top_p", 0.0), ("top_p", 1.0000001), ("top_k", -1), ("presence_penalty", 2.5),
])
def test_values_the_sampler_cannot_honour_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


def test_the_extreme_repetition_penalties_keep_scores_finite() -> None:
    """At the domain's edges a seen token's logit is 100x larger or smaller, never infinite or zero."""
    logits = _logits(2, seed=4, scale=30.0)
    for penalty in (MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY):
        out = Sampler()(logits, [_context(SamplingParams(repetition_penalty=penalty), output=[7, 9])] * 2)
        assert all(0 <= t < VOCAB_SIZE for t in out.token_ids)


@pytest.mark.parametrize("poison", ["nan", "inf", "all_masked"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_without_a_valid_token_are_named_not_answered(poison: str, temperature: float) -> None:
    logits = _logits(4, seed=5)
    if poison == "nan":
        logits[2, 10] = float("nan")
    elif poison == "inf":
        logits[2, 10] = float("inf")
    else:
        logits[2, :] = float("-inf")
    contexts = [_context(SamplingParams(temperature=temperature, seed=1)) for _ in range(4)]
    with pytest.raises(SamplingError) as info:
        Sampler()(logits, contexts)
    assert info.value.rows == [2]
