"""One step's integer inputs moved to the device in one copy.

A step's inputs (token ids, positions, slots, block tables, context lengths, ...) are built as host
lists, packed into one int64 tensor and copied once: on CUDA from pinned memory with
``non_blocking``, so the copy is queued behind the previous step's work instead of blocking the
host (from pageable memory every ``torch.tensor(..., device=)`` is a synchronous copy of its own).
On the CPU the packed tensor is used as it is. The same packed tensor is what rank 0 broadcasts to
tensor-parallel followers (engine/model/tp_step.py), which rebuild the inputs with :meth:`StepInputs.received`.

A list may also be rows of a host tensor (:meth:`StepInputs.add_rows`: the block tables of the runner's persistent
batch, engine/model/input_batch.py), gathered straight into the packed tensor when it is built: one copy in C,
however long the rows. Imports torch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TableRows(NamedTuple):
    """``table[rows, :width]``, flattened row by row: a list of :class:`StepInputs` read from a 2-D int64 host
    tensor when the packed tensor is built (the table must not change before)."""

    table: torch.Tensor  # [num_rows, num_columns], int64, on the host
    rows: list[int]
    width: int

    @property
    def numel(self) -> int:
        return len(self.rows) * self.width


class StepInputs:
    """Named integer lists, uploaded together; :meth:`upload` returns a flat view of each."""

    def __init__(self) -> None:
        self._values: list[int] = []  # the lists added with add(), packed in order
        self._spans: dict[str, tuple[int, int]] = {}  # each list's place in the packed tensor
        self._rows: dict[str, TableRows] = {}  # the lists added with add_rows()
        self._size = 0
        self._host: torch.Tensor | None = None
        self._received = False  # the lists are in _host only (another rank packed them)

    @classmethod
    def received(cls, host: torch.Tensor, lengths: list[tuple[str, int]]) -> StepInputs:
        """The inputs another rank packed (:meth:`host`), from the packed tensor and each list's name and length."""
        inputs = cls()
        inputs._host = host
        inputs._received = True
        start = 0
        for name, length in lengths:
            inputs._spans[name] = (start, start + length)
            start += length
        inputs._size = start
        return inputs

    def add(self, name: str, values: list[int]) -> None:
        self._values += values
        self._spans[name] = (self._size, self._size + len(values))
        self._size += len(values)

    def add_rows(self, name: str, rows: TableRows) -> None:
        """A list gathered from rows of a host tensor (``rows.table[rows.rows, :rows.width]``, flat) when the packed
        tensor is built."""
        self._rows[name] = rows
        self._spans[name] = (self._size, self._size + rows.numel)
        self._size += rows.numel

    @property
    def lengths(self) -> list[tuple[str, int]]:
        """Each list's name and length, in packing order."""
        return [(name, end - start) for name, (start, end) in self._spans.items()]

    def values(self, name: str) -> list[int]:
        """One list, on the host."""
        start, end = self._spans[name]
        if self._received or name in self._rows:
            return list(self.host()[start:end].tolist())
        offset = self._list_offset(start)
        return self._values[offset:offset + end - start]

    def _list_offset(self, position: int) -> int:
        """Where a place in the packed tensor is in ``_values`` (the rows' lists take none of it)."""
        return position - sum(min(rows.numel, max(0, position - self._spans[name][0]))
                              for name, rows in self._rows.items())

    def host(self, pin: bool = False) -> torch.Tensor:
        """Every list packed into one int64 host tensor (built once; pinned when ``pin``, for a CUDA upload)."""
        if self._host is None:
            if not self._rows:
                self._host = torch.tensor(self._values, dtype=torch.int64, pin_memory=pin)
            else:
                self._host = self._pack(pin)
        return self._host

    def _pack(self, pin: bool) -> torch.Tensor:
        """The lists and the gathered rows, each copied once into a new (pinned) tensor."""
        packed = torch.empty(self._size, dtype=torch.int64, pin_memory=pin)
        # NOTE: the lists and the rows' indexes in one conversion (each torch call costs microseconds)
        source = torch.tensor(self._values + [row for rows in self._rows.values() for row in rows.rows],
                              dtype=torch.int64)
        taken = 0  # of the lists, copied so far
        indexed = len(self._values)  # where the next rows' indexes are in source
        run = 0  # where the lists not copied yet start in packed (consecutive lists are copied together)
        spans: list[tuple[str | None, tuple[int, int]]] = [*self._spans.items(), (None, (self._size, self._size))]
        for name, (start, end) in spans:
            rows = self._rows.get(name) if name is not None else None
            if rows is None and name is not None:
                continue
            if start > run:
                packed.narrow(0, run, start - run).copy_(source.narrow(0, taken, start - run))
                taken += start - run
            run = end
            if rows is not None:
                index = source.narrow(0, indexed, len(rows.rows))
                indexed += len(rows.rows)
                if rows.numel:
                    out = packed.narrow(0, start, end - start).view(len(rows.rows), rows.width)
                    torch.index_select(rows.table.narrow(1, 0, rows.width), 0, index, out=out)
        return packed

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Every list as a 1-D int64 tensor on ``device`` (views of one tensor; one host-to-device copy).

        NOTE: the pinned buffer comes from torch's caching host allocator, which does not hand it out
        again before the copy that reads it has run, so a new buffer per step is safe and cheap.
        """
        packed = self.host(pin=device.type == "cuda").to(device, non_blocking=True)
        return {name: packed[start:end] for name, (start, end) in self._spans.items()}
