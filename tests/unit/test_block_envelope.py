"""Fleet cache blocks verified on read: the sealed envelope every stored value travels in (round trip, and each
reason a fetched value is rejected), the check of a payload's values against the KV dtype, the namespace's
fields, and the in-process store's discard."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.doubles import LocalBlockStore
from tokenmill.engine.kv.block_store import (
    ENVELOPE_HEADER,
    LAYOUT_VERSION,
    RejectedBlock,
    namespace,
    seal,
    sealed_size,
    unseal,
)
from tokenmill.engine.model.kv_cache import MAX_KV_MAGNITUDE, KVCache, KVCacheSpec

KEY = hashlib.blake2b(b"block 0", digest_size=16).digest()
OTHER_KEY = hashlib.blake2b(b"block 1", digest_size=16).digest()
PAYLOAD = bytes(range(256)) * 4


def test_sealed_value_opens_to_its_payload_without_copying() -> None:
    value = seal(KEY, PAYLOAD)
    assert len(value) == sealed_size(len(PAYLOAD)) == ENVELOPE_HEADER.size + len(PAYLOAD)
    payload = unseal(KEY, value, len(PAYLOAD))
    assert payload == PAYLOAD and payload.obj is value  # a view into the fetched value
    assert LAYOUT_VERSION == 2  # unsealed blocks of layout 1 live under other addresses


@pytest.mark.parametrize("case, reason", [
    ("short", "bytes, not the"),
    ("long", "bytes, not the"),
    ("raw payload", "bytes, not the"),  # a block of before the envelope (or a producer's raw bytes)
    ("magic", "not a sealed block"),
    ("version", "not a sealed block"),
    ("another key", "sealed for another address"),
    ("payload flipped", "does not match its digest"),
    ("digest flipped", "does not match its digest"),
])
def test_each_reason_a_value_is_rejected(case: str, reason: str) -> None:
    value = bytearray(seal(KEY, PAYLOAD))
    if case == "short":
        del value[-1]
    elif case == "long":
        value += b"\x00"
    elif case == "raw payload":
        value = bytearray(PAYLOAD + bytes(ENVELOPE_HEADER.size - 1))
    elif case == "magic":
        value[0:4] = b"XXXX"
    elif case == "version":
        value[4] += 1
    elif case == "another key":
        value = bytearray(seal(OTHER_KEY, PAYLOAD))
    elif case == "payload flipped":
        value[-1] ^= 1
    elif case == "digest flipped":
        value[ENVELOPE_HEADER.size - 1] ^= 1
    with pytest.raises(RejectedBlock, match=reason):
        unseal(KEY, bytes(value), len(PAYLOAD))


def _kv_cache(dtype: torch.dtype) -> KVCache:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=dtype)
    return KVCache(spec, num_gpu_blocks=4, num_cpu_blocks=0, device=torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_check_blocks_rejects_values_no_model_computes(dtype: torch.dtype) -> None:
    cache = _kv_cache(dtype)
    numel = cache.spec.bytes_per_block // dtype.itemsize

    def block(fill: float, at: int = 7) -> bytes:
        values = torch.linspace(-3, 3, numel, dtype=torch.float64)
        values[at] = fill
        return values.to(dtype).view(torch.uint8).numpy().tobytes()

    real, edge = block(1.5), block(-60_000.0)  # near the bound, in every dtype
    huge = torch.full((numel,), 1e30, dtype=torch.float64).to(dtype).view(torch.uint8).numpy().tobytes()
    blocks = [real, block(float("nan")), block(float("inf"), at=numel - 1), huge, memoryview(edge), real[:-2],
              block(2 * MAX_KV_MAGNITUDE)]
    reasons = cache.check_blocks(blocks)
    assert reasons[0] is None and reasons[4] is None
    assert reasons[1] == reasons[2] == "non-finite values"
    for reason in (reasons[3], reasons[6]):  # float16 holds no such value: it reads as infinite
        assert reason is not None and ("beyond any real key" in reason or reason == "non-finite values")
    assert reasons[5] is not None and "bytes, not the" in reasons[5]
    assert cache.check_blocks([real, memoryview(edge)]) == [None, None]
    assert cache.check_blocks([]) == []


def test_check_blocks_accepts_what_read_blocks_gave() -> None:
    cache = _kv_cache(torch.bfloat16)
    cache.device_pool.normal_(0, 50)
    blocks = cache.read_blocks([0, 3])
    assert cache.check_blocks(blocks) == [None, None]
    cache.write_blocks([1, 2], [memoryview(block) for block in blocks])
    assert torch.equal(cache.device_pool[:, :, 1], cache.device_pool[:, :, 0])
    assert torch.equal(cache.device_pool[:, :, 2], cache.device_pool[:, :, 3])


def test_namespace_names_the_weights_tokenizer_and_layout() -> None:
    base = dict(model_id="llama", weights_fingerprint="w", tokenizer_fingerprint="t", dtype="torch.bfloat16",
                block_size=16, kv_shape=(2, 4, 8))
    root = namespace(**base)  # type: ignore[arg-type]
    assert root == namespace(**base)  # type: ignore[arg-type]
    changes = [dict(weights_fingerprint="w2"), dict(tokenizer_fingerprint=None), dict(tokenizer_fingerprint="t2"),
               dict(dtype="torch.float32"), dict(block_size=8), dict(kv_shape=(2, 4, 16)), dict(model_id="qwen2")]
    roots = {namespace(**{**base, **change}) for change in changes}  # type: ignore[arg-type]
    assert root not in roots and len(roots) == len(changes)


def test_local_store_discard_drops_values_and_their_bytes() -> None:
    store = LocalBlockStore(max_bytes=10_000)
    store.put([KEY, OTHER_KEY], [b"a" * 100, b"b" * 200])
    store.discard([KEY, hashlib.blake2b(b"absent", digest_size=16).digest()])
    assert store.contains([KEY, OTHER_KEY]) == [False, True] and store.num_bytes == 200
    store.put([KEY], [b"c" * 50])  # the block computed in its place can be put
    assert store.get([KEY]) == [b"c" * 50] and store.num_bytes == 250
    store.discard([])
