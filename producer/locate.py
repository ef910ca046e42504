"""Where a request is (``Producer.locate``, the dashboard's request page): in a lane (waiting or running), answered,
or neither; read from the lanes' entries a page at a time. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from tokenmill.protocol.schema import peek_request_id

LOCATE_PAGE = 1000  # lane entries per XRANGE while looking requests up (Producer.locate)

# Where a request is (Producer.locate): in a lane (waiting or running), answered, or neither.
RequestState = Literal["queued", "finished", "unknown"]


def ids_in_entries(entries: Sequence[tuple[bytes, Mapping[bytes, bytes]]], wanted: set[str]) -> list[str]:
    """The request ids of ``wanted`` that lane ``entries`` (XRANGE replies) carry."""
    return [rid for _, fields in entries if (rid := peek_request_id(dict(fields))) is not None and rid in wanted]
