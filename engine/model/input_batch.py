"""The runner's persistent batch (vLLM V1's ``InputBatch``, its block-table half): every request in the batch keeps
a row of one preallocated block-table tensor from the step it joins to the step it leaves, and each step changes
the rows by difference (rows added and released, blocks appended, trimmed, or copied on write) instead of
flattening every request's whole table again. A step's ``tables`` input is then a gather of its rows
(:meth:`InputBatch.gather`: one ``index_select`` straight into the step's packed inputs,
engine/model/step_inputs.py), so the Python work of a decode step does not grow with the context; what does is one
memory copy of ``rows x width`` integers in C.

What a step costs here, per chunk: a dictionary look-up and a few integer comparisons (the chunk's table is the
very list of the step before, as long, and the block it writes is unchanged: 15 steps of 16 at block size 16), or,
when its table grew, the checks of 2. below and the new blocks copied. The rows live in an ``array('q')`` that the
tensor views, so an entry is written from Python without a torch call. A row is written whole only when its
request joins (or comes back after a step without it) or when a check finds its table built anew.

WHAT THE RUNNER ASSUMES of the block manager (engine/kv/block_manager.py), and :attr:`InputBatch.check` asserts
(every row against its chunk's whole table, every step: tests turn it on, and so does the environment variable
``TOKENMILL_CHECK_INPUT_BATCH=1``):

1. Between two consecutive steps that both hold a request (executes with chunks), its device table changes only
   (a) by blocks appended at its end (``append_slots``, into a new list), (b) by blocks dropped from its end
   (``trim``: rejected drafts), (c) in the block the second step's chunk writes first (``copy_on_write`` at the
   position the chunk starts). (a) is copied as the new tail, (b) zeroes the dropped tail, (c) is found by
   comparing the block(s) the chunk writes with the row's.
2. Any other change comes with a request that leaves the batch for at least one step (its row is released then:
   a preempted request, one swapped out and back in, one the step's budget skipped) or is listed in the step's
   ``preempted_request_ids`` (released at once), or else is a table built anew, in a new list, for a request the
   previous step held (a request id reused by a new request at once): then its first block, the block at the
   row's old end, its start position (it must move past the previous step's) or its count of output tokens (it
   must grow after a step that sampled) differs, and the row is written whole. A chunk re-run at the same position
   with a new list (the engine isolating a failed step) is written whole too.
3. A chunk whose table is the very list object of the row's last chunk, as long, changed only in place and only by
   (c): only the block it writes first is compared. (The row holds that list, so its identity cannot be reused.)

Rows: a request's row is assigned on first sight and released when a step with chunks does not hold it (finished,
preempted, or skipped: such a row is written whole again when it comes back, once, in C). Entries past a row's
length are 0, so a gather of ``width`` columns is exactly the plain path's zero-padded flatten. The rows grow
(rows or columns doubled) when a step needs more. Imports torch.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable

import torch

from tokenmill.engine.core.step_io import ScheduledChunk
from tokenmill.engine.errors import InvariantError
from tokenmill.engine.model.step_inputs import TableRows

# Assert the assumptions above every step (costs the whole context: for tests and debugging only).
CHECK_ROWS = os.environ.get("TOKENMILL_CHECK_INPUT_BATCH", "") == "1"

_INITIAL_ROWS = 64
_INITIAL_COLUMNS = 64


def _zeros(count: int) -> array[int]:
    return array("q", bytes(8 * count))


class InputBatch:
    """Persistent block-table rows of the requests in the batch.

    Args:
        block_size: tokens per KV block (which block a chunk's positions write).
        max_rows: rows allocated at first (grows by doubling).
        max_blocks: columns allocated at first (grows to the longest table seen).
        check: assert the module's assumptions every step (None: :data:`CHECK_ROWS`).
    """

    def __init__(self, block_size: int, *, max_rows: int = _INITIAL_ROWS, max_blocks: int = _INITIAL_COLUMNS,
                 check: bool | None = None) -> None:
        self.block_size = block_size
        self.check = CHECK_ROWS if check is None else check
        self._num_rows = max(1, max_rows)
        self._columns = max(1, max_blocks)
        self._data = _zeros(self._num_rows * self._columns)  # the rows, row-major: the tensor's memory
        self.table = torch.frombuffer(self._data, dtype=torch.int64).view(self._num_rows, self._columns)
        self._row_of: dict[str, int] = {}
        self._free: list[int] = list(range(self._num_rows - 1, -1, -1))
        self._length = [0] * self._num_rows  # blocks in each row (the entries after them are 0)
        self._seen: list[list[int] | None] = [None] * self._num_rows  # the table list of the row's last chunk
        self._start = [0] * self._num_rows  # the start position of the row's last chunk
        self._next_output = [0] * self._num_rows  # the output tokens the row's next chunk must at least count
        # Counters (tests, benchmarks): whole rows written, entries written by difference, rows released.
        self.num_full_writes = 0
        self.num_entry_writes = 0
        self.num_releases = 0

    @property
    def num_rows(self) -> int:
        """Rows held by requests now."""
        return len(self._row_of)

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    def length(self, row: int) -> int:
        """Blocks in the row (its request's table as of the last step that held it)."""
        return self._length[row]

    def blocks(self, row: int) -> list[int]:
        """The row's blocks."""
        base = row * self._columns
        return self._data[base:base + self._length[row]].tolist()

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the rows of these requests (those that hold none are ignored)."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._seen[row] = None
                self._free.append(row)
                self.num_releases += 1

    def rows(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Bring the rows up to this step's tables: the row of each chunk, in order; requests the step does not
        hold give theirs back.

        Raises:
            InvariantError: with :attr:`check`, a row disagrees with its chunk's table (an assumption above broke).
        """
        try:
            rows = self._update(chunks)
            if self.check:
                self.check_rows(chunks, rows)
        except BaseException:
            self._clear()  # NOTE: a row may disagree with its length now: start over next step
            raise
        return rows

    def gather(self, rows: list[int], width: int) -> TableRows:
        """``rows`` of the table, ``width`` columns each (zeros past a row's blocks): gathered where the step's inputs
        are packed, before the next :meth:`rows`."""
        if width > self._columns:
            self._grow(self._num_rows, width)
        return TableRows(self.table, rows, width)

    def max_length(self, rows: list[int]) -> int:
        """The longest table among ``rows``."""
        lengths = self._length
        return max(lengths[row] for row in rows)

    def check_rows(self, chunks: list[ScheduledChunk], rows: list[int]) -> None:
        """Every row equals its chunk's table, zero-padded, and no request holds two rows.

        Raises:
            InvariantError: they differ.
        """
        if len({c.request_id for c in chunks}) != len(chunks):
            raise InvariantError("a step holds a request twice")
        width = self._columns
        for chunk, row in zip(chunks, rows):
            expected = list(chunk.block_ids) + [0] * (width - len(chunk.block_ids))
            if self._length[row] != len(chunk.block_ids) or self.table[row].tolist() != expected:
                raise InvariantError(
                    f"input batch: row {row} of {chunk.request_id} holds {self.blocks(row)} "
                    f"(tensor {self.table[row, :len(chunk.block_ids) + 1].tolist()}), its table is {chunk.block_ids}"
                    " (the block manager changed a table in a way engine/model/input_batch.py does not expect)")

    # ----------------------------------------------------------------- updates

    def _update(self, chunks: list[ScheduledChunk]) -> list[int]:
        bs = self.block_size
        get_row = self._row_of.get
        data, columns = self._data, self._columns
        lengths = self._length
        seen = self._seen
        starts = self._start
        next_outputs = self._next_output
        num_held = len(self._row_of)
        num_found = 0
        rows: list[int] = []
        for chunk in chunks:
            block_ids = chunk.block_ids
            start = chunk.start_position
            n = len(block_ids)
            row = get_row(chunk.request_id)
            if row is not None and block_ids is seen[row] and n == lengths[row]:
                # 3: the block this chunk writes first may have been copied on write
                num_found += 1
                first = start // bs
                if first < n and data[row * columns + first] != block_ids[first]:
                    data[row * columns + first] = block_ids[first]
                    self.num_entry_writes += 1
            else:
                if n > columns:
                    self._grow(self._num_rows, n)
                    data, columns = self._data, self._columns
                if row is None:
                    row = self._assign(chunk.request_id)
                    if row >= self._num_rows:
                        self._grow(2 * self._num_rows, columns)
                        data = self._data
                        lengths, seen, starts, next_outputs = self._length, self._seen, self._start, self._next_output
                    self._write_row(row, block_ids)
                else:
                    num_found += 1
                    self._write_difference(row, chunk)
            seen[row] = block_ids
            starts[row] = start
            next_outputs[row] = chunk.num_output_tokens + chunk.needs_sample
            rows.append(row)
        if num_found < num_held:  # NOTE: some row's request is not in this step: it left the batch
            present = {c.request_id for c in chunks}
            self.release([request_id for request_id in self._row_of if request_id not in present])
        return rows

    def _write_difference(self, row: int, chunk: ScheduledChunk) -> None:
        """A held row brought up to its chunk's table, a new list: 1 (a)-(c), or whole where 2 says so."""
        block_ids = chunk.block_ids
        start = chunk.start_position
        data = self._data
        base = row * self._columns
        n, length = len(block_ids), self._length[row]
        kept = (n if n < length else length) - 1  # the last block both have
        if (start <= self._start[row] or chunk.num_output_tokens < self._next_output[row] or kept < 0
                or block_ids[0] != data[base] or block_ids[kept] != data[base + kept]):
            self._write_row(row, block_ids)  # NOTE: a table built anew, or a chunk run again: see 2.
            return
        if n > length:  # 1(a): appended blocks
            data[base + length:base + n] = array("q", block_ids[length:])
        elif n < length:  # 1(b): trimmed blocks
            data[base + n:base + length] = _zeros(length - n)
        self._length[row] = n
        self.num_entry_writes += abs(n - length)
        # 1(c): the blocks this chunk writes (a copy on write replaced one in place)
        first = start // self.block_size
        last = min((start + len(chunk.token_ids) - 1) // self.block_size + 1, n)
        if first < last and data[base + first:base + last].tolist() != block_ids[first:last]:
            data[base + first:base + last] = array("q", block_ids[first:last])
            self.num_entry_writes += last - first

    def _assign(self, request_id: str) -> int:
        if not self._free:
            self._free = list(range(2 * self._num_rows - 1, self._num_rows - 1, -1))
        row = self._free.pop()
        self._row_of[request_id] = row
        return row

    def _write_row(self, row: int, block_ids: list[int]) -> None:
        """The row written whole: its table, then zeros over what it held past it."""
        base = row * self._columns
        n, length = len(block_ids), self._length[row]
        self._data[base:base + n] = array("q", block_ids)
        if length > n:
            self._data[base + n:base + length] = _zeros(length - n)
        self._length[row] = n
        self.num_full_writes += 1

    def _clear(self) -> None:
        """Release every row and zero the rows."""
        self.release(list(self._row_of))
        self._data[:] = _zeros(len(self._data))
        self._length = [0] * self._num_rows

    def _grow(self, num_rows: int, columns: int) -> None:
        """Room for ``num_rows`` rows of ``columns`` blocks (at least doubled where it grows): a new array, the rows
        copied."""
        old_rows, old_columns = self._num_rows, self._columns
        if columns > old_columns:
            columns = max(columns, 2 * old_columns)
        num_rows = max(num_rows, old_rows)
        data = _zeros(num_rows * columns)
        table = torch.frombuffer(data, dtype=torch.int64).view(num_rows, columns)
        table[:old_rows, :old_columns] = self.table
        self._data, self.table = data, table
        self._num_rows, self._columns = num_rows, columns
        extra = num_rows - old_rows
        self._length += [0] * extra
        self._seen += [None] * extra
        self._start += [0] * extra
        self._next_output += [0] * extra
