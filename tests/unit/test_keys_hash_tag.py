"""Keys in hash-tag mode: every key of a queue shares one Redis Cluster slot."""

from __future__ import annotations

import pytest

from tokenmill.protocol.keys import Keys


def test_hash_tag_wraps_prefix_and_queue_in_every_key() -> None:
    keys = Keys("tm", "batch", 2, hash_tag=True)
    names = [*keys.lanes, keys.result("a"), keys.done("a"), keys.tokens("a"), keys.submitted("a"),
             keys.dead, keys.cancel, keys.workers]
    assert all(name.startswith("{tm:batch}:") for name in names)
    assert keys.lane(1) == "{tm:batch}:lane:1"


def test_default_layout_is_unchanged() -> None:
    keys = Keys("tm", "batch")
    assert keys.lane(0) == "tm:batch:lane:0"
    assert keys.submitted("x") == "tm:batch:sub:x"


def test_hash_tag_rejects_braces() -> None:
    with pytest.raises(ValueError, match="must not contain"):
        Keys("{tm}", "batch", hash_tag=True)
