"""What a batch object says of its work beyond counts: ``usage``, summed over the results in its
output file, and ``model``: the served name the results give, or before any result the name its
request lines ask for. Both read the JSONL files line by line (never whole in memory), in a thread.

Imports nothing of tokenmill; never torch, the engine or the worker.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class OutputSummary:
    usage: dict[str, Any]  # OpenAI's BatchUsage
    model: str | None  # the served model the results name


def requested_model(input_path: Path) -> str | None:
    """The ``body.model`` of the first request line that names one (lines that are not JSON skipped:
    they land in the error file)."""
    with input_path.open("rb") as lines:
        for raw in lines:
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):
                continue
            body = record.get("body") if isinstance(record, dict) else None
            model = body.get("model") if isinstance(body, dict) else None
            if isinstance(model, str) and model:
                return model
    return None


def summarize_output(output_path: Path) -> OutputSummary:
    """Token usage summed over an OpenAI-format output file (every line a 200 with a completion body,
    as the bulk pipeline writes it; none written yet: zero) and the model its first line names."""
    input_tokens = output_tokens = 0
    model: str | None = None
    with contextlib.suppress(FileNotFoundError), output_path.open("rb") as lines:
        for raw in lines:
            body = json.loads(raw)["response"]["body"]
            input_tokens += body["usage"]["prompt_tokens"]
            output_tokens += body["usage"]["completion_tokens"]
            model = model or body["model"]
    # NOTE: results report no prefix-cache hits or reasoning tokens per request; OpenAI's shape requires the fields.
    usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": input_tokens + output_tokens}
    return OutputSummary(usage, model)
