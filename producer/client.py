"""The sync ``Producer``: enqueue requests, wait for / stream / cancel them, queue stats.

Speaks only the wire contract (schema.py, keys.py). Never imports torch, the engine or the worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import redis
from typing_extensions import Unpack

from tokenmill.producer import (
    locate,
    queue_stats,
    result_waits,
    submit_commands,
    submit_options,
    token_stream,
    worker_check,
)
from tokenmill.producer.closing import Closing
from tokenmill.producer.config import ProducerConfig
from tokenmill.producer.result_waits import Deadline, OneResultWait
from tokenmill.producer.submit_options import SubmitOptions
from tokenmill.protocol.connection import connect
from tokenmill.protocol.heartbeat import STALE_AFTER_S
from tokenmill.protocol.keys import DONE_TTL_S, Lane
from tokenmill.protocol.schema import GenerationRequest, GenerationResult


class Producer(Closing):
    """Client of one tokenmill queue (sync; thread-safe like ``redis.Redis``).

    Settings load as every tokenmill process loads them (:meth:`ProducerConfig.load`): the arguments given
    here > ``TOKENMILL_*`` variables and ``REDIS_URL`` > the TOML file ``$TOKENMILL_CONFIG`` names > defaults.
    On its first submit, and at most every 30 s after, the producer compares its queue layout with the live
    workers' heartbeats and logs a warning when no live worker reads what it writes (:meth:`check_workers`).

    Args:
        url: redis://, rediss:// or unix:// URL; None = ``REDIS_URL``, else the file's, else the embedded Redis.
        prefix: key namespace shared with the workers.
        queue: queue name.
        num_lanes: priority lanes; must match the workers.
        shards: streams the queue is spread over; must match the workers.
        result_ttl_s: how long results live; cancel marks older than this are trimmed.
        client: a ready ``redis.Redis`` (bytes responses) to use instead of connecting;
            the caller keeps ownership and closes it.
        check_workers: compare with the live workers on submits (False: never).

    Raises:
        ConfigError: the settings file is missing or not TOML.
        pydantic.ValidationError: invalid settings.
        RedisUnavailable: no client given and Redis cannot be reached.
    """

    def __init__(self, url: str | None = None, *, prefix: str | None = None, queue: str | None = None,
                 num_lanes: int | None = None, shards: int | None = None, result_ttl_s: float | None = None,
                 client: redis.Redis | None = None, check_workers: bool = True) -> None:
        config = ProducerConfig.load(redis={"url": url}, queue={
            "prefix": prefix, "name": queue, "num_lanes": num_lanes, "shards": shards, "result_ttl_s": result_ttl_s})
        self._setup(config, client, check_workers)

    @classmethod
    def from_config(cls, config: ProducerConfig, *, client: redis.Redis | None = None,
                    check_workers: bool = True) -> Producer:
        """A producer for ``config`` (as it is: nothing more is loaded); ``client`` and ``check_workers`` as in
        the constructor."""
        producer = cls.__new__(cls)
        producer._setup(config, client, check_workers)  # noqa: SLF001 - this class's own set-up, on the new instance
        return producer

    def _setup(self, config: ProducerConfig, client: redis.Redis | None, check_workers: bool) -> None:
        self.config = config
        self.layout = config.layout  # the queue's shards (protocol/shards.py)
        self.keys = self.layout.home  # the queue's own keys: heartbeats, reply streams (all of them for one shard)
        self._owns_client = client is None
        self.client = client if client is not None else connect(config.redis)
        self._rearm = self.client.register_script(result_waits.REARM_SCRIPT)
        self._submit_once = self.client.register_script(submit_commands.SUBMIT_ONCE_SCRIPT)
        self._worker_check = worker_check.WorkerCheck(config) if check_workers else None

    def close(self) -> None:
        """Close the connection pool, unless the client was injected."""
        if self._owns_client:
            self.client.close()

    def submit(self, **options: Unpack[SubmitOptions]) -> str:
        """Enqueue one request on the lane of its priority.

        A plain ``prompt`` goes to the model as the user's message (its chat template applies),
        after a ``system`` message when one is given, as from the CLI, bulk and Celery;
        ``raw=True`` sends it as raw text instead (no chat template).

        Args:
            **options: exactly one of ``prompt`` / ``messages`` / ``prompt_token_ids``; ``raw``
                and ``system`` for a plain prompt, as above; sampling
                parameters (``n`` (samples, sharing the prompt: the result's ``samples``; sample i
                uses ``seed + i``), ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_tokens``,
                ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``logprobs`` (top alternatives
                per token: the result's ``token_logprobs``), ``presence_penalty``,
                ``frequency_penalty``, ``repetition_penalty``, ``response_format`` (e.g.
                ``{"type": "json_schema", "json_schema": {"name": "x", "schema": {...}}}``)); ``priority``
                (``"high"``/``"normal"``/``"low"`` or a lane number; default ``"normal"``);
                ``request_id`` (idempotency key; default a uuid4 hex); ``deadline`` (unix time);
                ``reply_to`` (a stream under ``keys.reply_prefix``, e.g. ``keys.reply("fan-in")``);
                ``stream_tokens``; ``metadata`` (JSON-compatible, echoed back); ``model``.

        A cancel mark left on the same id by an earlier request is cleared in the same round trip.
        On a sharded queue a generated id is chosen on the shard of the queue's placement (protocol/shards.py).

        Returns:
            The request id.

        Raises:
            SchemaError: invalid options (code ``validation``); nothing was sent.
            SubmitUncertain: Redis failed or timed out during the XADD, which may or may not have
                been applied. Submit again with the same ``request_id``: that is safe, because
                the id is the idempotency key (one id, one result).
        """
        request = submit_options.build_placed(self.layout, options)
        self._enqueue([request])
        return request.id

    def submit_many(self, requests: Iterable[GenerationRequest | Mapping[str, Any]]) -> list[str]:
        """Enqueue many requests, one pipelined round trip per ``submit_chunk_size`` of them.

        Args:
            requests: ``GenerationRequest`` objects (sent as they are: their ``prompt`` is raw text,
                as on the wire) or dicts of ``submit`` keyword arguments (a plain ``prompt`` is the
                user's message unless ``raw``, as in ``submit``).

        Returns:
            The request ids, in input order.

        Raises:
            SchemaError: an item is invalid; all items are validated before any is sent.
            SubmitUncertain: Redis failed during a chunk; resubmitting the same requests is safe.
        """
        batch = [submit_options.coerce_placed(self.layout, item) for item in requests]
        for start in range(0, len(batch), self.config.submit_chunk_size):
            self._enqueue(batch[start:start + self.config.submit_chunk_size])
        return [request.id for request in batch]

    def submit_once(self, requests: Iterable[GenerationRequest | Mapping[str, Any]]) -> list[float]:
        """Enqueue each request unless its id was enqueued by ``submit_once`` before (within
        ``result_ttl_s``): re-runs and redeliveries never queue an id twice.

        Returns:
            Per request, the unix time of its first submit: this call's own time for the requests
            it enqueued, an earlier time for those already queued.

        Raises:
            SchemaError: an item is invalid; nothing was sent.
            SubmitUncertain: Redis failed during a chunk; calling again with the same requests is safe.
        """
        batch = [submit_options.coerce_placed(self.layout, item) for item in requests]
        first_submits: list[float] = []
        for start in range(0, len(batch), self.config.submit_chunk_size):
            chunk = batch[start:start + self.config.submit_chunk_size]
            with submit_commands.uncertain_on_redis_error(chunk):
                first_submits += [float(value) for value in self._submit_once_chunk(chunk)]
            self._look_at_workers(chunk)
        return first_submits

    def _submit_once_chunk(self, chunk: Sequence[GenerationRequest]) -> list[Any]:
        """One pipelined round trip of submit-once scripts; on a cluster node that lacks the script (a replica
        promoted by a failover: redis-py's cluster pipeline loads none) it is loaded and the chunk sent again,
        which the scripts' markers make safe."""
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            submit_commands.queue_submit_once_commands(pipe, self._submit_once, self.layout, chunk, time.time(),
                                              self.config.queue.result_ttl_s)
            try:
                replies: list[Any] = pipe.execute()
                return replies
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                self.client.script_load(submit_commands.SUBMIT_ONCE_SCRIPT)
        raise AssertionError("unreachable")

    def _enqueue(self, requests: Sequence[GenerationRequest]) -> None:
        """One round trip: clear stale cancel marks of the ids, XADD each request; when a look at the workers is
        due (the first submit, then at most every 30 s), the workers hash is read in the same round trip and a
        warning logged when no live worker reads the lanes ``requests`` went to (producer/worker_check.py)."""
        check = self._worker_check if self._worker_check is not None and self._worker_check.is_due() else None
        with submit_commands.uncertain_on_redis_error(requests):
            pipe = self.client.pipeline(transaction=False)
            submit_commands.queue_submit_commands(pipe, self.layout, requests)
            if check is None:
                pipe.execute()
                return
            num_reads = worker_check.queue_worker_reads(pipe, self.layout)
            replies = pipe.execute(raise_on_error=False)
            worker_check.raise_first_error(replies[:-num_reads])
        check.warn(replies[-num_reads:], worker_check.lanes_written(requests))

    def _look_at_workers(self, requests: Sequence[GenerationRequest]) -> None:
        """After a submit of its own round trips (``submit_once``), when due: as :meth:`_enqueue`'s look, in one
        more round trip; never raises."""
        if self._worker_check is None or not self._worker_check.is_due():
            return
        try:
            replies = self._read_workers()
        except redis.RedisError as exc:
            worker_check.log.debug("could not read the workers hash: %s", exc)
            return
        self._worker_check.warn(replies, worker_check.lanes_written(requests))

    def _read_workers(self) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        worker_check.queue_worker_reads(pipe, self.layout)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies

    def check_workers(self, model: str | None = None) -> list[str]:
        """Why requests of this producer would wait for no live worker, one sentence each naming what this
        producer uses, what the live workers use and the setting to change; empty when some live worker reads
        every lane this producer may write (those of ``model``, or the shared ones). Raise on a non-empty
        answer for a strict start; submits log the same sentences as warnings (:class:`Producer`).

        Raises:
            redis.RedisError: the workers hash could not be read.
        """
        replies = self._read_workers()
        seen = worker_check.seen_workers(replies)
        return worker_check.problems(self.config, seen, worker_check.every_lane(self.keys.num_lanes, model))

    def get(self, request_id: str) -> GenerationResult | None:
        """The result if it has landed, else None; never blocks."""
        raw = cast("bytes | None", self.client.get(self.layout.for_id(request_id).result(request_id)))
        return None if raw is None else result_waits.finish(raw, raise_on_error=False)

    def raw_results(self, request_ids: Sequence[str]) -> list[bytes | None]:
        """The stored (msgpack) result of each id, None where none has landed, in one pipelined round trip
        (:func:`producer.result_waits.queue_result_reads`)."""
        if not request_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        shape = result_waits.queue_result_reads(pipe, self.layout, request_ids)
        return cast("list[bytes | None]", shape(pipe.execute()))

    def result(self, request_id: str, timeout: float | None = None, *,
               raise_on_error: bool = False) -> GenerationResult:
        """Block until the result of ``request_id`` lands (BLPOP on its done list, no polling).

        Args:
            request_id: id returned by ``submit``.
            timeout: seconds to wait; None = forever.
            raise_on_error: raise :class:`JobFailed` for non-ok results.

        Raises:
            ResultTimeout: nothing landed within ``timeout``.
            JobFailed: the result is not ok and ``raise_on_error`` is set.
        """
        wait = OneResultWait(self.layout, request_id, timeout)
        raw = cast("bytes | None", self.client.get(wait.result_key))
        while raw is None:
            popped = self._blpop([wait.done_key], wait.next_slice_s())
            # NOTE: after any wake-up (token or slice end) the result key is the truth.
            if popped:
                raw = self._take(wait.result_key, wait.done_key, popped[1])
            else:
                raw = cast("bytes | None", self.client.get(wait.result_key))
        return result_waits.finish(raw, raise_on_error=raise_on_error)

    def wait_all(self, request_ids: Sequence[str], timeout: float | None = None) -> list[GenerationResult]:
        """All results, in input order (see :meth:`as_completed`).

        Raises:
            ResultTimeout: not all landed within ``timeout`` seconds.
        """
        by_id = {result.id: result for result in self.as_completed(request_ids, timeout)}
        return [by_id[request_id] for request_id in request_ids]

    def as_completed(self, request_ids: Iterable[str], timeout: float | None = None) -> Iterator[GenerationResult]:
        """Yield results as they land, each id once.

        One BLPOP watches up to 256 done lists at a time (rotating over larger sets; on a cluster, those of
        one shard, the shards in turn: :func:`producer.result_waits.next_batch`). Each wake-up also collects, with
        one MGET, every other result of that batch that has landed meanwhile (so a busy queue costs about one
        round trip per batch, not per result), and pending ids are re-checked whenever a wait slice ends.

        Raises:
            ResultTimeout: some results did not land within ``timeout`` seconds.
        """
        deadline = Deadline(timeout)
        pending = dict.fromkeys(request_ids)
        yield from self._collect(pending)
        turn = 0
        while pending:
            batch = result_waits.next_batch(self.layout, pending, turn, deadline, timeout)
            popped = self._blpop(list(batch.key_to_id), deadline.slice_s(batch.slice_cap_s))
            if popped is None:
                turn += 1
                yield from self._collect(pending, [i for i in batch.recheck_ids if i in pending])
                continue
            request_id = batch.key_to_id[popped[0].decode()]
            keys = self.layout.for_id(request_id)
            raw = self._take(keys.result(request_id), keys.done(request_id), popped[1])
            if raw is not None and result_waits.take_pending(pending, request_id):
                yield result_waits.finish(raw, raise_on_error=False)
            yield from self._collect(pending, [i for i in batch.key_to_id.values() if i in pending])

    def cancel(self, request_id: str) -> None:
        """Ask the workers to cancel ``request_id``; its result will say ``cancelled``.

        A request not yet picked up is answered ``cancelled`` without running; a finished one
        keeps its result. Marks older than ``result_ttl_s`` are trimmed in the same round trip.
        """
        self.cancel_many([request_id])

    def cancel_many(self, request_ids: Sequence[str]) -> None:
        """Cancel every id of ``request_ids`` in one round trip (see :meth:`cancel`)."""
        if request_ids:
            pipe = self.client.pipeline(transaction=False)
            submit_commands.queue_cancel_commands(pipe, self.layout, request_ids, self.config.queue.result_ttl_s)
            pipe.execute()

    def locate(self, request_ids: Sequence[str]) -> dict[str, locate.RequestState]:
        """Where each request is: ``"queued"`` (in a lane: waiting or running), ``"finished"`` (its
        result has landed) or ``"unknown"`` (never submitted to this queue, or its result expired).

        Reads every lane entry (XRANGE pages, stopping once all ids are found), so it costs
        O(queue length): for occasional look-ups such as ``tokenmill cancel``, not a hot path.
        Lanes are read before results: a request that finishes meanwhile is still found.
        """
        wanted = set(request_ids)
        found: dict[str, locate.RequestState] = {}
        for lane in self._lanes():
            start = "-"
            while len(found) < len(wanted):
                entries = cast("list[tuple[bytes, dict[bytes, bytes]]]",
                               self.client.xrange(lane.stream, min=start, count=locate.LOCATE_PAGE))
                found |= dict.fromkeys(locate.ids_in_entries(entries, wanted), "queued")
                if len(entries) < locate.LOCATE_PAGE:
                    break
                start = "(" + entries[-1][0].decode()
        rest = [request_id for request_id in request_ids if request_id not in found]
        if rest:
            pipe = self.client.pipeline(transaction=False)
            for request_id in rest:
                pipe.exists(self.layout.for_id(request_id).result(request_id))
            for request_id, exists in zip(rest, pipe.execute()):
                found[request_id] = "finished" if exists else "unknown"
        return {request_id: found[request_id] for request_id in request_ids}

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[str]:
        """Yield the text deltas of a ``stream_tokens`` request as the worker writes them.

        Ends at the worker's end marker, or when the result has landed and the token stream
        is exhausted (so it also ends for requests that never stream).

        Raises:
            ResultTimeout: neither happened within ``timeout`` seconds.
        """
        deadline = Deadline(timeout)
        keys = self.layout.for_id(request_id)
        reader, tokens_key = token_stream.TokenStreamReader(), keys.tokens(request_id)
        while True:
            block_ms = max(1, int(deadline.slice_s(token_stream.STREAM_SLICE_S) * 1000))
            reply = self.client.xread({tokens_key: reader.last_id}, count=512, block=block_ms)
            texts = reader.feed(reply)
            for text in texts:
                yield text
            if reader.is_done or (not texts and not reply and self.client.exists(keys.result(request_id))):
                return
            if not reply and deadline.is_expired:
                raise result_waits.timeout_error([request_id], timeout)

    def stats(self, *, stale_after_s: float = STALE_AFTER_S) -> dict[str, Any]:
        """Queue depth, pending, lag (Redis >= 7, else None) per lane (the shared lanes and those of every
        model requests were routed to, of every shard); dead letters; workers.

        Args:
            stale_after_s: a worker whose heartbeat ``ts`` is older than this by the Redis server's clock counts
                as stale (default: the workers' own default, :data:`protocol.heartbeat.STALE_AFTER_S`); one whose
                last heartbeat says ``stopped``, or is stamped in the future, is stale at once (``stale_workers``
                holds them all).

        Returns:
            ``{"queue", "models", "lanes": [{"lane", "pool", "model", "shard", "stream", "depth", "pending", "lag",
            "has_group"}], "shards": [{"shard", "base", "depth", "pending", "lag"}],
            "depth", "pending", "dead", "cancelled", "num_live_workers", "workers",
            "stale_workers", "backlog_tokens", "eta_s"}``; a shared lane's ``model`` is None, and ``depth`` and
            ``pending`` add up every lane; ``backlog_tokens`` is the completion tokens the queue's work is predicted
            to need and ``eta_s`` when it is done (None where unknown: :func:`producer.eta.queue_eta`). Each worker
            is its heartbeat's fields plus ``age_s``, seconds since its beat by the server's clock (None for a beat
            stamped in the future).
        """
        lanes = self._lanes()
        pipe = self.client.pipeline(transaction=False)
        queue_stats.queue_stats_commands(pipe, self.layout, lanes)
        replies = pipe.execute(raise_on_error=False)
        return queue_stats.shape_stats(self.layout, lanes, replies, stale_after_s=stale_after_s)

    def _lanes(self) -> list[Lane]:
        """Every lane of the queue, of every shard: the shared ones and those of every registered model."""
        pipe = self.client.pipeline(transaction=False)
        for keys in self.layout.shards:
            pipe.smembers(keys.models)
        registered: set[bytes] = set().union(*cast("list[set[bytes]]", pipe.execute()))
        return queue_stats.all_lanes(self.layout, registered)

    def _collect(self, pending: dict[str, None], ids: list[str] | None = None) -> Iterator[GenerationResult]:
        """Yield (and drop from ``pending``) every result of ``ids`` (default: all pending) that has landed."""
        ids = list(pending) if ids is None else ids
        for request_id, raw in zip(ids, self.raw_results(ids)):
            if raw is not None and result_waits.take_pending(pending, request_id):
                yield result_waits.finish(raw, raise_on_error=False)

    def _blpop(self, keys: list[str], timeout_s: float) -> tuple[bytes, bytes] | None:
        """BLPOP for at most ``timeout_s`` (one wait slice); (key, token) or None."""
        popped = self.client.blpop(keys, timeout=timeout_s)
        return cast("tuple[bytes, bytes] | None", popped)

    def _take(self, result_key: str, done_key: str, token: bytes) -> bytes | None:
        """After popping ``token``: re-arm the done list for other waiters; return the result."""
        raw = self._rearm(keys=[result_key, done_key], args=[token, DONE_TTL_S])
        return raw if isinstance(raw, bytes) else None
