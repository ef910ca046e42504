"""Reading a JSON request body: the bytes come through the guard (limited, timed), the parse of a
large one runs in a thread so the event loop keeps serving other clients, and any body
``json.loads`` refuses is a 400 in OpenAI's shape.

Imports fastapi and serve.errors; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request

from tokenmill.serve.errors import APIError

# NOTE: json.loads runs at roughly 100-300 MB/s: below this a parse takes about a millisecond, less
# than the hand-off to a thread costs; above it, it would hold every other client up.
THREAD_PARSE_BYTES = 256 << 10


def parse_json(raw: bytes) -> Any:
    """``json.loads`` (module level so a test can watch where it runs)."""
    return json.loads(raw)


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object.

    Raises:
        APIError: 400 when it is not JSON (bad syntax or encoding, nested past the parser's depth,
            an integer past Python's 4300-digit conversion limit) or not an object; 413 / 408 from
            the guard while it is read.
    """
    raw = await request.body()
    try:
        body = await asyncio.to_thread(parse_json, raw) if len(raw) > THREAD_PARSE_BYTES else parse_json(raw)
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the int-str digit limit
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body
