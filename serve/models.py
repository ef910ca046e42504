"""``GET /v1/models``: the model names live workers serve, from their heartbeats (serve/live_models.py).

Imports fastapi and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tokenmill.serve.context import state_of
from tokenmill.serve.errors import not_found

router = APIRouter()


async def served_models(request: Request) -> dict[str, dict[str, Any]]:
    """Model id -> OpenAI model object, for every served name a live worker announces."""
    models: dict[str, dict[str, Any]] = {}
    for beat in await state_of(request).live_models.heartbeats():  # live only: stale and stopped ones are not
        name = beat.served_model_name or beat.model
        if name:
            created = int(min(beat.started_at, models.get(name, {}).get("created", float("inf"))))
            models[name] = {"id": name, "object": "model", "created": created, "owned_by": "tokenmill"}
    return models


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    models = await served_models(request)
    return {"object": "list", "data": [models[name] for name in sorted(models)]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    models = await served_models(request)
    if model_id not in models:
        raise not_found("model", model_id)
    return models[model_id]
