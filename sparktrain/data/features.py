"""A partition's rows of one dense column, held in memory or memory-mapped from a spill
file.

:class:`Features` keeps the rows in the blocks the ingest filled (``data/partition_data.py``):
joining them into one matrix would hold every row twice while it is built. A chunk is a
``(rows, width)`` array of the column's dtype (float32 for a plain features column),
either in memory or a zero-copy view of a record batch
in an Arrow IPC file (:mod:`sparktrain.data.spill`); :meth:`Features.take` gathers any
rows from either in the order asked, so a batch's values do not depend on where its rows
live. A subset (the training or validation rows of a partition) is a view through a row
index, not a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


class RowView:
    """What every column store shares: rows in chunks (``sizes`` rows each) seen through
    ``rows`` (indices into the chunks' rows; ``None``: all of them), the bytes of the
    spill file behind them, and what releases it."""

    def _init_rows(
        self,
        sizes: Sequence[int],
        rows: np.ndarray | None,
        spilled_bytes: int,
        on_close: Callable[[], None] | None,
    ) -> None:
        self.rows = rows
        self.spilled_bytes = spilled_bytes
        self._on_close = on_close
        self._starts = np.cumsum([0, *sizes])[:-1].astype(np.int64)
        self._total = int(sum(sizes))

    @property
    def spilled(self) -> bool:
        return self.spilled_bytes > 0

    @property
    def size(self) -> int:
        return self._total if self.rows is None else len(self.rows)

    def _locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows in partition order, the chunk each sits in) of this view's ``idx``."""
        where = np.asarray(idx, dtype=np.int64)
        if self.rows is not None:
            where = self.rows[where]
        return where, np.searchsorted(self._starts, where, side="right") - 1

    def _subset_rows(self, mask_or_rows: np.ndarray) -> np.ndarray:
        """The partition rows of a subset: where ``mask_or_rows`` is true (a bool mask
        over this view) or at those indices."""
        picked = np.asarray(mask_or_rows)
        local = np.flatnonzero(picked) if picked.dtype == bool else picked.astype(np.int64)
        return local if self.rows is None else self.rows[local]

    def _release(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


class Features(RowView):
    """Rows in partition order: ``chunks`` of ``(n_i, width)`` arrays of one ``dtype``
    (float32 unless given), seen through ``rows`` (indices into the chunks' rows;
    ``None``: all of them).

    ``on_close`` releases what backs the chunks (the spill file's map); subsets share it
    and leave the closing to the partition that owns it.
    """

    def __init__(
        self,
        chunks: Sequence[np.ndarray],
        width: int,
        rows: np.ndarray | None = None,
        *,
        on_close: Callable[[], None] | None = None,
        spilled_bytes: int = 0,
        flat: tuple[np.ndarray, np.ndarray] | None = None,
        dtype: np.dtype[Any] | type | None = None,
    ) -> None:
        self.chunks = [c for c in chunks if len(c)]
        self.width = width
        self.dtype = np.dtype(dtype if dtype is not None else np.float32)
        # (windows: row j is values j..j+width of a whole spill file, a zero-copy view; where
        # each chunk's first value sits in it): a gather from the file is then one fancy
        # index, however many chunks the file has
        self._flat = flat
        self._init_rows([len(c) for c in self.chunks], rows, spilled_bytes, on_close)

    @classmethod
    def in_memory(cls, x: np.ndarray, dtype: np.dtype[Any] | type = np.float32) -> Features:
        """One chunk in memory (what tests and the RDD path build)."""
        x = np.asarray(x, dtype=dtype)
        return cls([x], x.shape[1] if x.ndim == 2 else 0, dtype=x.dtype)

    @property
    def nbytes_in_memory(self) -> int:
        """Bytes of the chunks held in memory (0 for a memory-mapped partition)."""
        return 0 if self.spilled else sum(int(c.nbytes) for c in self.chunks)

    def take(self, idx: np.ndarray) -> np.ndarray:
        """A new ``(len(idx), width)`` array of rows ``idx`` of this view."""
        where = np.asarray(idx, dtype=np.int64)
        if self.rows is not None:
            where = self.rows[where]
        if len(self.chunks) == 1:
            out: np.ndarray = self.chunks[0][where]
            return out
        out = np.empty((len(where), self.width), self.dtype)
        if not len(where):
            return out
        chunk_of = np.searchsorted(self._starts, where, side="right") - 1
        if self._flat is not None:
            windows, first = self._flat
            at = first[chunk_of] + (where - self._starts[chunk_of]) * self.width
            gathered: np.ndarray = windows[at]
            return gathered
        order = np.argsort(chunk_of, kind="stable")
        ids, first = np.unique(chunk_of[order], return_index=True)
        for ci, lo, hi in zip(ids, first, [*first[1:], len(order)], strict=True):
            at = order[lo:hi]
            out[at] = self.chunks[ci][where[at] - self._starts[ci]]
        return out

    def array(self) -> np.ndarray:
        """Every row of this view as one in-memory matrix (reads a spilled map whole)."""
        if self.rows is None and len(self.chunks) == 1:
            return self.chunks[0]
        if not self.chunks:
            return np.zeros((0, self.width), self.dtype)
        if self.rows is None:
            return np.concatenate(self.chunks)
        return self.take(np.arange(self.size))

    def subset(self, mask_or_rows: np.ndarray) -> Features:
        """The rows where ``mask_or_rows`` is true (a bool mask over this view) or at
        those indices: a view sharing the chunks."""
        return Features(
            self.chunks,
            self.width,
            self._subset_rows(mask_or_rows),
            spilled_bytes=self.spilled_bytes,
            flat=self._flat,
            dtype=self.dtype,
        )

    def close(self) -> None:
        """Release the spill file behind the chunks (a no-op in memory); idempotent."""
        self.chunks, self._flat = [], None
        self._release()
