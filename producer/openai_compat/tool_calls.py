"""Tool calls read back from a model's answer, whole (:func:`parse_answer`) or as it streams
(:class:`ToolCallStream`); both read the same text the same way.

An answer is a call when it is, all of it, a JSON object ``{"name": <an offered function>,
"arguments": {...}}`` (``"parameters"`` is read as ``"arguments"``, as Llama 3.1 writes it) or a
JSON array of them: the format a forced call's schema produces and the tools preamble asks for
(engine/output/prompts.py). Calls may also come in Hermes-style ``<tool_call>{...}</tool_call>`` blocks
(Qwen 2.5, Hermes and other templates that render tools ask for them); text outside the blocks is
the content. Anything else, a call naming a function that was not offered included, is content:
never dropped.

Pure: no I/O; never imports torch, the engine, the worker or a web framework.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "type"})


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (OpenAI sends them as a string)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedAnswer:
    """An answer as content and calls (content is None when there is none besides the calls)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


def call_id(request_id: str, choice: int, index: int) -> str:
    """The ``id`` of call ``index`` of choice ``choice``: the same in every answer of one request
    (a stream, a batch line read twice)."""
    return "call_" + hashlib.sha256(f"{request_id}:{choice}:{index}".encode()).hexdigest()[:24]


def parse_answer(text: str, names: frozenset[str]) -> ParsedAnswer:
    """The calls in ``text`` naming functions in ``names``, and the content around them."""
    calls = _json_calls(text, names)
    if calls:
        return ParsedAnswer(None, calls)
    head, tag, tail = text.partition(TOOL_CALL_OPEN)
    tagged = _tagged_calls(tag + tail, names) if tag else None
    if tagged is None:
        return ParsedAnswer(text)
    calls, rest = tagged
    content = head + rest
    return ParsedAnswer(content if content.strip() else None, calls)


def _json_calls(text: str, names: frozenset[str]) -> tuple[ToolCall, ...]:
    """The calls ``text`` is, as one JSON object or array; none when it is anything else."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return ()
    try:
        value = json.loads(stripped)
    except ValueError:
        return ()
    items = value if isinstance(value, list) else [value]
    calls = [_call(item, names) for item in items]
    if not items or any(call is None for call in calls):
        return ()
    return tuple(call for call in calls if call is not None)


def _call(item: Any, names: frozenset[str]) -> ToolCall | None:
    if not isinstance(item, dict) or not set(item) <= _CALL_KEYS or item.get("name") not in names:
        return None
    if item.get("type", "function") != "function" or ("arguments" in item and "parameters" in item):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):  # NOTE: some models write the arguments as OpenAI sends them: JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def _tagged_calls(text: str, names: frozenset[str]) -> tuple[tuple[ToolCall, ...], str] | None:
    """The calls of ``<tool_call>`` blocks (the last one may lack its closing tag) and the text
    between and after them that is not whitespace; None unless every block holds calls."""
    calls: list[ToolCall] = []
    rest: list[str] = []
    position = 0
    while position < len(text):
        start = text.find(TOOL_CALL_OPEN, position)
        if start < 0:
            rest.append(text[position:])
            break
        rest.append(text[position:start])
        end = text.find(TOOL_CALL_CLOSE, start)
        block = _json_calls(text[start + len(TOOL_CALL_OPEN):end if end >= 0 else len(text)], names)
        if not block:
            return None
        calls.extend(block)
        position = len(text) if end < 0 else end + len(TOOL_CALL_CLOSE)
    return tuple(calls), "".join(part for part in rest if part.strip())


class ToolCallStream:
    """Reads an answer as it streams: text that cannot begin a call is content at once; from where
    a call may begin (a first ``{`` or ``[``, or a ``<tool_call>`` tag) it is held back, and read
    when the answer is complete (:meth:`finish`). What is streamed plus what :meth:`finish` returns
    is what :func:`parse_answer` reads in the whole text.

    Args:
        names: the functions a call may name.
    """

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names
        self._held = ""
        self._mode: Literal["undecided", "content", "held"] = "undecided"

    def feed(self, text: str) -> str:
        """The content to send now for the next piece of the answer ("" while it is held back)."""
        self._held += text
        if self._mode == "undecided":
            start = self._held.lstrip()
            if not start or (len(start) < len(TOOL_CALL_OPEN) and TOOL_CALL_OPEN.startswith(start)):
                return ""
            self._mode = "held" if start.startswith(("{", "[", TOOL_CALL_OPEN)) else "content"
        return self._release() if self._mode == "content" else ""

    def finish(self) -> ParsedAnswer:
        """The content not sent yet and the calls, once the answer is complete."""
        held, self._held = self._held, ""
        return parse_answer(held, self._names)

    def _release(self) -> str:
        """The held content up to a ``<tool_call>`` tag (holding from there) or a tail that may begin one."""
        index = self._held.find(TOOL_CALL_OPEN)
        if index >= 0:
            self._mode = "held"
        else:
            index = len(self._held) - _partial_tag_length(self._held)
        out, self._held = self._held[:index], self._held[index:]
        return out


def _partial_tag_length(text: str) -> int:
    """How many of ``text``'s last characters begin a ``<tool_call>`` tag."""
    for length in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:length]):
            return length
    return 0
