"""``Request.token_view`` and ``token_slice``: prompt + output read without concatenating them, exactly as the
concatenated list reads (the speculator's lookups and a decode step's inputs must not cost the context)."""

from __future__ import annotations

import random

from tokenmill.engine.core.request import Request
from tokenmill.protocol.sampling import SamplingParams


def test_views_and_slices_read_as_the_concatenated_list() -> None:
    rng = random.Random(0)
    for _ in range(200):
        request = Request("r", [rng.randrange(100) for _ in range(rng.randrange(1, 12))], SamplingParams(),
                          arrival_time_s=0.0)
        request.output_token_ids.extend(rng.randrange(100) for _ in range(rng.randrange(0, 12)))
        whole = request.all_token_ids
        view = request.token_view
        assert len(view) == len(whole) and list(view) == whole
        for _ in range(20):
            start, stop = rng.randrange(-15, 30), rng.randrange(-15, 30)
            assert view[start:stop] == whole[start:stop], (start, stop)
            assert view[start:] == whole[start:] and view[:stop] == whole[:stop]
            if 0 <= start < len(whole) and start <= stop <= len(whole):
                assert request.token_slice(start, stop) == whole[start:stop]
        index = rng.randrange(-len(whole), len(whole))
        assert view[index] == whole[index]
    request.output_token_ids.append(7)  # NOTE: a view reflects the request's lists as they grow
    assert view[-1] == 7
