"""The log line every tokenmill process writes (the worker and ``tokenmill serve``): one line per
event on stderr, text or JSON. Standard library only. Events carry ``extra={"event": ..., **fields}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable

# NOTE: color_message is uvicorn's copy of its message with terminal colours: not a field
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime",
                                                                                   "color_message"}


class LineFormatter(logging.Formatter):
    """``HH:MM:SS LEVEL message key=value ...``, or with ``as_json`` one JSON object
    (``ts``, ``level``, ``msg`` and the event's fields)."""

    def __init__(self, as_json: bool) -> None:
        super().__init__()
        self._as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        # NOTE: a traceback (exc_info=True, log.exception) or stack (stack_info=True) is the point of
        # such a line: "thread died" without one says nothing of why
        trace = "\n".join(filter(None, [self.formatException(record.exc_info) if record.exc_info else "",
                                         self.formatStack(record.stack_info) if record.stack_info else ""]))
        if self._as_json:
            line = {"ts": round(record.created, 3), "level": record.levelname, "msg": record.getMessage(), **fields}
            if trace:
                line["traceback"] = trace
            return json.dumps(line, default=str)
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        extras = " ".join(f"{k}={v}" for k, v in fields.items() if k != "event")
        text = f"{stamp} {record.levelname:<7} {record.getMessage()} {extras}".rstrip()
        return f"{text}\n{trace}" if trace else text


def log_to_stderr(loggers: Iterable[str], level: str | int, as_json: bool) -> None:
    """Send the ``loggers`` (and their children) to stderr as :class:`LineFormatter` lines, at ``level``;
    they stop propagating, so nothing prints a line twice."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter(as_json))
    for name in loggers:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
