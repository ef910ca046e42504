"""Where KV blocks live beyond one engine: the block store interface, its content addresses, and a
plain in-process implementation (tests, and one process that runs several engines).

Standard library only; never torch, never redis. The fleet's implementation on Redis is
worker/block_store.py; the engine reaches a store only through :class:`BlockStore`.

A block's address is a hash chain over the tokens of every block up to it, started from the
*namespace*: the model's identity (name and a fingerprint of its weights), the KV dtype, the block
size, the KV shape and :data:`LAYOUT_VERSION`. Blocks computed by another model, dtype or layout
therefore never match::

    digest(0) = H(namespace, tokens[0:16])
    digest(i) = H(digest(i - 1), tokens[16 i : 16 (i + 1)])          (block_size 16)

A value is one block's keys and values for every layer, in the engine's pool layout
(engine/model/kv_cache.py), as raw bytes.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

# NOTE: bump when a block's byte layout changes (engine/model/kv_cache.py): old blocks then never match.
LAYOUT_VERSION = 1
DIGEST_BYTES = 16


class BlockStore(Protocol):
    """A content-addressed store of KV blocks shared by engines. Thread-safe; every call may block on I/O
    (the engine calls it from its fleet thread only, never from a step).

    Keys are digests (:func:`block_digests`); a store keeps each value until its own limits (a byte cap, a
    lifetime) drop it, so any lookup may miss. A failing store raises (any exception): the engine then
    computes the blocks itself and counts the failure.
    """

    def put(self, keys: Sequence[bytes], blocks: Sequence[bytes]) -> None:
        """Store ``blocks[i]`` under ``keys[i]`` (a key already present keeps its value)."""

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value of each key, None where the store does not hold it."""

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each key (cheaper than :meth:`get`: no values travel)."""


def namespace(model_id: str, weights_fingerprint: str, dtype: str, block_size: int, kv_shape: Sequence[int]) -> bytes:
    """The root of every chain of one engine kind: engines that may share blocks have the same one.

    Args:
        model_id: the model as configured (a name or path).
        weights_fingerprint: a digest of the loaded weights (two checkpoints under one name differ).
        dtype: the KV cache dtype, e.g. ``torch.bfloat16``.
        block_size: tokens per block.
        kv_shape: ``(num_layers, num_kv_heads, head_dim)``.
    """
    text = f"tokenmill-kv/{LAYOUT_VERSION}/{model_id}/{weights_fingerprint}/{dtype}/{block_size}/" \
           f"{'x'.join(map(str, kv_shape))}"
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).digest()


def block_digests(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The address of every full block of ``token_ids`` (a trailing partial block has none)."""
    digests = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *token_ids[start:start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=DIGEST_BYTES).digest()
        digests.append(parent)
    return digests


class LocalBlockStore:
    """A :class:`BlockStore` in this process's memory, least recently used first out past ``max_bytes``.

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
