"""Penalties (engine/sample/penalties.py) against Hugging Face's logits processor and a per-token reference
of OpenAI's presence / frequency penalties; the device table of counts; the sampler using them."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.engine.sample.context import SamplingContext
from tokenmill.engine.sample.penalties import PenaltyTable, apply_penalties
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.protocol.sampling import SamplingParams

VOCAB_SIZE = 50


def _tokens(seed: int, num_rows: int, length: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (num_rows, length), generator=generator).tolist()


def _logits(seed: int, num_rows: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 4


def _counts_and_mask(prompts: list[list[int]], outputs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(len(outputs), VOCAB_SIZE, dtype=torch.int32)
    mask = torch.zeros(len(prompts), VOCAB_SIZE, dtype=torch.bool)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        mask[i, prompt] = True
        for token_id in output:
            counts[i, token_id] += 1
    return counts, mask


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_hugging_face(penalty: float) -> None:
    prompts, outputs = _tokens(0, 4, 7), _tokens(1, 4, 5)
    logits = _logits(2, 4)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([p + o for p, o in zip(prompts, outputs)]),
                                                         logits.clone())
    counts, mask = _counts_and_mask(prompts, outputs)
    got = apply_penalties(logits, counts, mask, [SamplingParams(repetition_penalty=penalty)] * 4)
    assert torch.equal(got, expected)


def _openai_reference(logits: torch.Tensor, outputs: list[list[int]], presence: float,
                      frequency: float) -> torch.Tensor:
    """OpenAI's formula, token by token: mu[j] -= c[j] * frequency + (c[j] > 0) * presence."""
    result = logits.clone()
    for i, output in enumerate(outputs):
        for token_id in set(output):
            result[i, token_id] -= output.count(token_id) * frequency + presence
    return result


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (-1.5, 2.0), (2.0, -2.0)])
def test_presence_and_frequency_match_openai(presence: float, frequency: float) -> None:
    prompts, outputs = _tokens(3, 3, 6), _tokens(4, 3, 12)
    logits = _logits(5, 3)
    counts, mask = _counts_and_mask(prompts, outputs)
    params = [SamplingParams(presence_penalty=presence, frequency_penalty=frequency)] * 3
    got = apply_penalties(logits, counts, mask, params)
    assert torch.allclose(got, _openai_reference(logits, outputs, presence, frequency), rtol=0, atol=1e-12)


def test_rows_mix_their_own_penalties() -> None:
    prompts, outputs = _tokens(6, 3, 4), _tokens(7, 3, 9)
    logits = _logits(8, 3)
    counts, mask = _counts_and_mask(prompts, outputs)
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(),
              SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)]
    got = apply_penalties(logits, counts, mask, params)
    hf = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([prompts[0] + outputs[0]]), logits[:1].clone())
    assert torch.equal(got[0], hf[0])
    assert torch.equal(got[1], logits[1])
    hf2 = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompts[2] + outputs[2]]), logits[2:].clone())
    assert torch.allclose(got[2], _openai_reference(hf2, outputs[2:], 0.3, 0.2)[0], rtol=0, atol=1e-12)


def test_table_counts_incrementally_and_frees_rows_with_their_request() -> None:
    table = PenaltyTable(VOCAB_SIZE, torch.device("cpu"))
    states = [SamplingState([1, 2, 2], []), SamplingState([3], [])]
    counts, mask = table.rows(states)
    assert counts.sum() == 0 and mask[0].nonzero().flatten().tolist() == [1, 2] and mask[1].sum() == 1
    states[0].output_token_ids += [5, 5, 7]
    states[1].output_token_ids.append(5)
    counts, _ = table.rows(states)
    assert counts[0, 5] == 2 and counts[0, 7] == 1 and counts[1, 5] == 1 and counts.sum() == 4
    states[0].output_token_ids.append(7)
    counts, _ = table.rows(states[::-1])  # any row order; only new tokens are counted
    assert counts[1, 7] == 2 and counts.sum() == 5
    many = [SamplingState([i], [i]) for i in range(20)]  # grows the table
    assert table.rows(many)[0].sum() == 20 and table.num_used_slots == 22
    del many, states
    gc.collect()
    assert table.num_used_slots == 0
    fresh = SamplingState([4], [])
    counts, mask = table.rows([fresh])  # a reused row starts clean
    assert counts.sum() == 0 and mask.sum() == 1


def test_sampler_applies_penalties_to_greedy_rows() -> None:
    logits = torch.zeros(2, VOCAB_SIZE)
    logits[:, 9] = 2.0
    logits[:, 4] = 1.9
    state = SamplingState([9], [])
    contexts = [SamplingContext(SamplingParams(repetition_penalty=1.2), 0, frozenset(), state),
                SamplingContext(SamplingParams(), 0, frozenset())]
    sampler = Sampler()
    assert sampler(logits, contexts).token_ids == [4, 9]  # 2.0 / 1.2 < 1.9: the prompt's 9 is penalized
    state.output_token_ids.append(4)
    contexts[0] = SamplingContext(SamplingParams(frequency_penalty=1.0), 1, frozenset(), state)
    assert sampler(logits, contexts).token_ids == [9, 9]
