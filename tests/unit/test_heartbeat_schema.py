"""Heartbeats across releases: the speculation fields are optional, so a beat from an older worker still
decodes (and reads as no speculation), and an older reader ignores them."""

from __future__ import annotations

import time

import msgpack
import pytest

from tokenmill.protocol.heartbeat import Heartbeat, decode_heartbeat, encode_heartbeat


def test_speculation_fields_round_trip() -> None:
    beat = Heartbeat(name="w", ts=time.time(), spec_acceptance_rate=0.92, spec_mean_accepted_length=3.1)
    decoded = decode_heartbeat("w", encode_heartbeat(beat))
    assert decoded is not None
    assert decoded.spec_acceptance_rate == pytest.approx(0.92)
    assert decoded.spec_mean_accepted_length == pytest.approx(3.1)


def test_a_beat_without_speculation_fields_decodes_as_no_speculation() -> None:
    """What a worker of an older release writes: no ``spec_*`` keys at all."""
    old = {"name": "w", "ts": time.time(), "state": "running", "pid": 1, "host": "h", "started_at": time.time(),
           "model": "echo", "served_model_name": "echo", "model_names": ["echo"], "running": 0, "waiting": 0,
           "tokens_per_s": 0.0, "num_finished": 0, "prefix_hit_ratio": 0.0, "num_cached_blocks": 0}
    decoded = decode_heartbeat("w", msgpack.packb(old, use_bin_type=True))
    assert decoded is not None
    assert decoded.spec_acceptance_rate is None and decoded.spec_mean_accepted_length is None


def test_fields_of_a_newer_release_are_ignored() -> None:
    """As an older reader does with the ``spec_*`` fields: a key it does not know never makes a beat unreadable."""
    fields = Heartbeat(name="w", ts=time.time(), spec_acceptance_rate=0.5, spec_mean_accepted_length=1.0).model_dump()
    decoded = decode_heartbeat("w", msgpack.packb({**fields, "spec_of_a_later_release": [1, 2]}, use_bin_type=True))
    assert decoded is not None and decoded.spec_acceptance_rate == 0.5


def test_a_beat_with_no_drafts_yet_encodes_none() -> None:
    beat = Heartbeat(name="w", ts=time.time())
    raw = msgpack.unpackb(encode_heartbeat(beat), raw=False)
    assert raw["spec_acceptance_rate"] is None and raw["spec_mean_accepted_length"] is None
