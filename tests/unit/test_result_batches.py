"""Producer helpers under faults: the BLPOP batch rotation never repeats an id (the
``make run`` KeyError), and a repeated id is collected once."""

from __future__ import annotations

import pytest

from tokenmill.producer.result_waits import DONE_KEYS_PER_BLPOP, rotate, take_pending

LENGTHS = [1, 2, 3, 4, 7, DONE_KEYS_PER_BLPOP - 1, DONE_KEYS_PER_BLPOP, DONE_KEYS_PER_BLPOP + 1, 600]


@pytest.mark.parametrize("num_pending", LENGTHS)
def test_rotate_never_repeats_an_id(num_pending: int) -> None:
    pending = [f"id{i}" for i in range(num_pending)]
    for offset in [*range(3 * num_pending + 2), 10**9 + 7]:
        batch = rotate(pending, offset)
        assert len(batch) == len(set(batch)) == min(num_pending, DONE_KEYS_PER_BLPOP), (num_pending, offset)
        start = offset % num_pending
        assert batch == [pending[(start + i) % num_pending] for i in range(len(batch))]


def test_the_make_run_case() -> None:
    assert rotate(["a", "b", "c"], 1) == ["b", "c", "a"]


@pytest.mark.parametrize("num_pending", [1, 5, 600])
def test_successive_batches_cover_every_id(num_pending: int) -> None:
    pending = [f"id{i}" for i in range(num_pending)]
    seen: set[str] = set()
    offset = 0
    while len(seen) < num_pending:
        batch = rotate(pending, offset)
        seen.update(batch)
        offset += len(batch)
    assert seen == set(pending)


def test_take_pending_counts_a_repeated_id_once() -> None:
    pending = dict.fromkeys(["a", "b"])
    assert [take_pending(pending, i) for i in ["a", "a", "b", "c"]] == [True, False, True, False]
    assert not pending
