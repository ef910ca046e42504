"""tokenmill's continuous-batching inference engine. Knows nothing of Redis, Celery or msgpack.

Importing it needs no torch: only ``Engine.from_config`` loads a model.
"""

from __future__ import annotations

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.stats import EngineStats
from engine.engine import Engine
from engine.errors import EngineError, InvariantError, ModelLoadError
from engine.offline import GenerationOutput
from engine.output.prompts import ChatPrompt, Prompt, PromptError, TextPrompt, TokensPrompt
from engine.output.request_output import RequestMetrics, RequestOutput
from protocol.outcomes import ErrorCode, FinishReason
from protocol.sampling import SamplingParams

__all__ = [
    "CacheConfig",
    "ChatPrompt",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "GenerationOutput",
    "InvariantError",
    "ModelConfig",
    "ModelLoadError",
    "Prompt",
    "PromptError",
    "ErrorCode",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "TextPrompt",
    "TokensPrompt",
]
