"""Builders of engine configs and engines for tests: flat keyword arguments, each routed to its
section (``model``, ``cache``, ``scheduler``, ``execution``, ``speculative``, ``length``), so a scenario
reads as one line."""

from __future__ import annotations

from typing import Any

from tokenmill.engine import CacheConfig, Engine, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.engine.config import ExecutionConfig, LengthConfig, SpeculativeConfig

_SECTION_OF = {name: section for section, model in (("model", ModelConfig), ("cache", CacheConfig),
                                                     ("scheduler", SchedulerConfig), ("execution", ExecutionConfig),
                                                     ("speculative", SpeculativeConfig), ("length", LengthConfig))
               for name in model.model_fields}


def engine_config(model: str, **settings: Any) -> EngineConfig:
    """``engine_config("path", device="cpu", block_size=4, max_num_seqs=8)``."""
    sections: dict[str, dict[str, Any]] = {"model": {"name": model}}
    for name, value in settings.items():
        sections.setdefault(_SECTION_OF[name], {})[name] = value
    return EngineConfig.model_validate(sections)


def build_engine(model: str, **settings: Any) -> Engine:
    """A real engine (loads the model) from flat settings."""
    return Engine.from_config(engine_config(model, **settings))
