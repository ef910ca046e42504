"""peek_request_id finds an entry's id in any msgpack map, whatever the other values hold: nested
past msgpack's 1,024 levels, extension types, every width of str / bin / int / array / map."""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.protocol.schema import peek_request_id

_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats()
            | st.text(max_size=300) | st.binary(max_size=70_000)
            | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=300)))
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=20)
                       | st.dictionaries(st.text(max_size=5), inner, max_size=20), max_leaves=60)


def _packed(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _entry(*items: tuple[bytes, bytes]) -> dict[bytes, bytes]:
    body = b"".join(key + value for key, value in items)
    header = bytes([0x80 + len(items)]) if len(items) < 16 else b"\xde" + len(items).to_bytes(2, "big")
    return {b"d": header + body, b"v": b"1"}


@given(before=st.dictionaries(st.text(max_size=8).filter(lambda k: k != "id"), _VALUES, max_size=20),
       after=st.dictionaries(st.text(max_size=8).filter(lambda k: k != "id"), _VALUES, max_size=5))
def test_the_id_is_found_among_any_values(before: dict[str, Any], after: dict[str, Any]) -> None:
    items = [(_packed(k), _packed(v)) for k, v in before.items()] + [(_packed("id"), _packed("the-id"))]
    items += [(_packed(k), _packed(v)) for k, v in after.items() if k not in before]
    assert peek_request_id(_entry(*items)) == "the-id"


def test_the_id_is_found_after_a_value_nested_100000_deep() -> None:
    deep = b"\x91" * 100_000 + _packed("leaf")
    entry = _entry((_packed("metadata"), deep), (_packed("id"), _packed("deep")))
    assert peek_request_id(entry) == "deep"


@given(st.binary(max_size=200))
def test_garbage_has_no_id(garbage: bytes) -> None:
    assert peek_request_id({b"d": b"\x81" + _packed("metadata") + garbage, b"v": b"1"}) is None


def test_no_map_or_no_id_has_no_id() -> None:
    assert peek_request_id({b"d": _packed(["id", "x"]), b"v": b"1"}) is None
    assert peek_request_id({b"d": _packed({"prompt": "x"}), b"v": b"1"}) is None
    assert peek_request_id({b"d": "not bytes", b"v": b"1"}) is None
    assert peek_request_id({b"d": _packed({"id": "has space"}), b"v": b"1"}) is None
