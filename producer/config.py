"""The settings of producer-side processes: ``ProducerConfig`` (what a ``Producer`` feeds and how), and the roots
``ClientSettings`` (``[redis]``, ``[queue]``, the worker's ``stale_after_s``; the CLI's client commands, Celery) and
``ServeSettings`` (plus ``[serve]``: ``tokenmill serve`` and ``tokenmill dashboard``).

The sections themselves and their one loader (``QueueConfig``, ``RedisConfig``, ``ServeConfig``,
``FileSettings``) are every process's, the worker's too: protocol/config.py. Never imports redis, torch,
the engine or the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tokenmill.protocol.config import FileSettings, QueueConfig, RedisConfig, ServeConfig
from tokenmill.protocol.heartbeat import STALE_AFTER_S
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.shards import QueueLayout


class ProducerConfig(BaseModel):
    """Which queue a producer feeds and how it talks to it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis: RedisConfig = Field(default_factory=RedisConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    submit_chunk_size: int = Field(default=500, ge=1, le=100_000, description="requests per pipelined round trip")

    @classmethod
    def load(cls, config_file: Path | str | None = None, **overrides: Mapping[str, Any] | None) -> ProducerConfig:
        """The ``[redis]`` and ``[queue]`` settings as every tokenmill process loads them (:meth:`FileSettings.load`):
        ``overrides`` (by section, as in the file: ``queue={"name": "q"}``; None values count as not given) >
        ``TOKENMILL_*`` variables and ``REDIS_URL`` > the TOML file ``config_file`` (default: ``$TOKENMILL_CONFIG``)
        > defaults.

        Raises:
            ConfigError: the file is missing or not TOML, or a refused env name is set.
            pydantic.ValidationError: a value is invalid or a key unknown.
        """
        return ClientSettings.load(config_file, overrides).producer_config

    @property
    def layout(self) -> QueueLayout:
        """The queue's keys, its own and its shards' (protocol/shards.py)."""
        return self.queue.layout(self.redis.is_cluster)

    @property
    def keys(self) -> Keys:
        """The queue's own keys (all of them for a queue of one shard): heartbeats, reply streams, files."""
        return self.layout.home


class WorkerView(BaseModel):
    """What producer-side commands read of the ``[worker]`` section: when a heartbeat is stale
    (``tokenmill status`` judges liveness as the workers' reclaim does). Other keys pass unread."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    stale_after_s: float = Field(STALE_AFTER_S, gt=0, description="heartbeat age after which a worker counts as dead")


class ClientSettings(FileSettings):
    """The ``[redis]`` and ``[queue]`` sections of a deployment's settings (and the worker's
    ``stale_after_s``), for producer-side commands.

    NOTE: the other sections of a deployment (``[worker]``, ``[engine.*]``, ``[serve]``) are
    accepted unread, so one file serves a whole deployment; an unknown section is an error.
    """

    redis: RedisConfig = Field(default_factory=RedisConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    worker: WorkerView = Field(default_factory=WorkerView)
    engine: dict[str, Any] = Field(default_factory=dict, description="the workers' section: not read here")
    serve: dict[str, Any] = Field(default_factory=dict, description="tokenmill serve's section: not read here")

    @property
    def producer_config(self) -> ProducerConfig:
        return ProducerConfig(redis=self.redis, queue=self.queue)


class ServeSettings(ClientSettings):
    """The sections ``tokenmill serve`` reads: ``[redis]``, ``[queue]`` and ``[serve]``."""

    serve: ServeConfig = Field(default_factory=ServeConfig)  # type: ignore[assignment]
