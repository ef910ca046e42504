"""Structured logging of the worker process (its ``tokenmill.*`` events and the ``engine.*``
loggers): one line per event, text or JSON. Standard library only. Events carry
``extra={"event": ..., **fields}``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class _Formatter(logging.Formatter):
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


def setup_logging(level: str = "INFO", as_json: bool = False) -> None:
    """Send ``tokenmill.*`` and ``engine.*`` logs to stderr, one line per event; with ``as_json``
    every line is a JSON object, so Hugging Face's progress bars (weights loading) are switched off."""
    if as_json:
        _disable_hugging_face_progress_bars()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(as_json))
    for name in ("tokenmill", "engine"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


def _disable_hugging_face_progress_bars() -> None:
    """Hugging Face's tqdm bars off: for libraries imported later by the environment variable both
    read at import, for those already imported by their own switch (imported here only if they are)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    hub_utils = sys.modules.get("huggingface_hub.utils")
    if hub_utils is not None:
        hub_utils.disable_progress_bars()
    transformers_logging = sys.modules.get("transformers.utils.logging")
    if transformers_logging is not None:
        transformers_logging.disable_progress_bar()
