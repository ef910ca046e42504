"""Running OpenAI batches on the bulk pipeline, in the ``serve`` process: one background task per
batch drives a :class:`~producer.bulk.pipeline.BulkJob` (in a thread) over the input file, reports its
counts and predicted ETA to the batch object, honours cancels from any process, and stores the output and
error files.

A batch whose owner stopped beating (its process died) is taken over by another process: the bulk
job's id is the batch id, so the new run picks up every result the old one left in Redis and waits
for the requests it had queued, sending nothing twice.

Imports producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import redis

from tokenmill.producer.bulk import BulkJob, BulkOptions
from tokenmill.producer.client import Producer
from tokenmill.protocol.config import ServeConfig
from tokenmill.serve.batch_store import ACTIVE, EXTENSION, BatchStore
from tokenmill.serve.batch_usage import requested_model, summarize_output
from tokenmill.serve.files import FileGone, FileStore, path_chunks
from tokenmill.serve.live_models import LiveModels

log = logging.getLogger("tokenmill.serve")

MONITOR_INTERVAL_S = 0.5  # counts, cancels and the owner's sign of life are synced this often
ORPHAN_AFTER_S = 30.0  # an active batch whose owner was silent this long is taken over
ORPHAN_SCAN_S = 10.0  # how often to look for such batches
LOOKBACK_S = 2 * 86_400.0  # only batches this young can still be active (24 h completion window)


class BatchRunner:
    """Runs the batches this process owns.

    Args:
        store: the batch objects.
        files: the file store (input, output and error files).
        producer: a sync producer (thread-safe) for the bulk jobs.
        live_models: the models live workers serve: lines naming another are answered ``model_not_served``
            when a run starts, not queued.
        config: the ``[serve]`` settings.
        owner: this process's name in the batch objects.
    """

    def __init__(self, store: BatchStore, files: FileStore, producer: Producer, live_models: LiveModels,
                 config: ServeConfig, owner: str) -> None:
        self._store, self._files, self._producer, self._config = store, files, producer, config
        self._live_models = live_models
        self.owner = owner
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, batch_id: str) -> None:
        """Run ``batch_id`` in the background (this process must own it)."""
        if batch_id not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._run(batch_id), name=f"batch-{batch_id}")
            self._tasks[batch_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def close(self) -> None:
        """Stop running batches; their requests stay queued for whoever takes them over."""
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def adopt_orphans(self) -> None:
        """Forever: take over active batches whose owner went silent. A Redis failure skips one scan
        (the next one retries), never ends the loop."""
        while True:
            try:
                await self._adopt_orphans_once()
            except redis.RedisError as exc:
                log.warning("looking for orphaned batches failed (retrying in %g s): %s", ORPHAN_SCAN_S, exc)
            await asyncio.sleep(ORPHAN_SCAN_S)

    async def _adopt_orphans_once(self) -> None:
        for batch_id in await self._store.ids(since=time.time() - LOOKBACK_S):
            if batch_id not in self._tasks and await self._store.update(
                    batch_id, {"owner": self.owner, "owner_ts": time.time()}, if_status=ACTIVE,
                    if_owner_older_than=time.time() - ORPHAN_AFTER_S):
                log.info("taking over batch %s", batch_id)
                self.start(batch_id)

    async def _run(self, batch_id: str) -> None:
        scratch = Path(tempfile.mkdtemp(prefix=f"{batch_id}-", dir=self._config.batch_dir))
        try:
            await self._execute(batch_id, scratch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one batch failing must not take the server down
            log.exception("batch %s failed", batch_id)
            await self._finish(batch_id, "failed", errors={"object": "list", "data": [
                {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}", "param": None, "line": None}]})
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def _execute(self, batch_id: str, scratch: Path) -> None:
        batch, account = await self._store.load(batch_id)
        if batch is None or account is None:
            return
        if batch["status"] == "cancelling":
            await self._finish(batch_id, "cancelled")
            return
        source = scratch / "input.jsonl"
        try:
            await _download(self._files.read(batch["input_file_id"]), source)
        except FileGone:
            await self._finish(batch_id, "failed", errors={"object": "list", "data": [
                {"code": "input_file_not_found", "message": "the input file is gone", "param": "input_file_id",
                 "line": None}]})
            return
        model = await asyncio.to_thread(requested_model, source)  # until the results name the served one
        await self._store.update(batch_id, {"status": "in_progress", "in_progress_at": int(time.time()),
                                            "model": model}, if_status={"validating", "in_progress"})
        options = self._options(scratch, batch["endpoint"], await self._live_models.names())
        job = BulkJob(self._producer, source, scratch / "output.jsonl", options, job_id=batch_id, track_eta=True,
                     kind="batch")
        run = asyncio.ensure_future(asyncio.to_thread(job.run))
        expired = False
        while not run.done():
            await asyncio.wait({run}, timeout=MONITOR_INTERVAL_S)
            expired |= await self._monitor(batch_id, batch, job)
        await self._complete(batch_id, job, expired, account)

    def _options(self, scratch: Path, endpoint: str, served_models: frozenset[str]) -> BulkOptions:
        return BulkOptions(format="openai", priority=self._config.batch_priority, errors_path=scratch / "errors.jsonl",
                           max_in_flight=self._config.batch_max_in_flight, cancel_on_interrupt=True, endpoint=endpoint,
                           served_models=served_models)

    async def _monitor(self, batch_id: str, batch: dict[str, Any], job: BulkJob) -> bool:
        """Report counts, the predicted ETA and life; stop the job on a cancel or at expiry. Returns whether it
        expired."""
        await self._store.update(batch_id, {"request_counts": _counts(job), EXTENSION: _prediction(job),
                                            "owner": self.owner, "owner_ts": time.time()})
        current, _ = await self._store.load(batch_id)
        is_expired = time.time() > float(batch["expires_at"])
        if current is None or current["status"] == "cancelling" or is_expired:
            job.stopping.set()
        return is_expired

    async def _complete(self, batch_id: str, job: BulkJob, expired: bool, account: str) -> None:
        summary = job.summary
        status = ("expired" if expired else "cancelled") if summary.is_interrupted else "completed"
        if status == "completed":
            await self._store.update(batch_id, {"status": "finalizing", "finalizing_at": int(time.time())},
                                     if_status={"in_progress"})
        output = await asyncio.to_thread(summarize_output, job.output_path)
        fields: dict[str, Any] = {"request_counts": _counts(job), "usage": output.usage}
        if output.model is not None:
            fields["model"] = output.model
        for field, path in (("output_file_id", job.output_path), ("error_file_id", job.errors_path)):
            if path.exists() and path.stat().st_size:
                stored = await self._files.create(path_chunks(path), filename=f"{batch_id}_{field[:-8]}.jsonl",
                                                  purpose="batch_output", account=account)
                fields[field] = stored["id"]
        await self._finish(batch_id, status, **fields)

    async def _finish(self, batch_id: str, status: str, **fields: Any) -> None:
        await self._store.update(batch_id, {**fields, EXTENSION: None, "status": status,
                                            f"{status}_at": int(time.time())}, if_status=ACTIVE)


async def _download(chunks: AsyncIterator[bytes], path: Path) -> None:
    with path.open("wb") as sink:
        async for chunk in chunks:
            sink.write(chunk)


def _prediction(job: BulkJob) -> dict[str, float | None] | None:
    """The batch object's extension: the job's predicted completion tokens left and ETA in seconds (either None
    where unknown); None before the first prediction."""
    eta = job.eta
    return None if eta is None else eta.as_dict()


def _counts(job: BulkJob) -> dict[str, int]:
    summary = job.summary
    return {"total": summary.num_total, "completed": summary.num_ok,
            "failed": summary.num_failed + summary.num_invalid}
