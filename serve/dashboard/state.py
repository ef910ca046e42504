"""What the dashboard holds in a process: its Redis clients, the queue's layout, its settings, and the sampler that
keeps the lanes' ``entries-added`` samples coming while no one looks (series.py). Nothing else: every number it
shows is read from Redis, so replicas agree and a restart loses nothing.

Imports redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis
import redis.asyncio
from fastapi import Request

from tokenmill.producer.aio import AsyncProducer
from tokenmill.producer.config import ServeSettings
from tokenmill.protocol.connection import REDIS_ERRORS, aconnect, connect
from tokenmill.protocol.shards import QueueLayout

log = logging.getLogger("tokenmill.serve.dashboard")

SAMPLE_INTERVAL_S = 20.0  # lanes' entries-added are sampled this often (the first sample of a minute is kept)


@dataclass
class DashboardState:
    """One process's dashboard: see the module docstring."""

    settings: ServeSettings
    client: redis.asyncio.Redis
    sync_client: redis.Redis  # for producer.dead_letters.requeue, run in a thread
    producer: AsyncProducer  # cancels
    _sampler: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def layout(self) -> QueueLayout:
        return self.producer.layout

    @property
    def stale_after_s(self) -> float:
        return self.settings.worker.stale_after_s

    @classmethod
    async def open(cls, settings: ServeSettings,
                   sampler: Callable[[DashboardState], Awaitable[None]] | None = None) -> DashboardState:
        """Connect to the queue's Redis and start ``sampler`` (called every :data:`SAMPLE_INTERVAL_S`).

        Raises:
            RedisUnavailable: Redis cannot be reached.
        """
        config = settings.producer_config
        client = await aconnect(config.redis)
        sync_client = await asyncio.to_thread(connect, config.redis)
        state = cls(settings, client, sync_client, AsyncProducer.from_config(config, client=client,
                                                                             check_workers=False))
        if sampler is not None:
            state._sampler = asyncio.get_running_loop().create_task(state._sample_forever(sampler))
        return state

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        await self.client.aclose()
        self.sync_client.close()

    async def _sample_forever(self, sampler: Callable[[DashboardState], Awaitable[None]]) -> None:
        while True:
            try:
                await sampler(self)
            except REDIS_ERRORS as exc:  # NOTE: the next round tries again; the pages say what is wrong
                log.debug("dashboard sample failed", extra={"event": "dashboard_sample_failed", "error": str(exc)})
            await asyncio.sleep(SAMPLE_INTERVAL_S)


def dashboard_of(request: Request) -> DashboardState:
    state: DashboardState = request.app.state.dashboard
    return state
