"""Poison containment: an exception inside a step is traced to the request it came from,
which finishes with an ``internal`` error; every other request finishes exactly as it would have
without it, and the engine goes on stepping."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.scheduler_helpers import ScriptedModelRunner, assert_no_leaks
from tests.unit.test_engine import FakeTokenizer, make_engine, run_all
from tokenmill.engine.core.step_io import ModelOutput, SchedulerOutput
from tokenmill.engine.engine import Engine
from tokenmill.engine.output.request_output import RequestOutput
from tokenmill.protocol.outcomes import ErrorCode, FinishReason
from tokenmill.protocol.sampling import SamplingParams

GOOD = {f"good{i}": [1 + i, 2, 3 + i] for i in range(6)}


class PoisonedRunner:
    """The scripted runner, failing every step that holds a chunk of a poisoned request."""

    def __init__(self, runner: ScriptedModelRunner, poisoned: set[str], where: str = "forward") -> None:
        self.runner, self.poisoned, self.where = runner, poisoned, where
        self.num_calls = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        self.num_calls += 1
        bad = [c.request_id for c in scheduler_output.chunks if c.request_id.split(" #")[0] in self.poisoned]
        if bad and self.where == "forward":
            raise RuntimeError(f"index -1 is out of bounds (poisoned by {bad})")
        return self.runner.execute(scheduler_output)


def _finals(engine: Engine, requests: dict[str, list[int]], params: dict[str, SamplingParams]) -> dict[str, Any]:
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, params.get(request_id, SamplingParams(max_tokens=8, ignore_eos=True)))
    outputs: dict[str, list[RequestOutput]] = run_all(engine)
    return {request_id: items[-1] for request_id, items in outputs.items()}


@pytest.mark.parametrize("num_poisoned", [1, 2])
def test_a_failing_request_among_good_ones_fails_alone(num_poisoned: int) -> None:
    baseline = _finals(make_engine(), GOOD, {})
    engine = make_engine()
    assert isinstance(engine.runner, ScriptedModelRunner)
    poisoned = {f"poison{i}" for i in range(num_poisoned)}
    engine.runner = PoisonedRunner(engine.runner, poisoned)
    requests = {**GOOD, **{p: [4, 4, 4] for p in poisoned}}
    finals = _finals(engine, requests, {})
    for request_id in poisoned:
        final = finals[request_id]
        assert final.finish_reason is FinishReason.ERROR and final.error_code is ErrorCode.INTERNAL
        assert final.error is not None and "index -1 is out of bounds" in final.error
    for request_id in GOOD:
        assert finals[request_id].finish_reason is FinishReason.LENGTH
        assert finals[request_id].token_ids == baseline[request_id].token_ids
    assert_no_leaks(engine.scheduler)
    # the engine is whole: a new request runs as on a fresh engine
    again = _finals(engine, {"after": [1, 2, 3]}, {})
    assert again["after"].token_ids == baseline["good0"].token_ids


def test_every_sample_of_a_failing_n_request_fails_together() -> None:
    engine = make_engine()
    assert isinstance(engine.runner, ScriptedModelRunner)
    engine.runner = PoisonedRunner(engine.runner, {"group"})
    params = {"group": SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=3, ignore_eos=True)}
    finals = _finals(engine, {"group": [5, 6, 7, 8, 9], **GOOD}, params)
    assert finals["group"].finish_reason is FinishReason.ERROR and finals["group"].error_code is ErrorCode.INTERNAL
    assert all(finals[r].finish_reason is FinishReason.LENGTH for r in GOOD)
    assert_no_leaks(engine.scheduler)


class _FailingDecode(FakeTokenizer):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        if 13 in token_ids:
            raise ValueError("token 13 cannot be decoded")
        return super().decode(token_ids, skip_special_tokens, **kwargs)


def test_a_request_whose_tokens_cannot_be_decoded_fails_alone() -> None:
    engine = make_engine()
    engine.processor.tokenizer = _FailingDecode()
    prompts = {"a": [1, 2, 3], "b": [2, 3, 4], "c": [7, 8, 9]}
    finals = _finals(engine, prompts, {r: SamplingParams(max_tokens=20, ignore_eos=True) for r in prompts})
    failed = [r for r, f in finals.items() if f.finish_reason is FinishReason.ERROR]
    assert failed, "the scripted continuation of these prompts samples token 13 somewhere"
    for request_id, final in finals.items():
        if request_id in failed:
            assert final.error_code is ErrorCode.INTERNAL and final.error and "cannot be decoded" in final.error
        else:
            assert final.finish_reason is FinishReason.LENGTH and 13 not in final.token_ids
    assert_no_leaks(engine.scheduler)
