"""A progress output's "all so far" lists are read in place (``SoFar``), not copied each step: they behave as the
list they stand for, and stay as they were when the request's own list grows."""

from __future__ import annotations

import pytest

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.output.request_output import SoFar
from tokenmill.protocol.sampling import SamplingParams


def test_so_far_is_the_prefix_it_was_made_with() -> None:
    items = [10, 11, 12]
    view = SoFar(items, 3)
    items.extend([13, 14])  # the request's list grows after the output was made
    assert len(view) == 3 and list(view) == [10, 11, 12] and view == [10, 11, 12] and [10, 11, 12] == view
    assert view != [10, 11, 12, 13] and view != (10, 11) and view != "abc"
    assert view[0] == 10 and view[-1] == 12 and view[1:] == [11, 12] and view[::-1] == [12, 11, 10]
    assert view[:10] == [10, 11, 12] and view + [1] == [10, 11, 12, 1] and repr(view) == "[10, 11, 12]"
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(IndexError):
        view[-4]
    with pytest.raises(TypeError):
        hash(view)


def test_a_streamed_output_holds_its_tokens_so_far_without_a_copy() -> None:
    engine = Engine.from_config(EngineConfig.model_validate({"model": {"name": "echo"},
                                                            "speculative": {"method": "off"}}))
    engine.add_request("r", list(b"abcdef"), SamplingParams(max_tokens=6, ignore_eos=True), streams=True)
    progress, final = [], None
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                final = output
            else:
                progress.append((output, list(output.token_ids)))
    engine.close()
    assert progress and final is not None
    for output, tokens_then in progress:
        assert isinstance(output.token_ids, SoFar) and output.token_ids == tokens_then  # as it was when made
    assert isinstance(final.token_ids, list) and final.token_ids == list(b"abcdef") and final.text == "abcdef"
