"""Builders of engine configs and engines for tests: flat keyword arguments, each routed to its
section (``model``, ``cache``, ``scheduler``, ``execution``, ``speculative``, ``length``, ``fleet_cache``), so a
scenario reads as one line."""

from __future__ import annotations

from typing import Any

from tokenmill.engine import CacheConfig, Engine, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.engine.config import ExecutionConfig, FleetCacheConfig, LengthConfig, SpeculativeConfig
from tokenmill.engine.kv.block_store import BlockStore
from tokenmill.worker.store_io import StoreFleetIO

_SECTION_OF = {name: section for section, model in (("model", ModelConfig), ("cache", CacheConfig),
                                                     ("scheduler", SchedulerConfig), ("execution", ExecutionConfig),
                                                     ("speculative", SpeculativeConfig), ("length", LengthConfig),
                                                     ("fleet_cache", FleetCacheConfig))
               for name in model.model_fields}
assert len(_SECTION_OF) == sum(len(m.model_fields) for m in (ModelConfig, CacheConfig, SchedulerConfig, ExecutionConfig,
                                                             SpeculativeConfig, LengthConfig, FleetCacheConfig)), \
    "two sections share a field name: route it explicitly"


def engine_config(model: str, **settings: Any) -> EngineConfig:
    """``engine_config("path", device="cpu", block_size=4, max_num_seqs=8)``."""
    sections: dict[str, dict[str, Any]] = {"model": {"name": model}}
    for name, value in settings.items():
        sections.setdefault(_SECTION_OF[name], {})[name] = value
    return EngineConfig.model_validate(sections)


def build_engine(model: str, block_store: BlockStore | None = None, **settings: Any) -> Engine:
    """A real engine (loads the model) from flat settings; ``block_store``: the fleet cache's store (then on)."""
    if block_store is not None:
        settings.setdefault("enabled", True)
        return Engine.from_config(engine_config(model, **settings),
                                  fleet_io_for=lambda _, rules: StoreFleetIO(block_store, rules))
    return Engine.from_config(engine_config(model, **settings))
