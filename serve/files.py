"""The OpenAI Files API (``/v1/files``): upload, retrieve, content, list, delete. A file belongs to
the account (API key) that uploaded it: the others get a 404, as for a file that does not exist.

NOTE: file bytes live in Redis (one hash per file, with a TTL), not on a local disk: ``serve``
processes are stateless and interchangeable behind a load balancer, so a file uploaded to one must
be readable from any other, and Redis is the one store they already share (and persist, with AOF).
The price is Redis memory: uploads are capped by ``serve.max_upload_bytes``. In the process itself
a file is never whole in memory: an upload is spooled to a temporary file (Starlette's form
parser, past 1 MiB), then written to Redis and read back in chunks of :data:`CHUNK_BYTES`.

Imports fastapi, redis and producer; never torch, the engine or the worker.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Annotated, Any, cast

import redis.asyncio
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import UploadFile

from tokenmill.protocol.keys import Keys
from tokenmill.serve.context import account_of
from tokenmill.serve.errors import APIError, found_or_404, not_found
from tokenmill.serve.listing import account_objects, list_object
from tokenmill.serve.stray_keys import absent_if_stray

PURPOSES = frozenset({"batch", "batch_output", "assistants", "fine-tune", "vision", "user_data", "evals"})
CHUNK_BYTES = 1 << 20  # one hash field of a file's bytes; what one Redis round trip carries
UPLOAD_TTL_S = 3600  # lifetime of the chunks of an upload still being written (a crash leaves nothing for long)
router = APIRouter()


class FileGone(Exception):
    """The file does not exist, or expired while it was read."""


class FileStore:
    """Files in Redis: ``Keys.file(id)`` holds ``meta`` (the OpenAI file object, JSON), ``account``
    (its owner), ``chunks`` (how many) and the bytes in fields ``chunk:0``, ``chunk:1``, ...

    Args:
        client: the server's asyncio Redis client (bytes responses).
        keys: the queue's key layout.
        ttl_s: lifetime of a file.
    """

    def __init__(self, client: redis.asyncio.Redis, keys: Keys, ttl_s: float) -> None:
        self._client, self._keys, self._ttl_s = client, keys, ttl_s

    async def create(self, chunks: AsyncIterable[bytes], *, filename: str, purpose: str,
                     account: str) -> dict[str, Any]:
        """Store a file as its chunks come; returns its OpenAI file object. It exists (``get`` finds it)
        once its meta is written, after the last chunk; a failed upload leaves nothing."""
        now, file_id = int(time.time()), f"file-{secrets.token_hex(12)}"
        key, size, count = self._keys.file(file_id), 0, 0
        try:
            async for chunk in chunks:
                pipe = self._client.pipeline(transaction=True)
                pipe.hset(key, f"chunk:{count}", chunk)
                pipe.expire(key, UPLOAD_TTL_S)
                await pipe.execute()
                size, count = size + len(chunk), count + 1
            meta: dict[str, Any] = {"id": file_id, "object": "file", "bytes": size, "created_at": now,
                                    "expires_at": now + int(self._ttl_s), "filename": filename, "purpose": purpose,
                                    "status": "processed", "status_details": None}
            pipe = self._client.pipeline(transaction=True)
            pipe.hset(key, mapping={"meta": json.dumps(meta), "account": account, "chunks": count})
            pipe.expire(key, int(self._ttl_s))
            pipe.zadd(self._keys.files, {file_id: time.time()})  # NOTE: not created_at: seconds would tie
            await pipe.execute()
        except BaseException:
            with contextlib.suppress(redis.RedisError):
                await self._client.delete(key)
            raise
        return meta

    async def get(self, file_id: str, account: str) -> dict[str, Any] | None:
        """The file object, or None when there is none or it is another account's."""
        meta, owner = await self.load(file_id)
        return meta if meta is not None and owner == account else None

    async def read(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, chunk by chunk (whoever owns it: the caller checked).

        Raises:
            FileGone: there is no such file, or it expired before its last chunk was read.
        """
        key = self._keys.file(file_id)
        count = await absent_if_stray(self._client.hget(key, "chunks"))
        if count is None:
            raise FileGone(file_id)
        for index in range(int(count)):
            chunk = await self._client.hget(key, f"chunk:{index}")
            if chunk is None:
                raise FileGone(file_id)
            yield cast(bytes, chunk)

    async def delete(self, file_id: str, account: str) -> bool:
        """Delete the account's file; False when there is none (or it is another account's)."""
        if await self.get(file_id, account) is None:
            return False
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._keys.file(file_id))
        pipe.zrem(self._keys.files, file_id)
        deleted, _ = await pipe.execute()
        return bool(deleted)

    async def listing(self, *, account: str, purpose: str | None, limit: int, after: str | None,
                      descending: bool) -> list[dict[str, Any]]:
        """The account's file objects of ``purpose`` (None: any) by creation time
        (:func:`serve.listing.account_objects`)."""
        raw_ids = cast("list[bytes]", await self._client.zrange(self._keys.files, 0, -1, desc=descending))
        return await account_objects([file_id.decode() for file_id in raw_ids], account=account, after=after,
                                     limit=limit, load=self.load,
                                     forget=lambda file_id: self._client.zrem(self._keys.files, file_id),
                                     is_wanted=lambda meta: purpose is None or meta["purpose"] == purpose)

    async def load(self, file_id: str) -> tuple[dict[str, Any] | None, str | None]:
        """The file object and its account, whoever asks; (None, None) for no file (or a stray key in its place)."""
        raw = cast("list[bytes | None] | None",
                   await absent_if_stray(self._client.hmget(self._keys.file(file_id), ["meta", "account"])))
        meta, owner = raw if raw is not None else (None, None)
        if meta is None:
            return None, None
        return cast("dict[str, Any]", json.loads(meta)), None if owner is None else owner.decode()


async def path_chunks(path: Path) -> AsyncIterator[bytes]:
    """A local file's bytes in chunks of :data:`CHUNK_BYTES`."""
    with path.open("rb") as source:
        while chunk := source.read(CHUNK_BYTES):
            yield chunk


async def _upload_chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(CHUNK_BYTES):
        yield chunk


def store_of(request: Request) -> FileStore:
    store: FileStore = request.app.state.files
    return store


@router.post("/v1/files")
async def upload(request: Request) -> dict[str, Any]:
    """NOTE: the form is read here, not declared as ``File()`` / ``Form()`` parameters: FastAPI
    would turn the guard's 413 (a body past ``serve.max_upload_bytes``) into a 400."""
    async with request.form(max_files=1, max_fields=8) as form:
        file, purpose = form.get("file"), form.get("purpose")
        if not isinstance(file, UploadFile):
            raise APIError(400, "the form needs a file", param="file")
        if not isinstance(purpose, str) or purpose not in PURPOSES:
            raise APIError(400, f"purpose must be one of {sorted(PURPOSES)}", param="purpose")
        return await store_of(request).create(_upload_chunks(file), filename=file.filename or "upload",
                                              purpose=purpose, account=account_of(request))


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000, after: str | None = None,
                     order: str = "desc") -> dict[str, Any]:
    found = await store_of(request).listing(account=account_of(request), purpose=purpose, limit=limit, after=after,
                                         descending=order != "asc")
    return list_object(found, limit)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
    return found_or_404(await store_of(request).get(file_id, account_of(request)), "file", file_id)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    store = store_of(request)
    meta = found_or_404(await store.get(file_id, account_of(request)), "file", file_id)
    return StreamingResponse(store.read(file_id), media_type="application/octet-stream",
                             headers={"Content-Length": str(meta["bytes"])})


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    if not await store_of(request).delete(file_id, account_of(request)):
        raise not_found("file", file_id)
    return {"id": file_id, "object": "file", "deleted": True}
