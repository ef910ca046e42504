"""Property tests: the speculator's fast paths choose exactly what their plain forms do.

The n-gram index it runs (``LazyNgramIndex``) proposes the drafts of the plain one it replaced (``NgramIndex``,
kept as the specification): the same longest suffix, its latest earlier occurrence, the same continuation, call
after call as a request's output grows, for any n range, any tier's ``min_n``, any draft length, any id below
2 ** 32, whether a call brings one new token or a whole prompt (each n's rolled key carried across calls), and
whether the lookup reaches an n the index has not needed before (the lazy catch-up), whether the request is short
enough for its lookups to search its tokens (``scan_tokens``) or outgrows that mid-way; and the C++ index the
speculator runs where it builds (csrc/ngram_index.cpp) proposes the same, alone and for a batch in one call. And
``choose_draft_lengths`` sizes drafts as the token-by-token goodput rule (``greedy_draft_lengths``) does, whatever the
step cost, the proposing's cost, the host time and the budget.
"""

from __future__ import annotations

import random
from typing import Any
from unittest import mock

import numpy
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.unit.draft_helpers import draft_lengths
from tests.unit.scheduler_helpers import make_request
from tokenmill.engine.config import SpeculativeConfig
from tokenmill.engine.core.speculation import DraftRoom
from tokenmill.engine.spec import suffix_pool
from tokenmill.engine.spec.draft_length import StepCost, greedy_draft_lengths
from tokenmill.engine.spec.ngram import LazyNgramIndex, NgramIndex, native_index
from tokenmill.engine.spec.speculator import NgramProposer, build_speculator, draft_state
from tokenmill.engine.spec.suffix_pool import SuffixPool


def _native() -> Any:
    module = native_index()
    assert module is not None, "the C++ n-gram index did not build here (see the warning logged)"
    return module


@st.composite
def histories(draw: st.DrawFn) -> dict[str, Any]:
    max_n = draw(st.integers(1, 6))
    # NOTE: few distinct tokens make repeats (matches of every length); a large id now and then, as a vocabulary has
    alphabet = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=draw(st.integers(1, 5)), unique=True))
    tokens = st.sampled_from(alphabet)
    calls = draw(st.lists(st.tuples(
        st.lists(tokens, max_size=draw(st.sampled_from([3, 24]))),  # output tokens added before the call
        st.integers(0, 8),  # draft tokens asked for
        st.one_of(st.none(), st.integers(0, max_n + 1)),  # the tier's min_n
    ), min_size=1, max_size=25))
    # NOTE: 0: indexed from the start; 10_000: searched throughout; between: outgrown at some call
    return {"min_n": draw(st.integers(1, max_n)), "max_n": max_n,
            "scan_tokens": draw(st.one_of(st.sampled_from([0, 10_000]), st.integers(1, 80))),
            "prompt": draw(st.lists(tokens, max_size=draw(st.sampled_from([4, 48])))), "calls": calls}


@pytest.mark.parametrize("kind", ["python", "cpp"])
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories())
def test_the_indexes_propose_the_plain_indexs_drafts(kind: str, history: dict[str, Any]) -> None:
    """The Python index (``LazyNgramIndex``) and the C++ one the speculator runs."""
    reference = NgramIndex(history["min_n"], history["max_n"])
    index = (LazyNgramIndex(history["min_n"], history["max_n"], history["scan_tokens"]) if kind == "python"
             else _native().NgramIndex(history["min_n"], history["max_n"]))
    prompt: list[int] = history["prompt"]
    output: list[int] = []
    for new_tokens, num_tokens, min_n in history["calls"]:
        output.extend(new_tokens)
        expected = reference.propose(prompt + output, num_tokens, min_n)
        assert index.propose(prompt, output, num_tokens, min_n) == expected, (prompt, output, num_tokens, min_n)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.integers(0, 3), max_size=5), min_size=1, max_size=20), st.integers(1, 3),
       st.sampled_from(["auto", "python"]))
def test_every_tier_drafts_what_the_plain_index_proposes(steps: list[list[int]], ngram_min: int,
                                                         ngram_index: str) -> None:
    """Through the speculator (``auto``'s tiers over the request's own tokens, the suffix pool empty), with the C++
    index or the Python one: each step's draft is the plain index's for the first tier that finds one."""
    speculator = build_speculator(SpeculativeConfig(method="auto", ngram_min=ngram_min, min_acceptance=0.0,
                                                    ngram_index=ngram_index))
    assert speculator is not None
    tiers = [(p.name, p.min_n) for p in speculator.proposers if isinstance(p, NgramProposer)]
    reference = NgramIndex(ngram_min, SpeculativeConfig().ngram_max)
    request = make_request("r", prompt_token_ids=[1, 2, 3, 1, 2], max_tokens=1000)
    room = DraftRoom(num_tokens_left=4096, num_scheduled_tokens=1, num_decodes=1)
    for new_tokens in steps:
        request.output_token_ids.extend(new_tokens)
        tokens = request.prompt_token_ids + request.output_token_ids
        expected = next(((name, draft) for name, draft in ((name, reference.propose(tokens, 10, min_n))
                                                           for name, min_n in tiers) if draft), ("", []))
        assert speculator.draft([(request, 10)], room).get("r", []) == expected[1]
        if expected[1]:
            assert draft_state(request).proposer == expected[0]
            speculator.observe([(request, len(expected[1]), len(expected[1]))])


@st.composite
def draft_choices(draw: st.DrawFn) -> dict[str, Any]:
    rates = st.one_of(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), st.floats(0.0, 1.0))
    proposals = [(f"r{i}", draw(st.integers(0, 10)), draw(rates)) for i in range(draw(st.integers(0, 12)))]
    cost = StepCost()
    seconds = st.one_of(st.just(0.0), st.floats(1e-7, 0.05))
    cost.fixed_s, cost.per_token_s, cost.host_s, cost.proposal_s = (draw(seconds), draw(seconds) / 100,
                                                                    draw(seconds), draw(seconds) / 100)
    num_decodes = draw(st.integers(max(1, len(proposals)), 300))
    return {"proposals": proposals, "num_tokens_left": draw(st.integers(0, 150)),
            "num_scheduled_tokens": num_decodes + draw(st.integers(0, 200)), "num_decodes": num_decodes,
            "cost": cost}


@settings(max_examples=1500, deadline=None)
@given(draft_choices())
def test_draft_lengths_are_the_greedy_rules(case: dict[str, Any]) -> None:
    assert draft_lengths(**case) == greedy_draft_lengths(**case)


class _EagerSuffixPool:
    """The suffix pool's plain form: every output's n-grams stored in every length's table as it comes."""

    def __init__(self, min_n: int, max_n: int, continuation_len: int) -> None:
        self.min_n, self.max_n, self.continuation_len = min_n, max_n, continuation_len
        self.tables: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {n: {} for n in range(min_n, max_n + 1)}

    def add(self, prompt: list[int], output: list[int]) -> None:
        lead = prompt[-self.max_n:]
        tokens = lead + output
        for n, table in self.tables.items():
            for stop in range(max(len(lead), n), len(tokens)):
                gram = tuple(tokens[stop - n:stop])
                table.pop(gram, None)
                table[gram] = tuple(tokens[stop:stop + self.continuation_len])

    def propose(self, token_ids: list[int], num_tokens: int, min_n: int | None) -> list[int]:
        for n in range(min(self.max_n, len(token_ids)), max(self.min_n, min_n or 0) - 1, -1):
            continuation = self.tables[n].get(tuple(token_ids[len(token_ids) - n:]))
            if continuation and num_tokens > 0:
                return list(continuation[:num_tokens])
        return []


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3), st.integers(1, 6),
       st.lists(st.one_of(
           st.tuples(st.just("add"), st.lists(st.integers(0, 3), max_size=4), st.lists(st.integers(0, 3), max_size=8)),
           st.tuples(st.just("again"), st.integers(0, 40)),  # an earlier output once more (rows giving one answer)
           st.tuples(st.just("propose"), st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(0, 5),
                     st.one_of(st.none(), st.integers(1, 5)))), max_size=40))
def test_the_lazy_suffix_pool_proposes_what_every_output_stored_at_once_would(
        min_n: int, extra: int, continuation_len: int, calls: list[tuple[Any, ...]]) -> None:
    """The pool's tables take the logged outputs when a lookup reads them (engine/spec/suffix_pool.py): with room for
    everything, each lookup finds what tables filled as every output came would hold, whichever lengths the lookups
    before it read (a length read late takes the outputs of every step it skipped, in order: the newest continuation
    wins; of identical outputs, the latest)."""
    max_n = min_n + extra
    pool = SuffixPool(min_n, max_n, continuation_len, capacity=1_000_000)
    reference = _EagerSuffixPool(min_n, max_n, continuation_len)
    added: list[tuple[list[int], list[int]]] = []
    for call in calls:
        if call[0] == "again" and added:
            call = ("add", *added[call[1] % len(added)])
        if call[0] == "add":
            pool.add(call[1], call[2])
            reference.add(call[1], call[2])
            added.append((call[1], call[2]))
        elif call[0] == "propose":
            assert pool.propose(call[1], call[2], call[3]) == reference.propose(call[1], call[2], call[3]), call
    assert len(pool) == sum(len(table) for table in reference.tables.values())


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.integers(0, 2), st.integers(1, 40),
       st.lists(st.one_of(
           st.tuples(st.just("add"), st.lists(st.integers(0, 2), max_size=3), st.lists(st.integers(0, 2), max_size=6)),
           st.tuples(st.just("again"), st.integers(0, 40)),
           st.tuples(st.just("propose"), st.lists(st.integers(0, 2), min_size=1, max_size=5))), max_size=40))
# the same tokens led in by prompts of different lengths: different n-grams (not identical outputs)
@example(1, 1, 100, [("add", [0], [1, 2]), ("add", [0, 1], [2]), ("propose", [0])])
def test_a_catch_up_taking_only_the_latest_of_identical_outputs_leaves_the_tables_the_same(
        min_n: int, extra: int, capacity: int, calls: list[tuple[Any, ...]]) -> None:
    """``_latest_of_each`` (engine/spec/suffix_pool.py): a table that takes every logged output, repeats included,
    holds the same n-grams, continuations and age order as one that takes the latest of identical ones, with a
    capacity small enough that tables forget their oldest n-grams."""
    max_n = min_n + extra
    latest, every_one = SuffixPool(min_n, max_n, 3, capacity), SuffixPool(min_n, max_n, 3, capacity)
    takes_every_one = mock.patch.object(suffix_pool, "_latest_of_each", lambda outputs: outputs)
    added: list[tuple[list[int], list[int]]] = []
    for call in calls:
        if call[0] == "again" and added:
            call = ("add", *added[call[1] % len(added)])
        if call[0] == "add":
            added.append((call[1], call[2]))
            latest.add(call[1], call[2])
            every_one.add(call[1], call[2])
        elif call[0] == "propose":
            with takes_every_one:
                expected = every_one.propose(call[1], 3)
            assert latest.propose(call[1], 3) == expected, call
    with takes_every_one:
        len(every_one)  # every table caught up
    len(latest)
    for n in range(min_n, max_n + 1):
        assert list((latest._tables[n] or {}).items()) == list((every_one._tables[n] or {}).items()), n


# --------------------------------------------------------------------------- the C++ index (csrc/ngram_index.cpp)


def test_the_cpp_index_keeps_long_contexts_exact() -> None:
    """Thousands of grams per n (its tables grow many times over), ids of every size, both tiers asking: the
    drafts stay the plain index's."""
    rng = random.Random(7)
    reference, native = NgramIndex(1, 6), _native().NgramIndex(1, 6)
    alphabet = [0, 1, 2, 2**31, 2**32 - 1, *rng.sample(range(2**32), 5)]
    prompt = [rng.choice(alphabet) for _ in range(3000)]
    output: list[int] = []
    for step in range(300):
        output.extend(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        for min_n in (2, 1):
            expected = reference.propose(prompt + output, 10, min_n)
            assert native.propose(prompt, output, 10, min_n) == expected, step


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=12), st.integers(1, 4))
def test_the_batch_call_proposes_what_each_request_s_python_index_does(outputs: list[list[int]],
                                                                     num_tokens: int) -> None:
    """``propose_batch`` over several requests (some with a draft, some without) returns what the Python proposer
    returns for the same requests, keyed by request id."""
    python = NgramProposer("ngram", 2, 5, 1)
    native = NgramProposer("ngram", 2, 5, 1, native=_native())
    for proposer in (python, native):
        requests = [make_request(f"r{i}", prompt_token_ids=[1, 2, 3, 1, 2, i % 4], max_tokens=1000)
                    for i in range(len(outputs))]
        for request, output in zip(requests, outputs, strict=True):
            request.output_token_ids.extend(output)
        drafts = proposer.propose([(request, request.token_view, num_tokens) for request in requests])
        if proposer is python:
            expected = drafts
        else:
            assert drafts == expected
            assert all(type(draft_state(request).ngram).__name__ == "NgramIndex" for request in requests)


def test_the_speculator_runs_the_cpp_index_unless_told_the_python_one() -> None:
    def ngram_native(config: SpeculativeConfig) -> list[bool]:
        speculator = build_speculator(config)
        assert speculator is not None
        return [p.native is not None for p in speculator.proposers if isinstance(p, NgramProposer)]

    assert ngram_native(SpeculativeConfig(method="auto")) == [True, True]
    assert ngram_native(SpeculativeConfig(method="ngram", ngram_min=2)) == [True]
    assert ngram_native(SpeculativeConfig(method="auto", ngram_index="python")) == [False, False]


def test_the_cpp_index_refuses_bad_input_with_an_error() -> None:
    """What the speculator would take as a failed draft call (the step runs without drafts), never a crash."""
    module = _native()
    with pytest.raises(ValueError, match="min_n <= max_n"):
        module.NgramIndex(3, 2)
    with pytest.raises(ValueError, match="min_n <= max_n"):
        module.NgramIndex(0, 2)
    index = module.NgramIndex(1, 4)
    with pytest.raises(TypeError, match="must be lists"):
        index.propose((1, 2, 1), [], 3)
    with pytest.raises(OverflowError):
        index.propose([1, 2**32, 1], [], 3)
    with pytest.raises(OverflowError):
        module.NgramIndex(1, 4).propose([1, -1, 1], [], 3)
    with pytest.raises(TypeError, match="integer"):
        module.NgramIndex(1, 4).propose([1, "2", 1], [], 3)
    # any integer type is an id (numpy's too), as long as it fits
    assert module.NgramIndex(1, 4).propose([numpy.int64(1), numpy.uint32(2), 1], [], 3) == [2, 1]
    request = make_request("r", prompt_token_ids=[1, 2, 1], max_tokens=10)
    with pytest.raises(TypeError, match="NgramIndex"):
        module.propose_batch([(request, request.token_view, 2)], [LazyNgramIndex(1, 4)], 1)
    with pytest.raises(ValueError, match="one index per"):
        module.propose_batch([(request, request.token_view, 2)], [], 1)
    assert module.propose_batch([(request, request.token_view, 2)], [module.NgramIndex(1, 4)], 1) == {"r": [2, 1]}
