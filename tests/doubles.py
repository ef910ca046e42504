"""Test doubles of the engine's interfaces: in-process stand-ins for what a worker hands an engine in production
(the fleet cache's block store, whose production implementation is Redis: worker/redis_block_store.py)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence


class LocalBlockStore:
    """A block store (engine/kv/block_store.py ``BlockStore``) in this process's memory, least recently used first
    out past ``max_bytes``: engines of one test share blocks through it, and the Redis store is checked to behave
    as it does.

    Args:
        max_bytes: the most value bytes it keeps.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._values: OrderedDict[bytes, bytes] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def put(self, keys: Sequence[bytes], blocks: Sequence[bytes]) -> None:
        with self._lock:
            for key, block in zip(keys, blocks, strict=True):
                if key in self._values:
                    self._values.move_to_end(key)  # NOTE: as the Redis store: a put counts as a use
                    continue
                if len(block) > self.max_bytes:
                    continue
                self._values[key] = bytes(block)
                self.num_bytes += len(block)
            while self.num_bytes > self.max_bytes:
                _, evicted = self._values.popitem(last=False)
                self.num_bytes -= len(evicted)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            values = []
            for key in keys:
                value = self._values.get(key)
                if value is not None:
                    self._values.move_to_end(key)
                values.append(value)
            return values

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def discard(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                value = self._values.pop(key, None)
                if value is not None:
                    self.num_bytes -= len(value)
