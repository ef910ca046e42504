"""Structured logging of the worker process (its ``tokenmill.*`` events and the ``engine.*``
loggers): one line per event, text or JSON (protocol/logs.py). Standard library only. Events carry
``extra={"event": ..., **fields}``.
"""

from __future__ import annotations

import os
import sys

from tokenmill.protocol.logs import log_to_stderr


def setup_logging(level: str = "INFO", as_json: bool = False) -> None:
    """Send ``tokenmill.*`` and ``engine.*`` logs to stderr, one line per event; with ``as_json``
    every line is a JSON object, so Hugging Face's progress bars (weights loading) are switched off."""
    if as_json:
        _disable_hugging_face_progress_bars()
    log_to_stderr(("tokenmill", "engine"), level, as_json)


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
