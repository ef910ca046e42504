"""The worker process's settings: ``WorkerConfig`` and the root ``Settings`` (sections ``[queue]``,
``[redis]``, ``[worker]``, ``[engine]``; flags > env > TOML file > defaults, see
:class:`protocol.config.FileSettings`). Pydantic only; never imports redis or torch.
NOTE: measurements behind these choices: ops/bench/README.md, "Figures behind the kernels' comments".
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from tokenmill.engine.config import EngineConfig, accept_renamed
from tokenmill.engine.echo import ECHO_MODEL, EchoOptions, is_echo_model
from tokenmill.protocol.config import FileSettings, Name, QueueConfig, RedisConfig, ServeConfig
from tokenmill.protocol.heartbeat import STALE_AFTER_S

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]  # any case on input


def default_worker_name() -> str:
    """``host-pid-random``: unique per process, readable in heartbeats and XINFO."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def default_served_name(model: str) -> str:
    """The name a model is served under when ``served_model_name`` is not set: ``echo`` for the echo
    engine, a local directory's or ``.gguf`` file's name (no trailing slash, no ``.gguf``), else the
    name as configured (an alias such as ``smollm2-135m`` or a Hugging Face id)."""
    if is_echo_model(model):
        return ECHO_MODEL
    path = Path(model.rstrip("/") or model)
    if path.exists():
        return path.stem if path.suffix == ".gguf" else path.name
    return model


class WorkerConfig(BaseModel):
    """How the worker reads, leases, answers and shuts down."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _accept_renamed(cls, data: Any) -> Any:
        return accept_renamed("[worker]", {"read_count": "read_batch", "block_ms": "idle_wait_ms"}, data)

    name: Name = Field(default_factory=default_worker_name, description="consumer name in the group")
    served_model_name: Name | None = Field(None, description="the model name requests and heartbeats use; "
                                           "default: the alias, the directory's or file's name, or 'echo'")
    max_waiting: int = Field(32, ge=1, description="stop reading while engine-waiting + queued admits reach this")
    read_batch: int = Field(64, ge=1, description="most entries one read takes (XREADGROUP COUNT; was read_count)")
    idle_wait_ms: int = Field(1000, ge=1, le=4000, description="how long an idle worker waits for work per read "
                              "(XREADGROUP BLOCK; bounds shutdown latency; was block_ms)")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="how often the heartbeat is written and dead "
                                        "workers' entries are looked for")
    stale_after_s: float = Field(STALE_AFTER_S, gt=0, description="heartbeat age after which a worker counts as dead")
    max_deliveries: int = Field(5, ge=1, description="deliveries before an entry is dead-lettered")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="larger requests are answered prompt_too_long "
                                   "before they are decoded or tokenized")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM: time to finish started requests, "
                                   "then as long again to write their results")
    pending_check_interval_s: float = Field(60.0, gt=0, description="how often the worker compares its pending "
                                            "list with what it holds (and after a lost connection)")
    redis_give_up_s: float = Field(300.0, gt=0, description="exit non-zero once every Redis call of a thread "
                                   "failed for this long")
    token_ttl_s: float = Field(3600.0, gt=0, description="lifetime of a token stream after its last entry")
    # NOTE: every poll wakes the reader thread and Redis; at 20 Hz those wake-ups cost a CPU engine
    # on few cores a visible share of its throughput (ops/bench/bulk.py). 4 Hz keeps cancels under
    # ~0.25 s.
    cancel_poll_s: float = Field(0.25, gt=0, le=5, description="cancellation check period (one ZMSCORE)")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="serve /metrics (Prometheus), "
                                      "/health and /ready on this port")
    metrics_host: str = Field("127.0.0.1", min_length=1, description="address the metrics endpoint binds; "
                              "0.0.0.0 to let a remote Prometheus scrape it")
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="prefill: compute prompts' KV, publish it to the fleet's store and hand each request to "
        "the decode pool; decode: take handed-off requests, fetch their KV and generate; both: either (needs "
        "[engine.fleet_cache] enabled unless both)")
    gc_young_threshold: int = Field(20_000, ge=0, description="once the engine is built: freeze the loaded "
                                    "objects out of the garbage collector's passes and pass over young objects "
                                    "every this many allocations (Python's default: 700); 0 leaves the collector "
                                    "as Python sets it (worker/gc_tuning.py)")
    throughput_log_s: float = Field(60.0, ge=0, description="log results and completion tokens per minute this "
                                    "often, when any were written (at info; each ok result is logged at debug, the "
                                    "others at info); 0: never")
    log_json: bool = Field(False, description="one JSON object per log line")
    log_level: Annotated[LogLevel, BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v)] = "INFO"

    @model_validator(mode="after")
    def _check(self) -> WorkerConfig:
        if self.stale_after_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                "stale_after_s must be at least 2 x heartbeat_interval_s (a live worker must not look dead)")
        return self


class Settings(FileSettings):
    """Everything one worker process needs. Precedence: flags > env > TOML file > defaults."""

    queue: QueueConfig = Field(default_factory=QueueConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    # NOTE: read by `tokenmill serve`, not the worker; declared so that one deployment file validates whole.
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @property
    def served_model_name(self) -> str:
        """The model name this worker answers to and announces (see :func:`default_served_name`)."""
        return self.worker.served_model_name or default_served_name(self.engine.model.name)

    @model_validator(mode="after")
    def _check_role(self) -> Settings:
        if self.worker.role != "both" and is_echo_model(self.engine.model.name):
            raise ValueError(f"[worker] role {self.worker.role!r} needs a model with a KV cache; echo has none")
        if self.worker.role != "both" and not self.engine.fleet_cache.enabled:
            raise ValueError(f"[worker] role {self.worker.role!r} needs [engine.fleet_cache] enabled: the prompt's KV "
                             "travels from the prefill pool to the decode pool through the fleet's store")
        return self

    @model_validator(mode="after")
    def _check_echo_options(self) -> Settings:
        if is_echo_model(self.engine.model.name):
            EchoOptions.parse(self.engine.model.name)  # raises ValueError naming the bad option
        return self


load_settings = Settings.load
