"""``AsyncProducer``: the asyncio twin of :class:`producer.client.Producer`, on redis.asyncio.

Same API and semantics, awaitable. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, cast

import redis.asyncio
from typing_extensions import Unpack

from tokenmill.producer import queue_stats, result_waits, submit_commands, submit_options, token_stream, worker_check
from tokenmill.producer.config import ProducerConfig
from tokenmill.producer.result_waits import Deadline, OneResultWait
from tokenmill.producer.submit_options import SubmitOptions
from tokenmill.protocol.connection import aconnect
from tokenmill.protocol.heartbeat import STALE_AFTER_S
from tokenmill.protocol.keys import DONE_TTL_S
from tokenmill.protocol.schema import GenerationRequest, GenerationResult


class AsyncProducer:
    """Client of one tokenmill queue for asyncio code; see :class:`producer.Producer`.

    The connection is made (with retries) on first use or by ``await producer.connect()``;
    ``async with AsyncProducer(...) as producer`` does both and closes it.

    Settings load as :class:`producer.Producer`'s do (:meth:`ProducerConfig.load`), and submits warn the same way
    when no live worker reads what it writes.

    Args: as :class:`producer.Producer`'s; ``client`` is a ready ``redis.asyncio.Redis``.
    """

    def __init__(self, url: str | None = None, *, prefix: str | None = None, queue: str | None = None,
                 num_lanes: int | None = None, shards: int | None = None, result_ttl_s: float | None = None,
                 client: redis.asyncio.Redis | None = None, check_workers: bool = True) -> None:
        config = ProducerConfig.load(redis={"url": url}, queue={
            "prefix": prefix, "name": queue, "num_lanes": num_lanes, "shards": shards, "result_ttl_s": result_ttl_s})
        self._setup(config, client, check_workers)

    @classmethod
    def from_config(cls, config: ProducerConfig, *, client: redis.asyncio.Redis | None = None,
                    check_workers: bool = True) -> AsyncProducer:
        """A producer for ``config`` (as it is: nothing more is loaded); ``client`` and ``check_workers`` as in
        the constructor."""
        producer = cls.__new__(cls)
        producer._setup(config, client, check_workers)  # noqa: SLF001 - this class's own set-up, on the new instance
        return producer

    def _setup(self, config: ProducerConfig, client: redis.asyncio.Redis | None, check_workers: bool) -> None:
        self.config = config
        self.layout = config.layout  # the queue's shards (protocol/shards.py)
        self.keys = self.layout.home  # the queue's own keys: heartbeats, reply streams (all of them for one shard)
        self._owns_client = client is None
        self._client = client
        self._connect_lock = asyncio.Lock()
        self._rearm = client.register_script(result_waits.REARM_SCRIPT) if client is not None else None
        self._worker_check = worker_check.WorkerCheck(config) if check_workers else None

    async def connect(self) -> redis.asyncio.Redis:
        """The client, connecting (with retries and PING) on the first call.

        Raises:
            RedisUnavailable: Redis cannot be reached.
        """
        async with self._connect_lock:
            if self._client is None:
                self._client = await aconnect(self.config.redis)
                self._rearm = self._client.register_script(result_waits.REARM_SCRIPT)
        return self._client

    async def close(self) -> None:
        """Close the connection pool, unless the client was injected."""
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> AsyncProducer:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def submit(self, **options: Unpack[SubmitOptions]) -> str:
        """Enqueue one request; see :meth:`producer.Producer.submit` (a plain ``prompt`` is the user's
        message, after ``system`` if given; ``raw=True`` sends it as raw text).

        Raises:
            SchemaError: invalid options (code ``validation``); nothing was sent.
            SubmitUncertain: Redis failed or timed out during the XADD; resubmitting with the
                same ``request_id`` is safe (one id, one result).
        """
        request = submit_options.build_placed(self.layout, options)
        await self._enqueue([request])
        return request.id

    async def submit_many(self, requests: Iterable[GenerationRequest | Mapping[str, Any]]) -> list[str]:
        """Enqueue many requests pipelined; see :meth:`producer.Producer.submit_many`."""
        batch = [submit_options.coerce_placed(self.layout, item) for item in requests]
        for start in range(0, len(batch), self.config.submit_chunk_size):
            await self._enqueue(batch[start:start + self.config.submit_chunk_size])
        return [request.id for request in batch]

    async def _enqueue(self, requests: Sequence[GenerationRequest]) -> None:
        """One round trip: clear stale cancel marks of the ids, XADD each request (and, when due, read the workers
        hash: :meth:`producer.Producer._enqueue`)."""
        client = await self.connect()
        check = self._worker_check if self._worker_check is not None and self._worker_check.is_due() else None
        with submit_commands.uncertain_on_redis_error(requests):
            pipe = client.pipeline(transaction=False)
            submit_commands.queue_submit_commands(pipe, self.layout, requests)
            if check is None:
                await pipe.execute()
                return
            # NOTE: a look at the workers is due: in the same round trip (see producer.Producer._enqueue)
            num_reads = worker_check.queue_worker_reads(pipe, self.layout)
            replies = await pipe.execute(raise_on_error=False)
            worker_check.raise_first_error(replies[:-num_reads])
        check.warn(replies[-num_reads:], worker_check.lanes_written(requests))

    async def _read_workers(self) -> list[Any]:
        client = await self.connect()
        pipe = client.pipeline(transaction=False)
        worker_check.queue_worker_reads(pipe, self.layout)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    async def check_workers(self, model: str | None = None) -> list[str]:
        """Why requests of this producer would wait for no live worker; see :meth:`producer.Producer.check_workers`.

        Raises:
            redis.RedisError: the workers hash could not be read.
        """
        seen = worker_check.seen_workers(await self._read_workers())
        return worker_check.problems(self.config, seen, worker_check.every_lane(self.keys.num_lanes, model))

    async def get(self, request_id: str) -> GenerationResult | None:
        """The result if it has landed, else None; never blocks."""
        raw = await self._get(self.layout.for_id(request_id).result(request_id))
        return None if raw is None else result_waits.finish(raw, raise_on_error=False)

    async def result(self, request_id: str, timeout: float | None = None, *,
                     raise_on_error: bool = False) -> GenerationResult:
        """Wait for one result; see :meth:`producer.Producer.result`.

        Raises:
            ResultTimeout: nothing landed within ``timeout``.
            JobFailed: the result is not ok and ``raise_on_error`` is set.
        """
        wait = OneResultWait(self.layout, request_id, timeout)
        raw = await self._get(wait.result_key)
        while raw is None:
            popped = await self._blpop([wait.done_key], wait.next_slice_s())
            # NOTE: after any wake-up (token or slice end) the result key is the truth.
            raw = await (self._take(wait.result_key, wait.done_key, popped[1]) if popped else
                         self._get(wait.result_key))
        return result_waits.finish(raw, raise_on_error=raise_on_error)

    async def wait_all(self, request_ids: Sequence[str], timeout: float | None = None) -> list[GenerationResult]:
        """All results in input order; see :meth:`producer.Producer.wait_all`."""
        by_id = {result.id: result async for result in self.as_completed(request_ids, timeout)}
        return [by_id[request_id] for request_id in request_ids]

    async def as_completed(self, request_ids: Iterable[str],
                           timeout: float | None = None) -> AsyncIterator[GenerationResult]:
        """Yield results as they land; see :meth:`producer.Producer.as_completed`."""
        deadline = Deadline(timeout)
        pending = dict.fromkeys(request_ids)
        for result in await self._collect(pending):
            yield result
        turn = 0
        while pending:
            batch = result_waits.next_batch(self.layout, pending, turn, deadline, timeout)
            popped = await self._blpop(list(batch.key_to_id), deadline.slice_s(batch.slice_cap_s))
            if popped is None:
                turn += 1
                for result in await self._collect(pending, [i for i in batch.recheck_ids if i in pending]):
                    yield result
                continue
            request_id = batch.key_to_id[popped[0].decode()]
            keys = self.layout.for_id(request_id)
            raw = await self._take(keys.result(request_id), keys.done(request_id), popped[1])
            if raw is not None and result_waits.take_pending(pending, request_id):
                yield result_waits.finish(raw, raise_on_error=False)
            for result in await self._collect(pending, [i for i in batch.key_to_id.values() if i in pending]):
                yield result

    async def cancel(self, request_id: str) -> None:
        """Ask the workers to cancel ``request_id``; see :meth:`producer.Producer.cancel`."""
        await self.cancel_many([request_id])

    async def cancel_many(self, request_ids: Sequence[str]) -> None:
        """Cancel every id of ``request_ids`` in one round trip; see :meth:`producer.Producer.cancel`."""
        if request_ids:
            client = await self.connect()
            pipe = client.pipeline(transaction=False)
            submit_commands.queue_cancel_commands(pipe, self.layout, request_ids, self.config.queue.result_ttl_s)
            await pipe.execute()

    async def stream(self, request_id: str, timeout: float | None = None) -> AsyncIterator[str]:
        """Yield text deltas as the worker writes them; see :meth:`producer.Producer.stream`."""
        client = await self.connect()
        deadline = Deadline(timeout)
        keys = self.layout.for_id(request_id)
        reader, tokens_key = token_stream.TokenStreamReader(), keys.tokens(request_id)
        while True:
            block_ms = max(1, int(deadline.slice_s(token_stream.STREAM_SLICE_S) * 1000))
            reply = await client.xread({tokens_key: reader.last_id}, count=512, block=block_ms)
            texts = reader.feed(reply)
            for text in texts:
                yield text
            if reader.is_done or (not texts and not reply and await client.exists(keys.result(request_id))):
                return
            if not reply and deadline.is_expired:
                raise result_waits.timeout_error([request_id], timeout)

    async def stats(self, *, stale_after_s: float = STALE_AFTER_S) -> dict[str, Any]:
        """Queue, lane and worker stats; see :meth:`producer.Producer.stats`."""
        client = await self.connect()
        pipe = client.pipeline(transaction=False)
        for keys in self.layout.shards:
            pipe.smembers(keys.models)
        registered: set[bytes] = set().union(*await pipe.execute())
        lanes = queue_stats.all_lanes(self.layout, registered)
        pipe = client.pipeline(transaction=False)
        queue_stats.queue_stats_commands(pipe, self.layout, lanes)
        replies = await pipe.execute(raise_on_error=False)
        return queue_stats.shape_stats(self.layout, lanes, replies, stale_after_s=stale_after_s)

    async def _get(self, key: str) -> bytes | None:
        client = await self.connect()
        return cast("bytes | None", await client.get(key))

    async def _collect(self, pending: dict[str, None], ids: list[str] | None = None) -> list[GenerationResult]:
        """Every result of ``ids`` (default: all pending) that has landed (dropped from ``pending``)."""
        client = await self.connect()
        ids = list(pending) if ids is None else ids
        results: list[GenerationResult] = []
        if not ids:
            return results
        pipe = client.pipeline(transaction=False)
        shape = result_waits.queue_result_reads(pipe, self.layout, ids)
        for request_id, raw in zip(ids, shape(await pipe.execute())):
            if raw is not None and result_waits.take_pending(pending, request_id):
                results.append(result_waits.finish(raw, raise_on_error=False))
        return results

    async def _blpop(self, keys: list[str], timeout_s: float) -> tuple[bytes, bytes] | None:
        """BLPOP for at most ``timeout_s`` (one wait slice); (key, token) or None."""
        client = await self.connect()
        popped = await client.blpop(keys, timeout=timeout_s)
        return cast("tuple[bytes, bytes] | None", popped)

    async def _take(self, result_key: str, done_key: str, token: bytes) -> bytes | None:
        """After popping ``token``: re-arm the done list for other waiters; return the result."""
        await self.connect()
        assert self._rearm is not None  # set by connect()
        raw = await self._rearm(keys=[result_key, done_key], args=[token, DONE_TTL_S])
        return raw if isinstance(raw, bytes) else None
