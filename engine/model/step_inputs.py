"""One step's integer inputs moved to the device in one copy.

A step's inputs (token ids, positions, slots, block tables, context lengths, ...) are built as host
lists, packed into one int64 tensor and copied once: on CUDA from pinned memory with
``non_blocking``, so the copy is queued behind the previous step's work instead of blocking the
host (from pageable memory every ``torch.tensor(..., device=)`` is a synchronous copy of its own).
On the CPU the packed tensor is used as it is. The same packed tensor is what rank 0 broadcasts to
tensor-parallel followers (engine/model/tp_step.py), which rebuild the inputs with :meth:`StepInputs.received`.
Imports torch.
"""

from __future__ import annotations

import torch


class StepInputs:
    """Named integer lists, uploaded together; :meth:`upload` returns a flat view of each."""

    def __init__(self) -> None:
        self._values: list[int] = []
        self._spans: dict[str, tuple[int, int]] = {}
        self._host: torch.Tensor | None = None

    @classmethod
    def received(cls, host: torch.Tensor, lengths: list[tuple[str, int]]) -> StepInputs:
        """The inputs another rank packed (:meth:`host`), from the packed tensor and each list's name and length."""
        inputs = cls()
        inputs._host = host
        start = 0
        for name, length in lengths:
            inputs._spans[name] = (start, start + length)
            start += length
        return inputs

    def add(self, name: str, values: list[int]) -> None:
        start = len(self._values)
        self._values += values
        self._spans[name] = (start, len(self._values))

    @property
    def lengths(self) -> list[tuple[str, int]]:
        """Each list's name and length, in packing order."""
        return [(name, end - start) for name, (start, end) in self._spans.items()]

    def values(self, name: str) -> list[int]:
        """One list, on the host."""
        start, end = self._spans[name]
        if self._host is not None and not self._values:
            return list(self._host[start:end].tolist())
        return self._values[start:end]

    def host(self, pin: bool = False) -> torch.Tensor:
        """Every list packed into one int64 host tensor (built once; pinned when ``pin``, for a CUDA upload)."""
        if self._host is None:
            self._host = torch.tensor(self._values, dtype=torch.int64, pin_memory=pin)
        return self._host

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every list as a 1-D int64 tensor on ``device`` (views of one tensor; one host-to-device copy).

        NOTE: the pinned buffer comes from torch's caching host allocator, which does not hand it out
        again before the copy that reads it has run, so a new buffer per step is safe and cheap.
        """
        packed = self.host(pin=device.type == "cuda").to(device, non_blocking=True)
        return {name: packed[start:end] for name, (start, end) in self._spans.items()}
