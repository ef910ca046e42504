"""The stop rule on tokens (engine/core/request.py ``find_stop``): a step's new tokens -- one, or a verified draft
and its bonus -- are judged at once, and must end the request exactly where appending them one at a time under the
single-token rule (written out here as the specification) would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.core.request import Request, RequestStatus, find_stop
from tokenmill.protocol.sampling import SamplingParams

EOS = frozenset({2})


def stop_one_at_a_time(request: Request, new_token_ids: list[int], eos_token_ids: frozenset[int],
                       max_model_len: int | None) -> tuple[int, RequestStatus, int | None] | None:
    """The specification: append each token, then ask whether the newest one ends the request."""
    params = request.sampling_params
    output = list(request.output_token_ids)
    for index, token_id in enumerate(new_token_ids):
        output.append(token_id)
        is_stop_id = (token_id in eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids
        if is_stop_id and not len(output) - 1 < params.min_tokens:
            return index, RequestStatus.FINISHED_STOPPED, token_id
        is_context_full = max_model_len is not None and len(request.prompt_token_ids) + len(output) >= max_model_len
        if len(output) >= request.max_tokens or is_context_full:
            return index, RequestStatus.FINISHED_LENGTH, None
    return None


def make(num_prompt: int, num_output: int, max_tokens: int, min_tokens: int, stop_ids: list[int],
         ignore_eos: bool) -> Request:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), stop_token_ids=stop_ids,
                            ignore_eos=ignore_eos)
    return Request(request_id="r", prompt_token_ids=[5] * num_prompt, sampling_params=params, arrival_time_s=0.0,
                   output_token_ids=[7] * num_output)


@settings(max_examples=400, deadline=None)
@given(num_prompt=st.integers(1, 12), num_output=st.integers(0, 12), max_tokens=st.integers(1, 16),
       min_tokens=st.integers(0, 8), stop_ids=st.lists(st.integers(0, 5), max_size=2), ignore_eos=st.booleans(),
       new_token_ids=st.lists(st.integers(0, 5), min_size=1, max_size=6),
       max_model_len=st.one_of(st.none(), st.integers(2, 30)))
def test_a_steps_tokens_stop_where_one_at_a_time_would(num_prompt, num_output, max_tokens, min_tokens, stop_ids,
                                                       ignore_eos, new_token_ids, max_model_len):
    # NOTE: a live request: below both limits before its step
    num_output = min(num_output, max_tokens - 1)
    if max_model_len is not None:
        max_model_len = max(max_model_len, num_prompt + num_output + 1)
    request = make(num_prompt, num_output, max_tokens, min_tokens, stop_ids, ignore_eos)
    expected = stop_one_at_a_time(request, new_token_ids, EOS, max_model_len)
    found = find_stop(request, new_token_ids, EOS, max_model_len)
    if expected is None:
        assert found is None
        assert request.stop_token_id is None
    else:
        assert found == expected[:2]
        assert request.stop_token_id == expected[2]


def test_eos_inside_a_verified_draft_ends_the_request_there():
    request = make(4, 3, 50, 0, [], False)
    assert find_stop(request, [9, 2, 9, 9], EOS, None) == (1, RequestStatus.FINISHED_STOPPED)
    assert request.stop_token_id == 2


def test_min_tokens_holds_a_stop_id_back_until_the_output_is_long_enough():
    request = make(4, 3, 50, 5, [4], False)
    # NOTE: tokens at output index 3 and 4 are under min_tokens=5; index 5 may stop
    assert find_stop(request, [4, 4, 4], EOS, None) == (2, RequestStatus.FINISHED_STOPPED)


def test_max_tokens_cuts_a_draft_short():
    request = make(4, 8, 10, 0, [], True)
    assert find_stop(request, [2, 2, 2, 2], EOS, None) == (1, RequestStatus.FINISHED_LENGTH)
    assert request.stop_token_id is None
