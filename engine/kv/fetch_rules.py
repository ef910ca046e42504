"""The engine's half of a fetch from the fleet's store, applied where the fetch runs (the fleet I/O's thread, off
the engine's: worker/store_io.py): whether fetching the blocks the store holds beats computing them (a cost model,
measured on both sides), and the verification every fetched value passes before the engine may use it.

Standard library only; never torch. The checks are the engine's (the envelope of engine/kv/block_store.py, the
pool's ``check_blocks``), so a block the I/O side hands back is one the engine's own rules opened.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenmill.engine.kv.block_store import RejectedBlock, unseal

EWMA_WEIGHT = 0.2  # weight of the newest measurement in the cost model's moving averages
MIN_PREFILL_TOKENS = 32  # steps computing fewer prompt tokens say little about the prefill rate

# Why each block's bytes cannot be keys and values the engine's pool computed (None where they can): the wrong
# length, or values that are not finite or implausibly large (engine/model/kv_cache.py ``check_blocks``). Any thread.
BlockCheck = Callable[[Sequence[bytes | memoryview]], list[str | None]]


class TransferCost:
    """Fetch or compute: measured fetch bandwidth and latency against the measured prefill rate.

    NOTE: before both are measured it says fetch: the first fetches measure the store, and a prefill
    step measures the model.
    """

    def __init__(self, block_bytes: int, block_size: int) -> None:
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.prefill_tokens_per_s: float | None = None
        self.fetch_bytes_per_s: float | None = None
        self.fetch_latency_s = 0.0

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, num_tokens / seconds)

    def observe_fetch(self, num_bytes: int, seconds: float, latency_s: float) -> None:
        self.fetch_latency_s = _ewma(self.fetch_latency_s, latency_s)
        transfer_s = seconds - latency_s
        if num_bytes and transfer_s > 0:
            self.fetch_bytes_per_s = _ewma(self.fetch_bytes_per_s, num_bytes / transfer_s)

    def fetch_beats_compute(self, num_blocks: int) -> bool:
        if self.prefill_tokens_per_s is None or self.fetch_bytes_per_s is None:
            return True
        fetch_s = self.fetch_latency_s + num_blocks * self.block_bytes / self.fetch_bytes_per_s
        return fetch_s < num_blocks * self.block_size / self.prefill_tokens_per_s


def _ewma(average: float | None, value: float) -> float:
    return value if average is None else (1 - EWMA_WEIGHT) * average + EWMA_WEIGHT * value


class FetchRules:
    """What every fetch of one engine follows, on the thread that fetches.

    Args:
        cost: the engine's cost model (the engine observes its prefill steps, the fetches observe themselves).
        payload_bytes: bytes of one block's payload (its keys and values).
        check_blocks: the device pool's check of payloads' values (engine/model/kv_cache.py).
    """

    def __init__(self, cost: TransferCost, payload_bytes: int, check_blocks: BlockCheck) -> None:
        self.cost = cost
        self.payload_bytes = payload_bytes
        self._check_blocks = check_blocks

    def open(self, keys: Sequence[bytes], values: Sequence[bytes | None]) -> tuple[list[memoryview], str | None]:
        """The leading payloads of ``values`` (fetched from ``keys``) that pass verification, and why the value
        after them failed (None: none did; a missing value, evicted since it was found, just ends the run).

        Each value is opened (:func:`~tokenmill.engine.kv.block_store.unseal`: the right length and envelope
        version, sealed for the address asked for, the payload matching its digest), then the payloads' values are
        checked; the first block that fails ends the run.
        """
        blocks: list[memoryview] = []
        rejected = None
        for key, value in zip(keys, values):
            if value is None:  # NOTE: a block evicted since contains() ends the run
                break
            try:
                blocks.append(unseal(key, value, self.payload_bytes))
            except RejectedBlock as exc:
                rejected = str(exc)
                break
        reasons = self._check_blocks(blocks)
        first_bad = next((i for i, reason in enumerate(reasons) if reason is not None), None)
        if first_bad is not None:
            rejected = reasons[first_bad]
            del blocks[first_bad:]
        return blocks, rejected
