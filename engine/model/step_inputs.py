"""One step's integer inputs moved to the device in one copy.

A step's inputs (token ids, positions, slots, block tables, context lengths, ...) are built as host
lists, packed into one int64 tensor and copied once: on CUDA from pinned memory with
``non_blocking``, so the copy is queued behind the previous step's work instead of blocking the
host (from pageable memory every ``torch.tensor(..., device=)`` is a synchronous copy of its own).
On the CPU the packed tensor is used as it is. Imports torch.
"""

from __future__ import annotations

import torch


class StepInputs:
    """Named integer lists, uploaded together; :meth:`upload` returns a flat view of each."""

    def __init__(self) -> None:
        self._values: list[int] = []
        self._spans: dict[str, tuple[int, int]] = {}

    def add(self, name: str, values: list[int]) -> None:
        start = len(self._values)
        self._values += values
        self._spans[name] = (start, len(self._values))

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every list as a 1-D int64 tensor on ``device`` (views of one tensor; one host-to-device copy).

        NOTE: the pinned buffer comes from torch's caching host allocator, which does not hand it out
        again before the copy that reads it has run, so a new buffer per step is safe and cheap.
        """
        host = torch.tensor(self._values, dtype=torch.int64, pin_memory=device.type == "cuda")
        packed = host.to(device, non_blocking=True)
        return {name: packed[start:end] for name, (start, end) in self._spans.items()}
