"""The OpenAI Files API (``/v1/files``): upload, retrieve, content, list, delete.

NOTE: file bytes live in Redis (one hash per file, with a TTL), not on a local disk: ``serve``
processes are stateless and interchangeable behind a load balancer, so a file uploaded to one must
be readable from any other, and Redis is the one store they already share (and persist, with AOF).
The price is memory: uploads are capped by ``serve.max_file_bytes``.

Imports fastapi, redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Annotated, Any, cast

import redis.asyncio
from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from producer.keys import Keys
from serve.context import authorize, state_of
from serve.errors import APIError, not_found

PURPOSES = frozenset({"batch", "batch_output", "assistants", "fine-tune", "vision", "user_data", "evals"})
router = APIRouter(dependencies=[Depends(authorize)])


class FileStore:
    """Files in Redis: ``Keys.file(id)`` holds ``meta`` (the OpenAI file object, JSON) and ``data``.

    Args:
        client: the server's asyncio Redis client (bytes responses).
        keys: the queue's key layout.
        ttl_s: lifetime of a file.
    """

    def __init__(self, client: redis.asyncio.Redis, keys: Keys, ttl_s: float) -> None:
        self._client, self._keys, self._ttl_s = client, keys, ttl_s

    async def create(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        """Store a file; returns its OpenAI file object."""
        now, file_id = int(time.time()), f"file-{secrets.token_hex(12)}"
        meta: dict[str, Any] = {"id": file_id, "object": "file", "bytes": len(data), "created_at": now,
                "expires_at": now + int(self._ttl_s), "filename": filename, "purpose": purpose,
                "status": "processed", "status_details": None}
        key = self._keys.file(file_id)
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(key, mapping={"meta": json.dumps(meta), "data": data})
        pipe.expire(key, int(self._ttl_s))
        pipe.zadd(self._keys.files, {file_id: now})
        await pipe.execute()
        return meta

    async def get(self, file_id: str) -> dict[str, Any] | None:
        raw = await self._client.hget(self._keys.file(file_id), "meta")
        return None if raw is None else cast("dict[str, Any]", json.loads(raw))

    async def content(self, file_id: str) -> bytes | None:
        return cast("bytes | None", await self._client.hget(self._keys.file(file_id), "data"))

    async def delete(self, file_id: str) -> bool:
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._keys.file(file_id))
        pipe.zrem(self._keys.files, file_id)
        deleted, _ = await pipe.execute()
        return bool(deleted)

    async def list(self, *, purpose: str | None, limit: int, after: str | None, descending: bool) -> list[dict[str, Any]]:
        """File objects in creation order, after the id ``after``; ids whose file expired are dropped."""
        raw_ids = cast("list[bytes]", await self._client.zrange(self._keys.files, 0, -1, desc=descending))
        ids = [file_id.decode() for file_id in raw_ids]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        found: list[dict[str, Any]] = []
        for file_id in ids:
            meta = await self.get(file_id)
            if meta is None:
                await self._client.zrem(self._keys.files, file_id)
            elif purpose is None or meta["purpose"] == purpose:
                found.append(meta)
                if len(found) > limit:
                    break
        return found


def store_of(request: Request) -> FileStore:
    store: FileStore = request.app.state.files
    return store


@router.post("/v1/files")
async def upload(request: Request, file: Annotated[UploadFile, File()],
                 purpose: Annotated[str, Form()]) -> dict[str, Any]:
    if purpose not in PURPOSES:
        raise APIError(400, f"purpose must be one of {sorted(PURPOSES)}", param="purpose")
    max_bytes = state_of(request).config.max_file_bytes
    data = await file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise APIError(413, f"the file is larger than {max_bytes} bytes (serve.max_file_bytes)", param="file")
    return await store_of(request).create(data, file.filename or "upload", purpose)


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     after: str | None = None, order: str = "desc") -> dict[str, Any]:
    found = await store_of(request).list(purpose=purpose, limit=limit, after=after, descending=order != "asc")
    data = found[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(found) > limit}


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
    meta = await store_of(request).get(file_id)
    if meta is None:
        raise not_found("file", file_id)
    return meta


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    data = await store_of(request).content(file_id)
    if data is None:
        raise not_found("file", file_id)
    return Response(data, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    if not await store_of(request).delete(file_id):
        raise not_found("file", file_id)
    return {"id": file_id, "object": "file", "deleted": True}
