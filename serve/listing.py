"""The listing the Files and Batch APIs share: one account's objects among the ids of a sorted set,
a page at a time in OpenAI's list shape, ids whose object expired dropped as they are met.

Imports nothing of tokenmill; never torch, the engine or the worker.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

Loader = Callable[[str], Awaitable[tuple[dict[str, Any] | None, str | None]]]


async def account_objects(ids: Sequence[str], *, account: str, after: str | None, limit: int, load: Loader,
                          forget: Callable[[str], Awaitable[object]],
                          is_wanted: Callable[[dict[str, Any]], bool] = lambda _: True) -> list[dict[str, Any]]:
    """The objects of ``account`` among ``ids`` (in their order) after the id ``after``, at most
    ``limit`` + 1 (the extra one says there are more).

    Args:
        load: id -> (object, its account); (None, None) when it is gone.
        forget: drops a gone id from the sorted set.
        is_wanted: a filter on the account's objects (e.g. a file's purpose).
    """
    if after is not None:
        ids = ids[list(ids).index(after) + 1:] if after in ids else []
    found: list[dict[str, Any]] = []
    for object_id in ids:
        found_object, owner = await load(object_id)
        if found_object is None:
            await forget(object_id)
        elif owner == account and is_wanted(found_object):
            found.append(found_object)
            if len(found) > limit:
                break
    return found


def list_object(found: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's list object of one page: the first ``limit`` of ``found``, ``has_more`` if there are more."""
    page = found[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(found) > limit}
