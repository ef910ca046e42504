"""Where KV blocks live beyond one engine: the block store interface, its content addresses, and the sealed
envelope every stored value travels in.

Standard library only; never torch, never redis. The fleet's implementation on Redis is
worker/redis_block_store.py; the engine never calls a store itself: the fleet's I/O does, on threads of the worker's
(worker/store_io.py, behind engine/kv/fleet_io.py's ``FleetIO``).

A block's address is a hash chain over the tokens of every block up to it, started from the
*namespace*: the model's identity (its type, a digest of every weight's bytes and of its tokenizer), the
KV dtype, the block size, the KV shape and :data:`LAYOUT_VERSION`. Blocks computed by another model,
checkpoint, dtype or layout therefore never match::

    digest(0) = H(namespace, tokens[0:16])
    digest(i) = H(digest(i - 1), tokens[16 i : 16 (i + 1)])          (block_size 16)

A block's payload is its keys and values for every layer, in the engine's pool layout
(engine/model/kv_cache.py), as raw bytes. A stored value is the payload sealed (:func:`seal`): a header
naming the block's address and a digest of the payload, then the payload. A fetched value is opened
(:func:`unseal`) before it may enter a device pool: a value of the wrong length or envelope version, sealed
for another address (another prompt's block, another namespace's) or whose payload does not match its
digest is rejected, and so (engine/model/kv_cache.py ``check_blocks``) is a payload of values no model
computes (non-finite, or beyond float16's range).

NOTE: the trust model. Only workers write to the store, and the store's write path is trusted: the
envelope catches corruption, misplaced or foreign blocks and implausible values, not a forger who can
compute digests (the addresses and digests are unkeyed hashes anyone can compute). A fleet that wants its
write path enforced gives workers a Redis ACL user that may write ``<prefix>:kv:*`` and producers one that
may not (docs/operations.md, "The fleet cache's store").
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Protocol

# NOTE: bump when a stored value's byte layout changes (the envelope, or the pool layout of
# engine/model/kv_cache.py): old blocks then never match. 2: sealed values (blocks of 1 were raw payloads).
LAYOUT_VERSION = 2
DIGEST_BYTES = 16
PAYLOAD_DIGEST_BYTES = 32
ENVELOPE_MAGIC = b"TMKV"
ENVELOPE_VERSION = 1
# magic, envelope version, 2 bytes reserved (zero), the block's address, the payload's blake2b
ENVELOPE_HEADER = struct.Struct(f"<4sH2x{DIGEST_BYTES}s{PAYLOAD_DIGEST_BYTES}s")


class RejectedBlock(ValueError):
    """A fetched value that is not a sealed block of the address asked for; the message says why."""


class BlockStore(Protocol):
    """A content-addressed store of KV blocks shared by engines. Thread-safe; every call may block on I/O
    (the fleet's I/O calls it from its threads only, never from a step: worker/store_io.py).

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

    def discard(self, keys: Sequence[bytes]) -> None:
        """Drop the values of ``keys`` (those it holds): a value found bad, so that the block computed in its
        place can be put."""


def namespace(model_id: str, weights_fingerprint: str, tokenizer_fingerprint: str | None, dtype: str,
              block_size: int, kv_shape: Sequence[int]) -> bytes:
    """The root of every chain of one engine kind: engines that may share blocks have the same one.

    Args:
        model_id: the model's identity as loaded (its type, e.g. ``llama``: not its configured name, which
            differs between workers that load one checkpoint from different paths).
        weights_fingerprint: a digest of every weight's bytes (two checkpoints under one name differ).
        tokenizer_fingerprint: a digest of the tokenizer (None: a model without one).
        dtype: the KV cache dtype, e.g. ``torch.bfloat16``.
        block_size: tokens per block.
        kv_shape: ``(num_layers, num_kv_heads, head_dim)``.
    """
    fields = ["tokenmill-kv", LAYOUT_VERSION, model_id, weights_fingerprint, tokenizer_fingerprint, dtype,
              block_size, list(kv_shape)]
    return hashlib.blake2b(json.dumps(fields).encode(), digest_size=DIGEST_BYTES).digest()


def block_digests(root: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The address of every full block of ``token_ids`` (a trailing partial block has none)."""
    digests = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}q", *token_ids[start:start + block_size])
        parent = hashlib.blake2b(parent + block, digest_size=DIGEST_BYTES).digest()
        digests.append(parent)
    return digests


def seal(key: bytes, payload: bytes) -> bytes:
    """The stored value of the block at address ``key``: the envelope's header, then ``payload``."""
    digest = hashlib.blake2b(payload, digest_size=PAYLOAD_DIGEST_BYTES).digest()
    return ENVELOPE_HEADER.pack(ENVELOPE_MAGIC, ENVELOPE_VERSION, key, digest) + payload


def sealed_size(payload_bytes: int) -> int:
    """Bytes of the stored value of a payload of ``payload_bytes``."""
    return ENVELOPE_HEADER.size + payload_bytes


def unseal(key: bytes, value: bytes, payload_bytes: int) -> memoryview:
    """The payload of a value fetched from address ``key`` (a view into ``value``, no copy).

    Raises:
        RejectedBlock: the value is not a sealed block of ``payload_bytes`` for ``key``: the wrong length, not an
            envelope of this version, sealed for another address, or a payload that does not match its digest.
    """
    if len(value) != sealed_size(payload_bytes):
        raise RejectedBlock(f"{len(value)} bytes, not the {sealed_size(payload_bytes)} of a sealed block")
    magic, version, sealed_key, digest = ENVELOPE_HEADER.unpack_from(value)
    if magic != ENVELOPE_MAGIC or version != ENVELOPE_VERSION:
        raise RejectedBlock(f"not a sealed block of envelope version {ENVELOPE_VERSION} (magic {magic!r}, "
                            f"version {version})")
    if sealed_key != key:
        raise RejectedBlock(f"sealed for another address ({sealed_key.hex()}): another prompt's or namespace's "
                            "block")
    payload = memoryview(value)[ENVELOPE_HEADER.size:]
    if hashlib.blake2b(payload, digest_size=PAYLOAD_DIGEST_BYTES).digest() != digest:
        raise RejectedBlock("the payload does not match its digest (corrupted)")
    return payload
