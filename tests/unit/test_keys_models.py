"""Per-model lanes (docs/design.md, "Redis keys"): one unambiguous key per model and lane, in the
queue's slot, read by a worker in priority order across the shared lanes and its models'."""

from __future__ import annotations

import pytest

from tokenmill.protocol.keys import Keys, Lane

NAMES = ["smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "a:lane:1", "{x}", "50%", "%41", "é", "a b", ""]


def test_requests_naming_no_model_keep_the_shared_lane_names() -> None:
    keys = Keys("tm", "q")
    assert keys.lane(1) == keys.lane(1, None) == "tm:q:lane:1"
    assert keys.lane(1, "smollm2-135m") == "tm:q:model:smollm2-135m:lane:1"
    assert keys.models == "tm:q:models"


def test_model_names_are_percent_encoded_so_a_key_names_one_model() -> None:
    keys = Keys("tm", "q")
    assert keys.lane(0, "org/Model-1.5B") == "tm:q:model:org%2FModel-1.5B:lane:0"
    assert keys.lane(0, "a:lane:1") == "tm:q:model:a%3Alane%3A1:lane:0"
    streams = [keys.lane(k, name) for name in NAMES for k in range(keys.num_lanes)]
    assert len(set(streams)) == len(streams)
    assert all(stream.count(":") == 5 for stream in streams), "the name part never holds a ':'"


@pytest.mark.parametrize("model", [None, *NAMES])
def test_a_lane_parses_back(model: str | None) -> None:
    keys = Keys("tm", "q")
    assert keys.parse_lane(keys.lane(2, model)) == Lane(keys.lane(2, model), 2, model)


@pytest.mark.parametrize("stream", ["tm:q:lane:3", "tm:q:lane:x", "tm:q:lane:²", "tm:q:lane: 1", "tm:q:lane:01",
                                    "tm:other:lane:0", "tm:q:model:%41:lane:0", "tm:q:model:a/b:lane:0",
                                    "tm:q:dead", "tm:q:models", "tm:q:reply:lane:0", "xtm:q:lane:0"])
def test_other_keys_are_no_lane(stream: str) -> None:
    assert Keys("tm", "q").parse_lane(stream) is None


def test_a_worker_reads_lane_0_of_every_model_before_lane_1() -> None:
    keys = Keys("tm", "q", num_lanes=2)
    lanes = keys.lanes_for(["beta", "alpha", "beta"])
    assert [(lane.priority, lane.model) for lane in lanes] == [(0, None), (0, "alpha"), (0, "beta"),
                                                               (1, None), (1, "alpha"), (1, "beta")]
    assert [lane.stream for lane in lanes if lane.model is None] == keys.lanes
    assert [lane.stream for lane in keys.lanes_for([])] == keys.lanes


def test_with_hash_tag_model_lanes_stay_in_the_queues_slot() -> None:
    keys = Keys("tm", "q", hash_tag=True)
    streams = [keys.lane(0, name) for name in NAMES] + [keys.models]
    assert all(stream.startswith("{tm:q}:") and stream.index("}") == len("{tm:q") for stream in streams)
    assert keys.lane(0, "{x}") == "{tm:q}:model:%7Bx%7D:lane:0"
