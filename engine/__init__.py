"""tokenmill's continuous-batching inference engine. Knows nothing of Redis, Celery or msgpack.

``Engine`` is imported lazily so that the pure parts (config, scheduler, sampling params)
load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.errors import EngineError, InvariantError, ModelLoadError
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.offline import GenerationOutput

__all__ = [
    "CacheConfig",
    "Engine",
    "EngineConfig",
    "EngineError",
    "GenerationOutput",
    "InvariantError",
    "ModelLoadError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name == "GenerationOutput":
        from engine.offline import GenerationOutput

        return GenerationOutput
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
