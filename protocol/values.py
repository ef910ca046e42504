"""What a single value on the wire may be: valid UTF-8 text, JSON-compatible bounded metadata, the
exact version field, and error text that can always be encoded.

Standard library and msgpack only; never imports torch, the engine or the worker.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack

MAX_METADATA_DEPTH = 32  # containers nested in metadata (and in extra chat-message keys)
MAX_METADATA_BYTES = 64 * 1024  # metadata (and each message's extra keys), msgpack-encoded
MAX_ERROR_CHARS = 4096  # longest error message put in a result
_MSGPACK_INT_MIN, _MSGPACK_INT_END = -(2**63), 2**64  # ints msgpack can encode


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8: no lone surrogates (what undecodable bytes unpack to)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def safe_text(text: str, max_chars: int = MAX_ERROR_CHARS) -> str:
    """``text`` made valid UTF-8 (lone surrogates escaped) and cut to ``max_chars``, for error messages."""
    if not is_utf8(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def require_utf8(value: str) -> str:
    """``value`` unchanged if valid UTF-8.

    Raises:
        ValueError: it holds a lone surrogate.
    """
    if not is_utf8(value):
        raise ValueError("must be valid UTF-8 (it holds a lone surrogate or undecodable bytes)")
    return value


def _check_json(value: Any, depth: int) -> None:
    """Raise ValueError unless ``value`` is JSON-compatible, finite, msgpack-encodable and shallow enough."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        require_utf8(value)
    elif isinstance(value, int):
        if not _MSGPACK_INT_MIN <= value < _MSGPACK_INT_END:
            raise ValueError("integers must fit in 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("numbers must be finite")
    elif depth >= MAX_METADATA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_METADATA_DEPTH} levels")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_json(item, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"keys must be strings, got {type(key).__name__}")
            require_utf8(key)
            _check_json(item, depth + 1)
    else:
        raise ValueError(f"{type(value).__name__} is not JSON-compatible (None, bool, int, float, str, list, dict)")


def check_metadata(value: dict[str, Any]) -> dict[str, Any]:
    """``value`` unchanged if JSON-compatible, at most ``MAX_METADATA_DEPTH`` deep and
    ``MAX_METADATA_BYTES`` msgpack-encoded.

    Raises:
        ValueError: it is not (pydantic reports it as a validation error of the field).
    """
    _check_json(value, 0)
    num_bytes = len(msgpack.packb(value, use_bin_type=True))
    if num_bytes > MAX_METADATA_BYTES:
        raise ValueError(f"{num_bytes} bytes encoded, more than {MAX_METADATA_BYTES}")
    return value


def version_of(raw: Any) -> int | None:
    """The schema version in stream field ``v``, or None when it is not one.

    Redis stores stream values as bytes, so XADD of the int 1 arrives as ``b"1"``: the int and its
    exact decimal text (bytes or str) are accepted; anything else (``b" 1"``, ``b"01"``, ``True``) is not.
    """
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode("ascii", errors="replace")
    if isinstance(raw, str):
        is_canonical = raw.isascii() and raw.isdigit() and raw == str(int(raw))
        return int(raw) if is_canonical else None
    return raw if type(raw) is int else None
