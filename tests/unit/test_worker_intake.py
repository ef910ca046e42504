"""Triage's id check: a request is run only under the id a failure would be answered under (the first ``id`` of
its map, what peek_request_id finds); the byte comparison that spares most entries the peek agrees with it."""

from __future__ import annotations

import time
from typing import Any

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.wire_helpers import as_redis_returns
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import GenerationRequest, encode_request, peek_request_id, request_id_error
from tokenmill.worker.intake import IntakePolicy, _starts_with_id, triage
from tokenmill.worker.messages import Admit, DeadLetter, Entry

KEYS = Keys("intake")
POLICY = IntakePolicy(KEYS, frozenset({"echo"}), "w", 4 << 20)


def _fields(*items: tuple[Any, Any], header: bytes | None = None) -> dict[bytes, bytes]:
    """An entry whose map holds ``items`` in this order (duplicates kept), msgpack-encoded one by one."""
    body = b"".join(msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True) for k, v in items)
    return {b"d": (header or bytes([0x80 + len(items)])) + body, b"v": b"1"}


def _triage(fields: dict[bytes, bytes], stream: str | None = None) -> Admit | Any:
    return triage(Entry(stream or KEYS.lane(0), "1-0", 0, fields), time.time(), POLICY)


def test_a_producer_encoded_request_is_admitted() -> None:
    request = GenerationRequest(prompt="hello", params={"max_tokens": 4})
    fields = as_redis_returns(encode_request(request))
    admit = _triage(fields)
    assert isinstance(admit, Admit) and admit.request.id == request.id and not admit.is_handed_off
    assert _starts_with_id(fields, request.id)


def test_an_id_after_other_keys_or_not_shortest_is_found_by_the_peek() -> None:
    admit = _triage(_fields(("prompt", "hi"), ("id", "later")))
    assert isinstance(admit, Admit) and admit.request.id == "later"
    # NOTE: str16 for a 2-byte id, where msgpack writes a fixstr: no byte match, the peek finds it
    wide = {b"d": b"\x82" + msgpack.packb("id") + b"\xda\x00\x02ab" + msgpack.packb("prompt") + msgpack.packb("x"),
            b"v": b"1"}
    assert not _starts_with_id(wide, "ab")
    admit = _triage(wide)
    assert isinstance(admit, Admit) and admit.request.id == "ab"
    long_id = "x" * 200  # str8 on the wire
    admit = _triage(_fields(("id", long_id), ("prompt", "hi")))
    assert isinstance(admit, Admit) and admit.request.id == long_id


def test_a_map_with_two_ids_is_dead_lettered_whichever_comes_first() -> None:
    """Decoding keeps the last ``id``, an error answer would go to the first: the request has no one id."""
    for items in ((("id", "first"), ("prompt", "hi"), ("id", "last")), (("prompt", "hi"), ("id", "a"), ("id", "b"))):
        dead = _triage(_fields(*items))
        assert isinstance(dead, DeadLetter) and "no id to answer it under" in dead.reason


def test_a_request_read_from_a_decode_lane_is_handed_off() -> None:
    request = GenerationRequest(prompt="hello")
    fields = as_redis_returns(encode_request(request))
    lane = KEYS.lanes_for([], is_decode=True)[0]
    for _ in range(2):  # NOTE: the second from the policy's memory of the stream
        admit = _triage(fields, lane.stream)
        assert isinstance(admit, Admit) and admit.is_handed_off


_IDS = st.text(min_size=1, max_size=300).filter(lambda i: request_id_error(i) is None)


@given(request_id=_IDS, other=_IDS, extra=st.dictionaries(st.text(max_size=6), st.integers(-(2**63), 2**64 - 1)
                                                          | st.text(max_size=40),
                                                          max_size=20),
       id_first=st.booleans(), num_pairs_wide=st.booleans())
def test_a_byte_match_means_the_peek_finds_the_same_id(request_id: str, other: str, extra: dict[str, Any],
                                                        id_first: bool, num_pairs_wide: bool) -> None:
    others = [(k, v) for k, v in extra.items() if k != "id"]
    items = [("id", request_id), *others] if id_first else [*others, ("id", request_id)]
    header = b"\xde" + len(items).to_bytes(2, "big") if num_pairs_wide or len(items) > 15 else None
    fields = _fields(*items, header=header)
    assert _starts_with_id(fields, request_id) == (id_first or not others)
    assert peek_request_id(fields) == request_id
    if other != request_id:
        assert not _starts_with_id(fields, other)
