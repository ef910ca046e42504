"""Heartbeats across releases: the speculation and length-prediction fields are optional, so a beat from an older
worker still decodes (and reads as no speculation, no prediction), and an older reader ignores them."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
from pydantic import create_model

from tokenmill.protocol.heartbeat import Heartbeat, JobBacklog, decode_heartbeat, encode_heartbeat

PREDICTION_FIELDS = ("backlog_tokens", "mean_length", "jobs")


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


def test_prediction_fields_round_trip() -> None:
    jobs = {"tm:default:reply:bulk-a": JobBacklog(num_requests=3, backlog_tokens=412.5, mean_length=180.0),
            "tm:default:reply:bulk-b": JobBacklog(num_requests=1, backlog_tokens=20.0)}
    beat = Heartbeat(name="w", ts=time.time(), backlog_tokens=432.5, mean_length=150.0, jobs=jobs)
    decoded = decode_heartbeat("w", encode_heartbeat(beat))
    assert decoded is not None
    assert (decoded.backlog_tokens, decoded.mean_length, decoded.jobs) == (432.5, 150.0, jobs)
    assert decoded.jobs["tm:default:reply:bulk-b"].mean_length is None


def test_a_beat_without_prediction_fields_decodes_as_no_prediction() -> None:
    """What a worker of an older release writes, as msgpack'd by it: none of the prediction keys."""
    old = {key: value for key, value in Heartbeat(name="w", ts=time.time()).model_dump().items()
           if key not in PREDICTION_FIELDS}
    decoded = decode_heartbeat("w", msgpack.packb(old, use_bin_type=True))
    assert decoded is not None
    assert (decoded.backlog_tokens, decoded.mean_length, decoded.jobs) == (None, None, {})


def test_an_older_reader_parses_a_beat_with_prediction_fields() -> None:
    """The heartbeat model of the release before them (same config, without the fields) reads a new worker's beat."""
    fields: dict[str, Any] = {name: (info.annotation, info) for name, info in Heartbeat.model_fields.items()
              if name not in PREDICTION_FIELDS}
    older = create_model("OlderHeartbeat", __config__=Heartbeat.model_config, **fields)
    beat = Heartbeat(name="w", ts=time.time(), running=2, backlog_tokens=10.0, mean_length=5.0,
                     jobs={"job": JobBacklog(num_requests=2, backlog_tokens=10.0, mean_length=5.0)})
    parsed = older.model_validate(msgpack.unpackb(encode_heartbeat(beat), raw=False)).model_dump()
    assert parsed["running"] == 2 and not set(PREDICTION_FIELDS) & set(parsed)


def test_a_malformed_job_makes_the_beat_unreadable_not_an_error() -> None:
    fields = {**Heartbeat(name="w", ts=time.time()).model_dump(), "jobs": {"job": {"num_requests": "many"}}}
    assert decode_heartbeat("w", msgpack.packb(fields, use_bin_type=True)) is None


LAYOUT_FIELDS = ("prefix", "queue", "num_lanes", "shards", "hash_tag", "cluster")


def test_the_queue_layout_round_trips_and_an_older_beat_has_none() -> None:
    """Workers publish the layout of the queue they read (producers compare theirs: producer/worker_check.py); a
    worker of an older release wrote none of these keys, and its beat still decodes."""
    beat = Heartbeat(name="w", ts=time.time(), prefix="tm", queue="q", num_lanes=3, shards=4, hash_tag=True,
                     cluster=False)
    decoded = decode_heartbeat("w", encode_heartbeat(beat))
    assert decoded is not None
    assert tuple(getattr(decoded, key) for key in LAYOUT_FIELDS) == ("tm", "q", 3, 4, True, False)
    old = {key: value for key, value in beat.model_dump().items() if key not in LAYOUT_FIELDS}
    decoded = decode_heartbeat("w", msgpack.packb(old, use_bin_type=True))
    assert decoded is not None
    assert all(getattr(decoded, key) is None for key in LAYOUT_FIELDS)
