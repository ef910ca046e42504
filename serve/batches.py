"""The OpenAI Batch API (``/v1/batches``): create, retrieve, list, cancel. Batches run on the bulk
pipeline in the background (:mod:`serve.batch_runner`); their objects live in Redis, so any
``serve`` process answers for any batch.

Imports fastapi and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from producer.openai_compat import ENDPOINTS
from serve.batch_runner import BatchRunner
from serve.batch_store import BatchStore
from serve.context import authorize
from serve.errors import APIError, not_found
from serve.files import store_of

router = APIRouter(dependencies=[Depends(authorize)])


class BatchCreate(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _store(request: Request) -> BatchStore:
    store: BatchStore = request.app.state.batches
    return store


def _runner(request: Request) -> BatchRunner:
    runner: BatchRunner = request.app.state.batch_runner
    return runner


async def _batch(request: Request, batch_id: str) -> dict[str, Any]:
    batch = await _store(request).get(batch_id)
    if batch is None:
        raise not_found("batch", batch_id)
    return batch


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, request: Request) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {sorted(ENDPOINTS)}", param="endpoint")
    if body.completion_window != "24h":
        raise APIError(400, "completion_window must be 24h", param="completion_window")
    input_file = await store_of(request).get(body.input_file_id)
    if input_file is None:
        raise not_found("file", body.input_file_id)
    if input_file["purpose"] != "batch":
        raise APIError(400, "the input file's purpose must be 'batch'", param="input_file_id")
    runner = _runner(request)
    batch = await _store(request).create(body.input_file_id, body.endpoint, body.completion_window, body.metadata,
                                         runner.owner)
    runner.start(batch["id"])
    return batch


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
    return await _batch(request, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    """Ask the batch's owner to stop: ``cancelling`` now, ``cancelled`` once its requests are cancelled."""
    await _batch(request, batch_id)
    await _store(request).update(batch_id, {"status": "cancelling", "cancelling_at": int(time.time())},
                                 if_status={"validating", "in_progress"})
    return await _batch(request, batch_id)


@router.get("/v1/batches")
async def list_batches(request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                       after: str | None = None) -> dict[str, Any]:
    store = _store(request)
    ids = await store.ids()
    if after is not None:
        ids = ids[ids.index(after) + 1:] if after in ids else []
    data: list[dict[str, Any]] = []
    for batch_id in ids:
        batch = await store.get(batch_id)
        if batch is None:
            await store.forget(batch_id)
            continue
        data.append(batch)
        if len(data) > limit:
            break
    page = data[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(data) > limit}
