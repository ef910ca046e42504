"""Requests kept sorted by a key each was given, as they come and go: the one structure behind the queues' running
order and admission order (engine/core/request_queue.py). Standard library only."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from operator import itemgetter
from typing import Any

from tokenmill.engine.core.request import Request
from tokenmill.engine.errors import InvariantError

_key_of = itemgetter(0)
_request_of = itemgetter(1)


class KeptOrder:
    """Requests sorted by the key each came with (equal keys: in the order they came); a request's key stays until
    it is removed. Adding or removing one costs a bisection and a move of the list's tail, not a sort."""

    def __init__(self) -> None:
        self._pairs: list[tuple[Any, Request]] = []  # (key, request), sorted by key
        self._keys: dict[str, Any] = {}  # request id -> its key

    def __len__(self) -> int:
        return len(self._pairs)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._keys

    def add(self, keyed: Iterable[tuple[Any, Request]]) -> None:
        """Place ``(key, request)`` pairs: one by one where few, by one sort where many (timsort merges the kept run
        and the new one)."""
        keyed = list(keyed)
        self._keys.update((request.request_id, key) for key, request in keyed)
        if len(keyed) > 16:
            self._pairs += keyed
            self._pairs.sort(key=_key_of)
        else:
            for pair in keyed:
                self._pairs.insert(bisect_right(self._pairs, pair[0], key=_key_of), pair)

    def remove(self, request: Request) -> None:
        """Take ``request`` out.

        Raises:
            InvariantError: it is not here, or not where its key puts it.
        """
        key = self._keys.pop(request.request_id, None)
        pairs = self._pairs
        position = bisect_left(pairs, key, key=_key_of) if key is not None else len(pairs)
        while position < len(pairs) and pairs[position][1] is not request and pairs[position][0] == key:
            position += 1  # NOTE: past equal keys of others
        if position == len(pairs) or pairs[position][1] is not request:
            raise InvariantError(f"{request.request_id} is not where its key puts it in a kept order")
        del pairs[position]

    def last_key(self) -> Any | None:
        """The greatest key (the last request's); None when empty."""
        return self._pairs[-1][0] if self._pairs else None

    def take_all(self) -> list[Request]:
        """Every request, in order, taken out."""
        requests = self.requests()
        self._pairs, self._keys = [], {}
        return requests

    def requests(self) -> list[Request]:
        """Every request, in order (a new list)."""
        return list(map(_request_of, self._pairs))

    def read(self) -> Iterator[Request]:
        """The requests in order, lazily: removing the one just read is fine while reading; one added meanwhile is
        read only if its key comes after the last one read."""
        pairs = self._pairs
        position = 0
        while position < len(pairs):
            key, request = pairs[position]
            yield request
            # NOTE: the one just read may have left: the next is the first after its key
            position = bisect_right(pairs, key, key=_key_of)

    def check(self, key_now: Callable[[Request], Any] | None = None) -> list[Request]:
        """The requests, after checking they are sorted under their kept keys (and, given ``key_now``, that each key
        is the one it gives now).

        Raises:
            InvariantError: they are not.
        """
        keys = [key for key, _ in self._pairs]
        if keys != sorted(keys) or any(self._keys.get(request.request_id) != key for key, request in self._pairs) or \
                len(self._keys) != len(self._pairs):
            raise InvariantError("a kept order is out of order or its keys are not its requests'")
        if key_now is not None and any(key_now(request) != key for key, request in self._pairs):
            raise InvariantError("a kept order holds stale keys")
        return self.requests()
