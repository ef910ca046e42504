"""The Redis key layout (docs/design.md), built from one prefix and queue name."""

from __future__ import annotations

import pytest

from tokenmill.protocol.keys import CONSUMER_GROUP, DONE_TTL_S, PRIORITY_NAMES, Keys
from tokenmill.protocol.schema import GenerationRequest, check_reply_to


def test_layout() -> None:
    keys = Keys(prefix="tm", queue="q", num_lanes=2)
    assert keys.base == "tm:q"
    assert keys.lanes == ["tm:q:lane:0", "tm:q:lane:1"]
    assert (keys.result("r1"), keys.done("r1"), keys.tokens("r1")) == ("tm:q:res:r1", "tm:q:done:r1", "tm:q:tok:r1")
    assert (keys.dead, keys.cancel, keys.workers) == ("tm:q:dead", "tm:q:cancel", "tm:q:workers")
    assert CONSUMER_GROUP == "workers" and DONE_TTL_S > 0


def test_defaults() -> None:
    assert Keys().lanes == ["tokenmill:default:lane:0", "tokenmill:default:lane:1", "tokenmill:default:lane:2"]


@pytest.mark.parametrize(("priority", "lane"), [("high", 0), ("normal", 1), ("low", 2), (0, 0), (2, 2)])
def test_priorities_map_to_lanes(priority: str | int, lane: int) -> None:
    assert Keys().lane_of(priority) == lane


def test_names_clamp_to_the_lanes_that_exist() -> None:
    assert [Keys(num_lanes=1).lane_of(name) for name in PRIORITY_NAMES] == [0, 0, 0]
    assert Keys(num_lanes=2).lane_of("low") == 1


@pytest.mark.parametrize(("priority", "match"), [("urgent", "unknown priority"), (3, "out of range"),
                                                 (-1, "out of range"), ([1], "must be a lane number"),
                                                 (True, "must be a lane number"), (1.0, "must be a lane number")])
def test_bad_priorities(priority: str | int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Keys().lane_of(priority)


def test_lane_out_of_range() -> None:
    with pytest.raises(ValueError, match="out of range"):
        Keys().lane(3)


@pytest.mark.parametrize(("kwargs", "match"), [({"prefix": ""}, "non-empty"), ({"queue": "a:b"}, "':'"),
                                               ({"num_lanes": 0}, ">= 1")])
def test_invalid_keys(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Keys(**kwargs)  # type: ignore[arg-type]


def test_reply_streams_live_in_their_own_namespace() -> None:
    keys = Keys(prefix="tm", queue="q")
    assert keys.reply_prefix == "tm:q:reply:" and keys.reply("fan-in") == "tm:q:reply:fan-in"
    assert keys.bulk_replies("job1") == "tm:q:reply:bulk:job1" and keys.is_reply_stream(keys.bulk_replies("j"))
    assert Keys(prefix="tm", queue="q", hash_tag=True).reply("r") == "{tm:q}:reply:r"
    with pytest.raises(ValueError, match="non-empty"):
        keys.reply("")


@pytest.mark.parametrize("key", ["tm:q:res:other", "tm:q:cancel", "tm:q:lane:0", "tm:q:done:x", "tm:q:workers",
                                 "tm:q:dead", "tm:q:reply:", "tm:q:reply", "tm:other:reply:r", "other:q:reply:r",
                                 "xtm:q:reply:r", "tm:q:bulk:job"])
def test_only_reply_streams_pass_the_check(key: str) -> None:
    assert not Keys(prefix="tm", queue="q").is_reply_stream(key)


def test_check_reply_to_names_the_namespace() -> None:
    keys = Keys(prefix="tm", queue="q")
    assert check_reply_to(GenerationRequest(prompt="x"), keys) is None
    assert check_reply_to(GenerationRequest(prompt="x", reply_to="tm:q:reply:mine"), keys) is None
    reason = check_reply_to(GenerationRequest(prompt="x", reply_to="tm:q:cancel"), keys)
    assert reason is not None and "tm:q:reply:" in reason and "tm:q:cancel" in reason
