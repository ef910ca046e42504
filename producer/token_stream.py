"""Reading a request's token stream (``Producer.stream``, ``AsyncProducer.stream``, the dashboard): the text deltas
a worker writes, decoded once each and whole. No I/O. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import codecs
from typing import Any

# Token streams re-check the result key this often, to end streams of requests that
# finished without a token stream (e.g. errors, or stream_tokens=False).
STREAM_SLICE_S = 0.5


class TokenStreamReader:
    """Decodes a token stream's entries (``t`` = UTF-8 bytes of a text delta, ``o`` = the byte offset
    where it starts, ``end`` = last) for both producers: a character split across two entries comes
    out whole, and each byte of the text comes out once.

    NOTE: a reclaimed request runs again from the start while its earlier run's deltas are in the
    stream already (and a paused worker that was reclaimed goes on writing its own): the offset says
    which bytes a delta repeats. A delta without ``o`` (an older worker) continues the text.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_bytes = 0  # bytes of the text decoded so far
        self.last_id: bytes = b"0"
        self.is_done = False

    def feed(self, reply: Any) -> list[str]:
        """Text deltas of one XREAD reply; sets ``is_done`` at the end marker."""
        entries: list[tuple[bytes, dict[bytes, bytes]]] = reply[0][1] if reply else []
        texts: list[str] = []
        for entry_id, fields in entries:
            self.last_id = entry_id
            is_end = b"end" in fields
            text = self._decoder.decode(self._new_bytes(fields), final=is_end)
            if text:
                texts.append(text)
            if is_end:
                self.is_done = True
                break
        return texts

    def _new_bytes(self, fields: dict[bytes, bytes]) -> bytes:
        """The bytes of a delta past those already decoded (all of them after a gap)."""
        data = fields.get(b"t", b"")
        try:
            offset = int(fields[b"o"])
        except (KeyError, ValueError):
            offset = self._num_bytes
        new = data[max(0, self._num_bytes - offset):]
        self._num_bytes = max(self._num_bytes, offset + len(data))
        return new
