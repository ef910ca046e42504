"""The models live workers serve, from their heartbeats, read at most once a second: what ``/v1/models``
lists, and what a completion naming a model is checked against before it is queued (503 at once when
no live worker serves it, rather than a wait in lanes nobody reads until the client's timeout).

Imports redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio

from tokenmill.protocol.heartbeat import READ_WORKERS_LUA, Heartbeat, decode_workers
from tokenmill.protocol.keys import Keys
from tokenmill.serve.errors import APIError

CACHE_S = 1.0  # a burst of requests reads the workers hash once; a worker that starts is seen this late


class LiveModels:
    """The live workers' heartbeats, cached for :data:`CACHE_S`.

    Args:
        client: the serve process's Redis client.
        keys: key layout of the queue.
        stale_after_s: heartbeat age after which a worker is gone (``[worker] stale_after_s``, as the
            workers' reclaim judges it).
    """

    def __init__(self, client: redis.asyncio.Redis, keys: Keys, stale_after_s: float) -> None:
        self._client, self._keys, self._stale_after_s = client, keys, stale_after_s
        self._beats: list[Heartbeat] = []
        self._expires_s = 0.0  # monotonic time the cached beats go stale
        self._lock = asyncio.Lock()  # NOTE: one read per expiry, however many requests wait for it

    async def heartbeats(self) -> list[Heartbeat]:
        """Heartbeats of the live workers (stale, stopped and undecodable ones left out).

        Raises:
            redis.RedisError: the workers hash could not be read.
        """
        async with self._lock:
            if time.monotonic() >= self._expires_s:
                self._beats = await self._read()
                self._expires_s = time.monotonic() + CACHE_S
            return self._beats

    async def names(self) -> frozenset[str]:
        """Every model name whose lanes a live worker reads (its served name, aliases and paths)."""
        return frozenset(name for beat in await self.heartbeats() for name in beat.model_names)

    async def require(self, model: str) -> None:
        """Return when a live worker serves ``model``.

        Raises:
            APIError: 503 ``model_not_available`` naming the models that are served.
            redis.RedisError: the workers hash could not be read (serve/errors.py answers 503).
        """
        served = await self.names()
        if model not in served:
            names = ", ".join(map(repr, sorted(served))) or "none (no live worker)"
            raise APIError(503, f"no live worker serves model {model!r}; served now: {names}", param="model",
                           code="model_not_available", is_final=True)

    async def _read(self) -> list[Heartbeat]:
        """The live heartbeats, judged by the Redis server's clock read with them (never this process's)."""
        beats, now_s = decode_workers(await self._client.eval(READ_WORKERS_LUA, 1, self._keys.workers))
        return [beat for beat in beats.values() if not beat.is_stale(now_s, self._stale_after_s)]
