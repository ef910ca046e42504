"""StepPlan.add_drafts: drafts grow scheduled one-token decodes and are charged to the step's budgets; anything
else (a prefill, a request not scheduled or named twice, an empty draft, a budget overrun) is an invariant error
that leaves the plan as it was."""

from __future__ import annotations

import pytest

from tests.unit.scheduler_helpers import make_request
from tokenmill.engine.config import SchedulerConfig
from tokenmill.engine.core.step_plan import StepPlan
from tokenmill.engine.errors import InvariantError


def _plan_with_decodes(num_tokens: int = 64) -> StepPlan:
    config = SchedulerConfig(max_num_batched_tokens=num_tokens, max_prefill_chunk=num_tokens, max_num_seqs=8)
    plan = StepPlan.start(config, index=0, now_s=0.0)
    decodes = [make_request(f"d{i}") for i in range(3)]
    for request in decodes:
        request.output_token_ids.append(1)
        request.num_computed_tokens = request.num_tokens - 1
    plan.add_decodes(decodes)
    prefill = make_request("p")
    plan.add(prefill, 4)
    return plan


def test_drafts_grow_their_decodes_and_are_charged() -> None:
    plan = _plan_with_decodes()
    left, decode_left = plan.num_tokens_left, plan.num_decode_tokens_left
    plan.add_drafts(["d0", "d2"], [3, 1])
    assert plan.request_to_num_tokens == {"d0": 4, "d1": 1, "d2": 2, "p": 4}
    assert (plan.num_tokens_left, plan.num_decode_tokens_left) == (left - 4, decode_left - 4)
    plan.add_drafts([], [])  # nothing drafted: nothing changes
    assert plan.num_tokens_left == left - 4


@pytest.mark.parametrize(("request_ids", "num_draft_tokens"), [
    (["p"], [2]),  # a prefill
    (["missing"], [2]),  # not scheduled
    (["d0", "d0"], [1, 1]),  # named twice
    (["d0"], [0]),  # an empty draft
    (["d0", "d1"], [1]),  # lengths that do not match
])
def test_bad_drafts_are_refused_and_change_nothing(request_ids: list[str], num_draft_tokens: list[int]) -> None:
    plan = _plan_with_decodes()
    before = (dict(plan.request_to_num_tokens), plan.num_tokens_left, plan.num_decode_tokens_left)
    with pytest.raises(InvariantError, match="bad drafts"):
        plan.add_drafts(request_ids, num_draft_tokens)
    assert (plan.request_to_num_tokens, plan.num_tokens_left, plan.num_decode_tokens_left) == before


def test_drafts_past_the_budget_are_an_invariant_error() -> None:
    plan = _plan_with_decodes(num_tokens=16)  # 3 decodes and 4 prefill tokens leave 9
    with pytest.raises(InvariantError, match="budget exceeded"):
        plan.add_drafts(["d0", "d1"], [5, 5])
