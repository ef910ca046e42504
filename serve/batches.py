"""The OpenAI Batch API (``/v1/batches``): create, retrieve, list, cancel. Batches run on the bulk
pipeline in the background (:mod:`serve.batch_runner`); their objects live in Redis, so any
``serve`` process answers for any batch. A batch belongs to the account (API key) that created it,
from an input file of that account: the others get a 404.

Imports fastapi and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.producer.openai_compat import ENDPOINTS
from tokenmill.serve.batch_runner import BatchRunner
from tokenmill.serve.batch_store import BatchStore
from tokenmill.serve.body import json_object
from tokenmill.serve.context import account_of
from tokenmill.serve.errors import APIError, first_invalid, found_or_404
from tokenmill.serve.files import store_of
from tokenmill.serve.listing import list_object

router = APIRouter()


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
    return found_or_404(await _store(request).get(batch_id, account_of(request)), "batch", batch_id)


@router.post("/v1/batches")
async def create_batch(request: Request) -> dict[str, Any]:
    """NOTE: the body is read here, not declared as a parameter: FastAPI would turn the guard's 413
    into a 400, and parse a large body on the event loop."""
    try:
        body = BatchCreate.model_validate(await json_object(request))
    except ValidationError as exc:
        raise first_invalid(exc.errors()) from None
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {sorted(ENDPOINTS)}", param="endpoint")
    if body.completion_window != "24h":
        raise APIError(400, "completion_window must be 24h", param="completion_window")
    account = account_of(request)
    input_file = found_or_404(await store_of(request).get(body.input_file_id, account), "file", body.input_file_id)
    if input_file["purpose"] != "batch":
        raise APIError(400, "the input file's purpose must be 'batch'", param="input_file_id")
    runner = _runner(request)
    batch = await _store(request).create(body.input_file_id, body.endpoint, body.completion_window, body.metadata,
                                         account=account, owner=runner.owner)
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
    found = await _store(request).listing(account_of(request), limit=limit, after=after)
    return list_object(found, limit)
