"""Unit tests of engine.sample.sampler: greedy, temperature, top-k/top-p, min_tokens, seeds, logprobs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tokenmill.engine.sample.context import SamplingContext
from tokenmill.engine.sample.sampler import Sampler, greedy_token_ids, mix_seed
from tokenmill.protocol.sampling import SamplingParams

VOCAB_SIZE = 32
EOS_ID = 3


def ctx(
    num_output_tokens: int = 0, eos_token_ids: frozenset[int] = frozenset({EOS_ID}), **params: Any
) -> SamplingContext:
    return SamplingContext(SamplingParams(**params), num_output_tokens, eos_token_ids)


def random_logits(num_rows: int, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * 3


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


def test_greedy_is_argmax(sampler: Sampler) -> None:
    logits = random_logits(8)
    out = sampler(logits, [ctx() for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_greedy_token_ids_are_argmax_with_ties_nans_and_infinities(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randint(-3, 4, (64, 1000), generator=generator).to(dtype)  # many tied maxima per row
    logits[5, 17] = logits[5, 900] = float("nan")  # NaN wins, the first one
    logits[6, :] = float("-inf")  # all -inf: index 0
    logits[7, 400] = logits[7, 300] = float("inf")
    got = greedy_token_ids(logits)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert got[:8].tolist()[5:] == [17, 0, 300]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_greedy_any_dtype_and_mixed_batch(sampler: Sampler, dtype: torch.dtype) -> None:
    logits = random_logits(4).to(dtype)
    contexts = [ctx(), ctx(temperature=1.0), ctx(logprobs=2), ctx(min_tokens=1)]
    out = sampler(logits, contexts)
    expected = logits.float().argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in (0, 2)] == [expected[0], expected[2]]
    assert all(0 <= t < VOCAB_SIZE for t in out.token_ids)


def test_logits_are_not_modified(sampler: Sampler) -> None:
    logits = random_logits(3)
    before = logits.clone()
    eos = frozenset({int(logits[0].argmax())})
    sampler(logits, [ctx(0, eos, min_tokens=5), ctx(temperature=0.7, top_k=3, top_p=0.5), ctx(logprobs=3)])
    assert torch.equal(logits, before)


def test_low_temperature_approaches_greedy(sampler: Sampler) -> None:
    logits = random_logits(16, seed=1)
    out = sampler(logits, [ctx(temperature=1e-4) for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy(sampler: Sampler) -> None:
    logits = random_logits(16, seed=2)
    greedy = logits.argmax(dim=-1).tolist()
    assert sampler(logits, [ctx(temperature=5.0, top_k=1) for _ in range(16)]).token_ids == greedy
    assert sampler(logits, [ctx(temperature=5.0, top_p=1e-6) for _ in range(16)]).token_ids == greedy


def test_top_k_and_top_p_restrict_the_support(sampler: Sampler) -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(400, 1)
    top_k_tokens = set(sampler(logits, [ctx(temperature=10.0, top_k=2) for _ in range(400)]).token_ids)
    assert top_k_tokens == {0, 1}
    # probs ~ [.64, .24, .09, .03, .01]: top_p=0.8 keeps {0, 1} (mass before token 2 is .88 >= .8)
    top_p_tokens = set(sampler(logits, [ctx(temperature=1.0, top_p=0.8) for _ in range(400)]).token_ids)
    assert top_p_tokens == {0, 1}


def test_top_k_keeps_ties_at_the_boundary(sampler: Sampler) -> None:
    logits = torch.tensor([[5.0, 4.0, 4.0, 0.0]]).repeat(400, 1)
    assert set(sampler(logits, [ctx(temperature=10.0, top_k=2) for _ in range(400)]).token_ids) == {0, 1, 2}


def test_min_tokens_suppresses_eos_and_stop_ids(sampler: Sampler) -> None:
    logits = torch.zeros(3, VOCAB_SIZE)
    logits[:, EOS_ID] = 10.0
    logits[:, 7] = 9.0
    logits[:, 9] = 8.0
    eos = frozenset({EOS_ID, 30})
    out = sampler(
        logits,
        [
            ctx(0, eos, min_tokens=2, max_tokens=4, stop_token_ids=[7]),  # both masked -> 9
            ctx(2, eos, min_tokens=2, max_tokens=4, stop_token_ids=[7]),  # min reached -> EOS
            ctx(0, eos, min_tokens=1, ignore_eos=True, temperature=1.0, top_k=1),  # EOS masked anyway -> 7
        ],
    )
    assert out.token_ids == [9, EOS_ID, 7]


def test_min_tokens_ignores_out_of_vocab_ids(sampler: Sampler) -> None:
    logits = random_logits(1)
    out = sampler(logits, [ctx(0, frozenset({VOCAB_SIZE + 5}), min_tokens=1, stop_token_ids=[10**9])])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_seeded_row_ignores_neighbours_and_order(sampler: Sampler) -> None:
    row = random_logits(1, seed=3)[0]
    target: dict[str, Any] = dict(temperature=1.0, seed=1234, top_k=20, top_p=0.9)
    alone = sampler(row.unsqueeze(0), [ctx(5, **target)]).token_ids[0]
    for trial in range(20):
        others = random_logits(5, seed=100 + trial)
        position = trial % 6
        batch = torch.cat([others[:position], row.unsqueeze(0), others[position:]])
        neighbour_params: list[dict[str, Any]] = [
            dict(temperature=0.5 + trial * 0.1),
            {},
            dict(top_p=0.3, temperature=2.0),
            dict(seed=trial, temperature=1.0),
            dict(top_k=2, temperature=1.0),
        ]
        contexts = [ctx(trial, **p) for p in neighbour_params]
        contexts.insert(position, ctx(5, **target))
        assert sampler(batch, contexts).token_ids[position] == alone


def test_seed_depends_on_position_not_history(sampler: Sampler) -> None:
    logits = torch.zeros(1, 1000)
    tokens = [sampler(logits, [ctx(n, temperature=1.0, seed=7)]).token_ids[0] for n in range(10)]
    torch.manual_seed(999)  # global RNG state must not matter
    again = [sampler(logits, [ctx(n, temperature=1.0, seed=7)]).token_ids[0] for n in range(10)]
    assert tokens == again
    assert len(set(tokens)) > 5  # positions get different streams


def test_different_seeds_differ(sampler: Sampler) -> None:
    logits = torch.zeros(1, 1000)
    tokens = {sampler(logits, [ctx(0, temperature=1.0, seed=s)]).token_ids[0] for s in range(50)}
    assert len(tokens) > 40


def test_mix_seed_is_in_range_and_spreads() -> None:
    seeds = {mix_seed(s, n) for s in (0, 1, 2**63 - 1) for n in range(100)}
    assert len(seeds) == 300
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("seeded", [True, False])
def test_distribution_matches_softmax(sampler: Sampler, seeded: bool) -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    temperature = 0.8
    logits = (probs.log() * temperature).unsqueeze(0)
    num_draws = 4000
    torch.manual_seed(0)
    if seeded:
        contexts = [ctx(n, temperature=temperature, seed=42) for n in range(num_draws)]
        tokens = [sampler(logits, [c]).token_ids[0] for c in contexts]
    else:
        contexts = [ctx(temperature=temperature) for _ in range(num_draws)]
        tokens = sampler(logits.repeat(num_draws, 1), contexts).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    expected = probs.double() * num_draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 20.0  # 3 degrees of freedom: p ~ 2e-4 at 20


def test_logprobs_are_raw_model_logprobs(sampler: Sampler) -> None:
    logits = random_logits(3, seed=4)
    contexts = [ctx(logprobs=3), ctx(temperature=2.0, top_k=2, logprobs=0, seed=1), ctx()]
    out = sampler(logits, contexts)
    raw = logits.log_softmax(dim=-1)
    first = out.logprobs[0]
    assert first is not None
    top3 = raw[0].topk(3).indices.tolist()
    assert list(first) == top3  # greedy: the sampled token is the top-1, listed first
    for token_id, value in first.items():
        assert math.isclose(value, float(raw[0, token_id]), rel_tol=1e-5)
    second = out.logprobs[1]
    assert second is not None and list(second) == [out.token_ids[1]]
    assert math.isclose(second[out.token_ids[1]], float(raw[1, out.token_ids[1]]), rel_tol=1e-5)
    assert out.logprobs[2] is None


def test_logprobs_include_sampled_token_outside_top(sampler: Sampler) -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    out = sampler(logits, [ctx(0, frozenset({0}), min_tokens=1, logprobs=1)])
    assert out.token_ids == [1]
    assert out.logprobs[0] is not None and list(out.logprobs[0]) == [1, 0]


def test_shape_mismatch_raises(sampler: Sampler) -> None:
    with pytest.raises(ValueError):
        sampler(random_logits(2), [ctx()])
