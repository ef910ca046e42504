"""tokenmill's continuous-batching inference engine. Knows nothing of Redis, Celery or msgpack.

Importing it needs no torch: only ``Engine.from_config`` loads a model.
"""

from __future__ import annotations

from tokenmill.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.engine import Engine
from tokenmill.engine.errors import EngineError, InvariantError, ModelLoadError
from tokenmill.engine.offline import GenerationOutput
from tokenmill.engine.output.prompts import ChatPrompt, Prompt, PromptError, TextPrompt, TokensPrompt
from tokenmill.engine.output.request_output import RequestMetrics, RequestOutput

__all__ = [
    "CacheConfig",
    "ChatPrompt",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "GenerationOutput",
    "InvariantError",
    "ModelConfig",
    "ModelLoadError",
    "Prompt",
    "PromptError",
    "RequestMetrics",
    "RequestOutput",
    "SchedulerConfig",
    "TextPrompt",
    "TokensPrompt",
]
