"""Which shard a request lives on: ids the producer generates land on their prompt prefix's shard, and ids
derived from a caller's own (a bulk row's attempt, a Celery task's) do too, deterministically; an id the
caller chose is placed by that id."""

from __future__ import annotations

import pytest

from tokenmill.protocol.schema import GenerationRequest, Message
from tokenmill.protocol.shards import QueueLayout, derived_id_on_shard, shard_of_id, shard_of_prefix


def _layout(num_shards: int, placement: str = "prefix") -> QueueLayout:
    return QueueLayout.build("tm", "q", 3, num_shards=num_shards, placement=placement)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_shards", [2, 3, 16, 256])
def test_a_derived_id_is_the_first_of_the_base_and_its_suffixes_on_the_shard(num_shards: int) -> None:
    for index in range(50):
        base = f"bulk-job-{index}-0"
        shard = index % num_shards
        request_id = derived_id_on_shard(base, shard, num_shards)
        assert shard_of_id(request_id, num_shards) == shard
        assert request_id == derived_id_on_shard(base, shard, num_shards)  # deterministic
        assert request_id == base or request_id.startswith(base + ".")
        if request_id != base:
            suffix = int(request_id.rsplit(".", 1)[1])
            assert all(shard_of_id(f"{base}.{n}", num_shards) != shard for n in range(1, suffix))
            assert shard_of_id(base, num_shards) != shard


def test_placed_from_moves_a_derived_id_to_its_prompt_s_shard() -> None:
    layout = _layout(3)
    template = "Summarise this support ticket in one line. " * 20  # > PREFIX_CHARS: one shard for every row
    rows = [GenerationRequest(id=f"celery-task-{i}", messages=[Message(role="user", content=template + str(i))])
            for i in range(12)]
    placed = [layout.placed_from(row) for row in rows]
    shards = {layout.shard_of(row.id) for row in placed}
    assert shards == {shard_of_prefix(rows[0], 3)}
    assert [layout.placed_from(row).id for row in rows] == [row.id for row in placed]  # again: the same ids
    assert all(p.id.startswith(r.id) and p.messages == r.messages for p, r in zip(placed, rows))


@pytest.mark.parametrize(("num_shards", "placement"), [(1, "prefix"), (3, "id")])
def test_without_prefix_placement_an_id_stays_as_it_is(num_shards: int, placement: str) -> None:
    layout = _layout(num_shards, placement)
    request = GenerationRequest(id="bulk-abc-0", prompt="hello " * 200)
    assert layout.placed_from(request) is request
    assert layout.placed(request) is request


def test_generated_ids_land_on_the_prompt_s_shard() -> None:
    layout = _layout(4)
    request = GenerationRequest(prompt="shared few-shot block " * 40)
    assert layout.shard_of(layout.placed(request).id) == shard_of_prefix(request, 4)
