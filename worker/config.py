"""The worker process's settings: ``WorkerConfig``, ``EchoConfig`` and the root ``Settings``
(TOML file < env ``TOKENMILL_*`` < explicit arguments). Pydantic only; never imports redis or torch.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from pathlib import Path
from typing import Any, cast

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from engine.config import EngineConfig
from producer.config import RedisConfig
from producer.keys import DEFAULT_NUM_LANES, DEFAULT_PREFIX, DEFAULT_QUEUE, DONE_TTL_S, Keys
from worker.errors import ConfigError


def default_worker_name() -> str:
    """``host-pid-random``: unique per process, readable in heartbeats and XINFO."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerConfig(_Frozen):
    """How the worker reads, leases, answers and shuts down."""

    queue: str = Field(DEFAULT_QUEUE, min_length=1, description="queue served; no ':'")
    prefix: str = Field(DEFAULT_PREFIX, min_length=1, description="key namespace")
    num_lanes: int = Field(DEFAULT_NUM_LANES, ge=1, le=64, description="priority lanes; lane k -> engine priority k")
    name: str = Field(default_factory=default_worker_name, min_length=1, description="consumer name in the group")
    max_waiting: int = Field(32, ge=1, description="stop reading while engine-waiting + queued admits reach this")
    read_count: int = Field(64, ge=1, description="most entries per XREADGROUP")
    block_ms: int = Field(1000, ge=1, le=4000, description="XREADGROUP BLOCK of an idle worker")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="how often the heartbeat is written")
    stale_after_s: float = Field(15.0, gt=0, description="heartbeat age after which a worker counts as dead")
    reclaim_interval_s: float = Field(5.0, gt=0, description="how often dead workers' entries are reclaimed")
    reclaim_min_idle_ms: int = Field(1000, ge=0, description="entries idle less than this are not claimed")
    max_deliveries: int = Field(5, ge=1, description="deliveries before an entry is dead-lettered")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="larger requests are answered prompt_too_long "
                                   "before they are decoded or tokenized")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM: time to finish started requests")
    result_ttl_s: float = Field(86_400.0, gt=0, description="lifetime of stored results")
    done_ttl_s: float = Field(float(DONE_TTL_S), gt=0, description="lifetime of done lists (BLPOP waiters)")
    token_ttl_s: float = Field(3600.0, gt=0, description="lifetime of a token stream after its last entry")
    cancel_ttl_s: float = Field(86_400.0, gt=0, description="cancel marks older than this are trimmed")
    # NOTE: every poll wakes the writer thread and Redis; at 20 Hz those wake-ups cost ~8% of a
    # 2-core CPU engine's throughput (ops/bench/bulk.py). 4 Hz keeps cancels under ~0.25 s.
    cancel_poll_s: float = Field(0.25, gt=0, le=5, description="cancellation check period (one ZMSCORE)")
    trim_interval_s: float = Field(60.0, gt=0, description="how often old cancel marks and heartbeats are trimmed")
    heartbeat_forget_s: float = Field(86_400.0, gt=0, description="stale heartbeats are deleted after this")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="serve Prometheus metrics on this port")
    metrics_host: str = Field("127.0.0.1", min_length=1, description="address the metrics endpoint binds; "
                              "0.0.0.0 to let a remote Prometheus scrape it")
    log_json: bool = Field(False, description="one JSON object per log line")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")

    @field_validator("name", "queue", "prefix")
    @classmethod
    def _no_space(cls, value: str) -> str:
        if any(ch.isspace() for ch in value):
            raise ValueError("must not contain whitespace")
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("must be DEBUG, INFO, WARNING or ERROR")
        return value.upper()

    @model_validator(mode="after")
    def _check(self) -> WorkerConfig:
        Keys(self.prefix, self.queue, self.num_lanes)  # raises ValueError with the reason
        if self.stale_after_s < 2 * self.heartbeat_interval_s:
            raise ValueError("stale_after_s must be at least 2 x heartbeat_interval_s (a live worker must not look dead)")
        return self

    @property
    def keys(self) -> Keys:
        """Key layout of the served queue."""
        return Keys(self.prefix, self.queue, self.num_lanes)


class EchoConfig(_Frozen):
    """The torch-free echo engine (``engine.model = "echo"``): tests and queue benchmarks."""

    tokens_per_step: int = Field(0, ge=0, description="tokens each request gets per step; 0 = all in one step")
    step_delay_s: float = Field(0.0, ge=0, description="simulated forward time per step")


class Settings(BaseSettings):
    """Everything one worker process needs. Precedence: arguments > env > TOML file > defaults."""

    model_config = SettingsConfigDict(env_prefix="TOKENMILL_", env_nested_delimiter="__", extra="forbid",
                                      frozen=True)

    worker: WorkerConfig = Field(default_factory=lambda: WorkerConfig.model_validate({}))
    redis: RedisConfig = Field(default_factory=lambda: RedisConfig.model_validate({}))
    engine: EngineConfig = Field(default_factory=lambda: EngineConfig.model_validate({}))
    echo: EchoConfig = Field(default_factory=lambda: EchoConfig.model_validate({}))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)


def load_settings(config_file: Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Settings:
    """Merge defaults, the TOML file, ``TOKENMILL_*`` env vars and explicit overrides.

    Args:
        config_file: a TOML file with ``[worker]``, ``[redis]``, ``[engine]``, ``[echo]`` tables.
        overrides: section -> {field: value}; None values are ignored (flag not given).

    Raises:
        ConfigError: the file is missing or not TOML.
        pydantic.ValidationError: a value is invalid or a key unknown (listed field by field).
    """
    if config_file is not None:
        try:
            tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc

    class _FromFile(Settings):
        model_config = SettingsConfigDict(toml_file=config_file)

    explicit = {section: {k: v for k, v in values.items() if v is not None}
                for section, values in (overrides or {}).items()}
    settings_cls = cast(Any, _FromFile)  # NOTE: sections are dicts here; the sources validate them
    return cast(Settings, settings_cls(**{section: values for section, values in explicit.items() if values}))
