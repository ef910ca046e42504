"""tokenmill: a queue-fed LLM batch worker, installed as one package.

The repository keeps one folder per part (``protocol/``, ``producer/``, ``engine/``, ``worker/``,
``serve/``, ``cli/``); this package holds them as subpackages (``tokenmill.producer`` and so on), so
an install adds a single top-level name to a virtualenv. The names most code needs are here too,
loaded on first use: ``from tokenmill import Producer`` pays for the producer only, and importing
``tokenmill.engine`` does not load the producer (the engine knows nothing of Redis).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.engine import Engine, EngineConfig
    from tokenmill.producer import AsyncProducer, Producer, SubmitOptions
    from tokenmill.protocol.outcomes import ErrorCode, FinishReason
    from tokenmill.protocol.sampling import SamplingParams

# Each common name and the module that defines it.
_HOMES = {
    "Producer": "tokenmill.producer",
    "AsyncProducer": "tokenmill.producer",
    "SubmitOptions": "tokenmill.producer",
    "SamplingParams": "tokenmill.protocol.sampling",
    "FinishReason": "tokenmill.protocol.outcomes",
    "ErrorCode": "tokenmill.protocol.outcomes",
    "Engine": "tokenmill.engine",
    "EngineConfig": "tokenmill.engine",
}

__all__ = ["AsyncProducer", "Engine", "EngineConfig", "ErrorCode", "FinishReason", "Producer", "SamplingParams",
           "SubmitOptions"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
