"""A partition's rows of one variable-length column (numeric arrays or bytes), in memory
or memory-mapped from a spill file.

A chunk is ``(offsets, values)``: row ``j`` is ``values[offsets[j]:offsets[j + 1]]``, with
``offsets`` int64 starting at 0, as Arrow lays out list and binary arrays. In memory the
chunks are copies of Spark's Arrow batches (a view would keep each whole batch alive);
spilled, they are zero-copy views of an Arrow IPC file (a ``large_list`` or
``large_binary`` column) mapped back, exactly as dense columns are
(:mod:`sparktrain.data.spill`). :meth:`Ragged.take` returns the rows asked for, in
order: numpy views for numeric rows, ``bytes`` for binary ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from sparktrain.data.features import RowView
from sparktrain.data.spill import IpcSpillFile

_FIELD = "rows"
Chunk = tuple[np.ndarray, np.ndarray]


class Ragged(RowView):
    """Variable-length rows in partition order, seen through ``rows`` (see the module
    docstring); ``binary`` rows come back as ``bytes``."""

    def __init__(
        self,
        chunks: Sequence[Chunk],
        binary: bool,
        rows: np.ndarray | None = None,
        *,
        on_close: Callable[[], None] | None = None,
        spilled_bytes: int = 0,
    ) -> None:
        self.chunks = [c for c in chunks if len(c[0]) > 1]
        self.binary = binary
        self._init_rows([len(off) - 1 for off, _ in self.chunks], rows, spilled_bytes, on_close)

    @property
    def nbytes_in_memory(self) -> int:
        if self.spilled:
            return 0
        return sum(int(o.nbytes + v.nbytes) for o, v in self.chunks)

    def take(self, idx: np.ndarray) -> list[Any]:
        """Rows ``idx`` of this view, in that order."""
        where, chunk_of = self._locate(idx)
        out: list[Any] = []
        for c, j in zip(chunk_of.tolist(), (where - self._starts[chunk_of]).tolist(), strict=True):
            offsets, values = self.chunks[c]
            row = values[offsets[j] : offsets[j + 1]]
            out.append(row.tobytes() if self.binary else row)
        return out

    def lengths(self) -> np.ndarray:
        """Every row's length, in this view's order."""
        parts = [np.diff(off) for off, _ in self.chunks]
        every = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return every if self.rows is None else every[self.rows]

    def subset(self, mask_or_rows: np.ndarray) -> Ragged:
        """A view of the rows where ``mask_or_rows`` is true, or at those indices."""
        rows = self._subset_rows(mask_or_rows)
        return Ragged(self.chunks, self.binary, rows, spilled_bytes=self.spilled_bytes)

    def close(self) -> None:
        """Release the spill file behind the chunks (a no-op in memory); idempotent."""
        self.chunks = []
        self._release()


def chunk_of_arrow(array: pa.Array, dtype: str | None) -> Chunk:
    """Copy a list (numeric) or binary Arrow array into an ``(offsets, values)`` chunk;
    ``dtype`` casts a list's values (``None`` for binary)."""
    n = len(array)
    if pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type):
        offset_type = np.int64 if pa.types.is_large_binary(array.type) else np.int32
        raw = np.frombuffer(array.buffers()[1], offset_type)[array.offset : array.offset + n + 1]
        base = int(raw[0]) if n else 0
        offsets = raw.astype(np.int64) - base
        data = array.buffers()[2]
        end = int(offsets[-1]) if n else 0
        values = (
            np.array(np.frombuffer(data, np.uint8)[base : base + end])
            if data is not None
            else np.zeros(0, np.uint8)
        )
        return offsets, values
    import pyarrow.compute as pc

    lengths = pc.list_value_length(array).fill_null(0).to_numpy(zero_copy_only=False)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.array(array.flatten().to_numpy(zero_copy_only=False), dtype=dtype)
    return offsets, values


class RaggedSpillWriter(IpcSpillFile):
    """Appends ``(offsets, values)`` chunks to an Arrow IPC file (a ``large_list`` or
    ``large_binary`` column), then maps it back as :class:`Ragged`."""

    def __init__(self, path: Path, binary: bool, dtype: str | None) -> None:
        self.binary = binary
        kind = pa.large_binary() if binary else pa.large_list(pa.from_numpy_dtype(np.dtype(dtype)))
        self._type = kind
        super().__init__(path, kind)

    def write(self, chunk: Chunk) -> None:
        offsets, values = chunk
        if len(offsets) <= 1:
            return
        off = pa.array(offsets, pa.int64())
        if self.binary:
            array: pa.Array = pa.Array.from_buffers(
                self._type, len(offsets) - 1, [None, off.buffers()[1], pa.py_buffer(values)]
            )
        else:
            array = pa.LargeListArray.from_arrays(off, pa.array(values))
        self._write_array(array)

    def finish(self) -> Ragged:
        """Close the file and map it: every chunk a zero-copy view of the map."""
        try:
            source, columns = self._close_and_map()
            chunks: list[Chunk] = []
            for column in columns:
                n = len(column)
                offsets = np.frombuffer(column.buffers()[1], np.int64)[
                    column.offset : column.offset + n + 1
                ]
                if self.binary:
                    values = np.frombuffer(column.buffers()[2], np.uint8)
                else:
                    values = column.values.to_numpy(zero_copy_only=True)
                chunks.append((offsets, values))
        except BaseException:
            self.abort()
            raise
        return Ragged(
            chunks,
            self.binary,
            on_close=self._release(source),
            spilled_bytes=self.path.stat().st_size,
        )
