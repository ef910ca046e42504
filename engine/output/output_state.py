"""What the output processor keeps on a request (``Request.output_state``): its text decoder and how far its
tokens were decoded and its text and tokens handed out. Made on first use by engine/output/output_processor.py,
the one owner (a forked sample starts without one). No torch."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.output.detokenizer import IncrementalDetokenizer, StreamDetokenizer

TextDecoder = IncrementalDetokenizer | StreamDetokenizer  # what engine/output/detokenizer.py makes for a request


@dataclass(slots=True)
class OutputState:
    """One request's output side."""

    detokenizer: TextDecoder
    num_detokenized_tokens: int = 0  # output tokens already appended to the detokenizer
    num_reported_tokens: int = 0  # output tokens already handed out in a RequestOutput
    num_reported_chars: int = 0  # characters of final text already handed out as deltas
