"""A partition's rows -> numpy arrays -> shuffled mini-batches.

DataFrame partitions arrive as Arrow record batches and become numpy without per-row
Python work, one store per model input column (:mod:`sparktrain.data.columns` says which
and as what); RDD partitions arrive as ``(features, label)`` tuples. Each worker converts
its partition once and keeps it for all epochs.

Sample weights (``weight_col``) travel as an optional float64 column :data:`WEIGHT` next
to the features and labels. The driver has already validated them and divided them by
their mean over the training rows (``driver/prepare.py``), so a worker only multiplies
per-sample losses by them (see ``builders.Loss``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from sparktrain.data.batch import Batch, Collator
from sparktrain.data.columns import BINARY, DENSE, RAGGED, Column, Layout, row_shape_error
from sparktrain.data.features import Features
from sparktrain.data.ragged import Chunk, Ragged, RaggedSpillWriter, chunk_of_arrow
from sparktrain.data.spill import SpillWriter, column_path
from sparktrain.errors import DataError
from sparktrain.task.memory import sample_anon

Store = Features | Ragged

log = logging.getLogger(__name__)

# Column names the launcher gives the data it hands to the workers.
FEATURES = "features"
LABEL = "label"
IS_VALIDATION = "is_validation"
WEIGHT = "weight"


class PartitionData:
    """One worker's rows: one store per model input column (:class:`Features` for dense
    columns, :class:`Ragged` for variable-length and binary ones; each in memory or
    memory-mapped from a spill file), labels ``y`` float64 (``(n,)``, or ``(n, k)`` for
    ``k`` labels a row), which rows are validation rows, and optionally the rows'
    normalised sample weights ``w`` (n,) float64 (``None``: unweighted, every weight 1).
    Labels, flags and weights always stay in memory.

    ``x`` given as a matrix or one :class:`Features` is the plain layout (one float32
    features column); a list of stores goes with the ``layout`` that describes them.

    A partition that owns spill files removes them on :meth:`close`; its subsets
    (:meth:`select`, :meth:`split`) share the files and do not.
    """

    def __init__(
        self,
        x: np.ndarray | Features | Sequence[Store],
        y: np.ndarray,
        is_val: np.ndarray,
        w: np.ndarray | None = None,
        *,
        layout: Layout | None = None,
    ) -> None:
        if isinstance(x, Features):
            self.columns: list[Store] = [x]
        elif isinstance(x, np.ndarray):
            self.columns = [Features.in_memory(x)]
        else:
            self.columns = list(x)
        first = self.columns[0]
        self.layout = layout or Layout.plain(first.width if isinstance(first, Features) else 0)
        self.y = y
        self.is_val = is_val
        self.w = w

    @property
    def features(self) -> Features:
        """The first column's rows (the plain layout's features)."""
        first = self.columns[0]
        assert isinstance(first, Features), "the first input column is not dense"
        return first

    @property
    def x(self) -> np.ndarray:
        """Every row of the first (dense) column as one ``(n, width)`` matrix in memory."""
        return self.features.array()

    @property
    def size(self) -> int:
        return int(self.y.shape[0])

    @property
    def path(self) -> str:
        """``"spilled"`` when the rows live in memory-mapped spill files, else
        ``"memory"`` (the summary's ``data_path``)."""
        return "spilled" if any(c.spilled for c in self.columns) else "memory"

    @property
    def spilled_bytes(self) -> int:
        return sum(c.spilled_bytes for c in self.columns)

    def gather(self, idx: np.ndarray | torch.Tensor) -> torch.Tensor:
        """The first column's rows ``idx`` as a new tensor (the plain layout's batch)."""
        rows = idx.numpy() if isinstance(idx, torch.Tensor) else idx
        return torch.from_numpy(self.features.take(rows))

    def batch(self, idx: np.ndarray | torch.Tensor, collator: Collator, partition: int) -> Batch:
        """Rows ``idx`` as a :class:`~sparktrain.data.batch.Batch`: every input column,
        the labels and the weights."""
        rows = idx.numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
        taken = [c.take(rows) for c in self.columns]
        weights = None if self.w is None else self.w[rows]
        return collator.batch(taken, self.y[rows], weights, partition)

    def close(self) -> None:
        """Remove the spill files behind the columns, if this partition owns them."""
        for column in self.columns:
            column.close()

    def select(self, mask: np.ndarray) -> PartitionData:
        w = None if self.w is None else self.w[mask]
        return PartitionData(
            [c.subset(mask) for c in self.columns],
            self.y[mask],
            self.is_val[mask],
            w,
            layout=self.layout,
        )

    @staticmethod
    def concat(parts: list[PartitionData], width: int) -> PartitionData:
        """The rows of ``parts`` in order, in memory (weighted when the parts are); the
        plain layout only."""
        if not parts:
            return PartitionData(
                np.zeros((0, width), np.float32), np.zeros(0, np.float64), np.zeros(0, bool)
            )
        if len(parts) == 1:
            return parts[0]
        weights = [p.w for p in parts if p.w is not None]
        if weights and len(weights) != len(parts):
            raise DataError("cannot concatenate weighted and unweighted rows")
        return PartitionData(
            np.concatenate([p.x for p in parts]),
            np.concatenate([p.y for p in parts]),
            np.concatenate([p.is_val for p in parts]),
            np.concatenate(weights) if weights else None,
        )

    def weights_at(self, idx: np.ndarray | torch.Tensor) -> torch.Tensor | None:
        """The float32 sample weights of rows ``idx`` (for ``Loss(out, y, weight)``), or
        ``None`` when the data is unweighted."""
        return weights_at(self.w, idx)

    def labels_with_weights(self) -> np.ndarray:
        """``(n, 2)`` float64 ``[label, weight]`` rows (weight NaN when unweighted): how the
        pipeline ships labels and weights to a row's last stage in one message."""
        out = np.empty((self.size, 2), np.float64)
        out[:, 0] = self.y
        out[:, 1] = np.nan if self.w is None else self.w
        return out

    def split(
        self, validation_fraction: float, seed: int, rank: int
    ) -> tuple[PartitionData, PartitionData]:
        """(train, validation): rows tagged as validation, or else a seeded random
        ``validation_fraction`` of this partition."""
        if self.is_val.any() or validation_fraction <= 0:
            if not self.is_val.any():  # nothing held out: the train rows are all rows
                return self, self.select(self.is_val)
            return self.select(~self.is_val), self.select(self.is_val)
        rng = np.random.default_rng([seed, rank, 7919])
        held_out = rng.random(self.size) < validation_fraction
        return self.select(~held_out), self.select(held_out)


def weights_at(w: np.ndarray | None, idx: np.ndarray | torch.Tensor) -> torch.Tensor | None:
    """``w[idx]`` as float32 torch weights, or ``None`` for unweighted rows (``w is None``)."""
    if w is None:
        return None
    rows = idx.numpy() if isinstance(idx, torch.Tensor) else idx
    return torch.from_numpy(w[rows].astype(np.float32))


def split_labels_weights(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Inverse of :meth:`PartitionData.labels_with_weights` over gathered rows: (labels,
    weights or ``None`` when no row carries a weight)."""
    y = np.ascontiguousarray(rows[:, 0])
    w = rows[:, 1]
    missing = np.isnan(w)
    if missing.all():
        return y, None
    if missing.any():
        raise DataError("some rows carry sample weights and others do not; this is a bug")
    return y, np.ascontiguousarray(w)


@dataclass(frozen=True)
class SpillPlan:
    """Where and when a partition spills: after ``budget_bytes`` of rows held in memory,
    to ``path`` (see :mod:`sparktrain.data.spill`)."""

    budget_bytes: int
    path: Path


# Rows are copied into blocks of this size as they arrive: a shuffled batch's gather then
# costs a copy per block it touches, and a partition holds a handful of blocks, not one
# per Arrow batch (Spark sends 10,000 rows a batch).
BLOCK_BYTES = 32 << 20
MIN_BLOCK_BYTES = 256 << 10


class _Blocks:
    """Fills ``(rows_per_block, width)`` blocks of one dtype with incoming rows, in order."""

    def __init__(self, width: int, block_bytes: int = BLOCK_BYTES, dtype: Any = np.float32) -> None:
        self.width = width
        self.dtype = np.dtype(dtype)
        self.rows_per_block = max(1, block_bytes // (self.dtype.itemsize * max(1, width)))
        self.block: np.ndarray | None = None
        self.filled = 0
        self.spare: np.ndarray | None = None  # a written block's buffer, to fill again

    def add(self, x: np.ndarray) -> Iterator[np.ndarray]:
        """Copy ``x`` in (casting to the dtype); yields each block that becomes full."""
        start = 0
        while start < len(x):
            if self.block is None:
                self.block = self.spare if self.spare is not None else self._new()
                self.spare, self.filled = None, 0
            take = min(len(x) - start, self.rows_per_block - self.filled)
            self.block[self.filled : self.filled + take] = x[start : start + take]
            self.filled += take
            start += take
            if self.filled == self.rows_per_block:
                full, self.block = self.block, None
                yield full

    def _new(self) -> np.ndarray:
        # np.empty: pages of a block's unfilled tail are never touched, so never resident
        return np.empty((self.rows_per_block, self.width), self.dtype)

    def rest(self) -> np.ndarray | None:
        """The rows of the block being filled (a view), if any."""
        if self.block is None or not self.filled:
            return None
        return self.block[: self.filled]


def _write_held(writer: SpillWriter | RaggedSpillWriter, held: Sequence[Any]) -> None:
    for chunk in held:
        writer.write(chunk)


class _DenseIngest:
    """One dense column's rows, in blocks: held, or written to its spill file."""

    def __init__(self, column: Column, block_bytes: int) -> None:
        self.column = column
        self.dtype = np.dtype(column.stored_dtype)
        self.blocks = _Blocks(column.width, block_bytes, self.dtype)
        self.held: list[np.ndarray] = []
        self.writer: SpillWriter | None = None

    def add(self, x: np.ndarray) -> int:
        """Take ``(n, width)`` rows; the bytes they add."""
        for full in self.blocks.add(x):
            if self.writer is not None:
                self.writer.write(full)
                self.blocks.spare = full  # written: its buffer takes the next rows
            else:
                self.held.append(full)
        return len(x) * self.column.width * self.dtype.itemsize

    def spill(self, path: Path) -> None:
        """Write what is held, and from now on every full block, to ``path``."""
        self.writer = SpillWriter(path, self.column.width, self.dtype)
        _write_held(self.writer, self.held)
        self.held = []

    def finish(self) -> Features:
        rest = self.blocks.rest()
        if self.writer is not None:
            if rest is not None:
                self.writer.write(rest)
            return self.writer.finish()
        return Features(
            [*self.held, *([] if rest is None else [rest])], self.column.width, dtype=self.dtype
        )


class _RaggedIngest:
    """One variable-length or binary column's rows, as copied chunks: held, or written
    to its spill file."""

    def __init__(self, column: Column) -> None:
        self.column = column
        self.binary = column.kind == BINARY
        self.held: list[Chunk] = []
        self.writer: RaggedSpillWriter | None = None

    def add(self, chunk: Chunk) -> int:
        if self.writer is not None:
            self.writer.write(chunk)
        else:
            self.held.append(chunk)
        return int(chunk[0].nbytes + chunk[1].nbytes)

    def spill(self, path: Path) -> None:
        """Write what is held, and from now on every chunk, to ``path``."""
        dtype = None if self.binary else self.column.stored_dtype
        self.writer = RaggedSpillWriter(path, self.binary, dtype)
        _write_held(self.writer, self.held)
        self.held = []

    def finish(self) -> Ragged:
        if self.writer is not None:
            return self.writer.finish()
        return Ragged(self.held, self.binary)


class _Ingest:
    """Collects a partition's rows column by column, in memory until the plan's budget is
    exceeded, then (every column's rows held, and every later one) into spill files."""

    def __init__(self, layout: Layout, rank: int, plan: SpillPlan | None) -> None:
        self.layout, self.rank, self.plan = layout, rank, plan
        # a spilling worker holds one block per column while it fills: keep them well
        # inside the budget
        dense = max(1, sum(c.kind == DENSE for c in layout.columns))
        block_bytes = BLOCK_BYTES if plan is None else min(BLOCK_BYTES, plan.budget_bytes // 4)
        block_bytes = max(block_bytes // dense, MIN_BLOCK_BYTES)
        self.columns: list[_DenseIngest | _RaggedIngest] = [
            _DenseIngest(c, block_bytes) if c.kind == DENSE else _RaggedIngest(c)
            for c in layout.columns
        ]
        self.ys: list[np.ndarray] = []
        self.vs: list[np.ndarray] = []
        self.ws: list[np.ndarray] = []
        self.held_bytes = 0
        self.bad_rows = [0] * len(layout.columns)
        self.spilling = False

    def add(
        self,
        columns: Sequence[np.ndarray | Chunk],
        y: np.ndarray,
        v: np.ndarray,
        w: np.ndarray | None,
    ) -> None:
        sample_anon()  # the incoming Arrow batch and the blocks are both alive
        for i, (ingest, values) in enumerate(zip(self.columns, columns, strict=True)):
            if isinstance(ingest, _DenseIngest):
                assert isinstance(values, np.ndarray)
                if values.dtype.kind == "f" and values.dtype != ingest.dtype:
                    # checked as stored: a float32 value past float16's range becomes inf
                    with np.errstate(over="ignore"):
                        values = values.astype(ingest.dtype)
                if values.dtype.kind == "f":
                    self.bad_rows[i] += int(np.count_nonzero(~np.isfinite(values).all(axis=1)))
                self.held_bytes += ingest.add(values)
            else:
                assert isinstance(values, tuple)
                if values[1].dtype.kind == "f" and not np.isfinite(values[1]).all():
                    self.bad_rows[i] += 1
                self.held_bytes += ingest.add(values)
        self.ys.append(y)
        self.vs.append(v)
        if w is not None:
            self.ws.append(w)
        self.held_bytes += y.nbytes + v.nbytes + (0 if w is None else w.nbytes)
        if not self.spilling and self.plan is not None and self.held_bytes > self.plan.budget_bytes:
            self.spilling = True
            for i, ingest in enumerate(self.columns):
                ingest.spill(column_path(self.plan.path, i))

    def abort(self) -> None:
        for ingest in self.columns:
            if ingest.writer is not None:
                ingest.writer.abort()

    def finish(self) -> PartitionData:
        rank = self.rank
        for column, bad in zip(self.layout.columns, self.bad_rows, strict=True):
            if not bad:
                continue
            if self.layout.is_plain:
                raise DataError(
                    f"rank {rank}: {bad} rows have NaN or infinite features; clean or "
                    "impute them (e.g. pyspark.ml.feature.Imputer) before training"
                )
            beyond = ""
            if column.stored_dtype == "float16":
                beyond = (
                    f" (or values beyond float16's range, ±{float(np.finfo(np.float16).max):g})"
                )
            raise DataError(
                f"column {column.source!r}, partition {rank}: {bad} rows (or batches of rows, "
                f"for variable-length columns) hold NaN or infinite values{beyond}; clean or "
                "impute them before training"
            )
        if self.ws and len(self.ws) != len(self.ys):
            raise DataError(f"rank {rank}: some Arrow batches lack the {WEIGHT!r} column")
        y = _joined(self.ys, np.float64)
        if not self.ys and self.layout.label_width is not None:  # no rows: still (0, k)
            y = y.reshape(0, self.layout.label_width)
        if not np.isfinite(y).all():
            raise DataError(f"rank {rank}: labels contain NaN or infinity; drop those rows first")
        w = None
        if self.ws:
            w = _joined(self.ws, np.float64)
            # the driver checked the raw column; this guards data that bypassed prepare()
            if not (np.isfinite(w).all() and (w >= 0).all()):
                raise DataError(
                    f"rank {rank}: sample weights must be finite and >= 0; clean the weight column"
                )
        v = _joined(self.vs, bool)
        stores = [ingest.finish() for ingest in self.columns]
        if self.spilling:
            log.info(
                "rank %d: partition of %d rows spilled to %s (%d bytes)",
                rank, len(y), self.plan.path if self.plan else "?",
                sum(s.spilled_bytes for s in stores),
            )  # fmt: skip
        sample_anon()
        return PartitionData(stores, y, v, w, layout=self.layout)


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    if not parts:
        return np.zeros(0, dtype)
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def from_arrow(
    batches: Iterable[pa.RecordBatch],
    layout: Layout | int,
    rank: int,
    spill: SpillPlan | None = None,
) -> PartitionData:
    """A partition's Arrow batches as :class:`PartitionData`, checking shapes and values
    column by column (``layout``; an int is the plain layout's width); with a ``spill``
    plan, rows beyond its budget go to memory-mapped spill files."""
    if isinstance(layout, int):
        layout = Layout.plain(layout)
    ingest = _Ingest(layout, rank, spill)
    try:
        for batch in batches:
            if batch.num_rows:
                ingest.add(*_arrow_columns(batch, layout, rank))
        return ingest.finish()
    except BaseException:
        ingest.abort()
        raise


def _arrow_columns(
    batch: pa.RecordBatch, layout: Layout, rank: int
) -> tuple[list[np.ndarray | Chunk], np.ndarray, np.ndarray, np.ndarray | None]:
    columns = [_input_column(batch, column, layout, rank) for column in layout.columns]
    label = batch.column(LABEL)
    if label.null_count:
        raise DataError(
            f"rank {rank}: {label.null_count} rows have a null label; drop them before training"
        )
    # copies: a view would keep the whole Arrow message body alive (Spark's batches arrive
    # as one buffer per batch, features included), defeating the spill
    if layout.label_width is None:
        y = np.array(label.to_numpy(zero_copy_only=False), dtype=np.float64)
    else:
        y = _label_rows(label, layout, rank)
    if IS_VALIDATION in batch.schema.names:
        v = np.array(batch.column(IS_VALIDATION).to_numpy(zero_copy_only=False), dtype=bool)
    else:
        v = np.zeros(batch.num_rows, dtype=bool)
    w = None
    if WEIGHT in batch.schema.names:
        weight = batch.column(WEIGHT)
        if weight.null_count:
            raise DataError(
                f"rank {rank}: {weight.null_count} rows have a null weight; drop them or "
                "fill the weight column before training"
            )
        w = np.array(weight.to_numpy(zero_copy_only=False), dtype=np.float64)
    return columns, y, v, w


def _input_column(
    batch: pa.RecordBatch, column: Column, layout: Layout, rank: int
) -> np.ndarray | Chunk:
    """One input column of an Arrow batch: ``(n, width)`` values for a dense column (a
    view of the Arrow buffer, which the ingest copies into its blocks), an ``(offsets,
    values)`` copy for a variable-length or binary one."""
    values = batch.column(column.wire)
    where = f"column {column.source!r}, partition {rank}"
    if values.null_count:
        if layout.is_plain:
            raise DataError(
                f"rank {rank}: {values.null_count} rows have a null features value; "
                "drop or impute them before training"
            )
        raise DataError(
            f"{where}: {values.null_count} rows are null; drop them (df.dropna(subset=[...])) "
            "or fill them before training"
        )
    if column.kind != DENSE:
        if column.kind == RAGGED and values.flatten().null_count:  # this batch's elements
            raise DataError(f"{where}: arrays hold null elements; fill or drop them first")
        return chunk_of_arrow(values, None if column.kind == BINARY else column.stored_dtype)
    n, width = batch.num_rows, column.width
    if not (
        pa.types.is_list(values.type)
        or pa.types.is_large_list(values.type)
        or pa.types.is_fixed_size_list(values.type)
    ):
        return values.to_numpy(zero_copy_only=False).reshape(n, 1)
    lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
    if lengths.min() != width or lengths.max() != width:
        bad = int(lengths[lengths != width][0])
        if layout.is_plain:
            raise DataError(
                f"rank {rank}: a features row has {bad} values but the model expects {width}; "
                "every row must have the same width (check the features column or model_fn)"
            )
        raise row_shape_error(column, bad, rank)
    flat = values.flatten()
    if flat.null_count:
        raise DataError(f"{where}: arrays hold null elements; fill or drop them first")
    return flat.to_numpy(zero_copy_only=False).reshape(n, width)


def _label_rows(label: pa.Array, layout: Layout, rank: int) -> np.ndarray:
    """``(n, k)`` float64 labels from an array column (the driver stacks several label
    columns into one)."""
    k = layout.label_width
    assert k is not None
    lengths = pc.list_value_length(label).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths.min() != k or lengths.max() != k):
        bad = int(lengths[lengths != k][0])
        raise DataError(
            f"label column {', '.join(layout.label_sources)!r}, partition {rank}: a row has "
            f"{bad} labels, the first row had {k}; every row needs the same number"
        )
    flat = label.flatten()
    if flat.null_count:
        raise DataError(
            f"label column {', '.join(layout.label_sources)!r}, partition {rank}: labels hold "
            "nulls; drop those rows first"
        )
    return np.array(flat.to_numpy(zero_copy_only=False), dtype=np.float64).reshape(-1, k)


def from_rows(rows: Iterable[tuple[object, ...]], width: int, rank: int) -> PartitionData:
    """Convert an RDD partition of ``(features, label[, is_validation])`` tuples (held in
    memory: an RDD's rows are Python objects already)."""
    feats: list[object] = []
    labels: list[object] = []
    flags: list[bool] = []
    for row in rows:
        if len(row) < 2:
            raise DataError(f"rank {rank}: RDD rows must be (features, label) pairs, got {row!r}")
        feats.append(row[0])
        labels.append(row[1])
        flags.append(bool(row[2]) if len(row) > 2 else False)
    ingest = _Ingest(Layout.plain(width), rank, None)
    if not feats:
        return ingest.finish()
    try:
        x = np.asarray(feats, dtype=np.float32)
        y = np.asarray(labels, dtype=np.float64)
    except (ValueError, TypeError) as exc:
        raise DataError(
            f"rank {rank}: RDD rows must hold numeric features of width {width} and a numeric "
            f"label: {exc}"
        ) from exc
    if x.ndim != 2 or x.shape[1] != width:
        raise DataError(
            f"rank {rank}: features have shape {x.shape[1:]} but the model expects width {width}"
        )
    ingest.add([np.ascontiguousarray(x)], y.reshape(-1), np.asarray(flags, dtype=bool), None)
    return ingest.finish()


def check_labels(y: np.ndarray, num_classes: int, rank: int) -> None:
    """Cross-entropy labels must be integral class indices 0..num_classes-1."""
    if y.size == 0:
        return
    if not np.array_equal(y, np.round(y)) or y.min() < 0 or y.max() >= num_classes:
        raise DataError(
            f"rank {rank}: labels must be integral class indices 0..{num_classes - 1} for the "
            f"model's {num_classes} outputs; found values in [{y.min()}, {y.max()}] "
            "(index them with pyspark.ml.feature.StringIndexer)"
        )


def epoch_batches(
    n: int,
    batch_size: int,
    rng: np.random.Generator | None,
    drop_last: bool = False,
    window: int = 0,
) -> Iterator[np.ndarray]:
    """Index arrays of one epoch's mini-batches (shuffled when ``rng`` is given); with
    ``drop_last`` the final short batch is left out (its rows come back shuffled into
    other batches in later epochs). ``window > 0`` shuffles within windows of that many
    consecutive rows instead of over the whole partition (see :func:`epoch_order`)."""
    order = epoch_order(n, rng, window)
    for start in range(0, steps_for(n, batch_size, drop_last) * batch_size, batch_size):
        yield order[start : start + batch_size]


def epoch_order(n: int, rng: np.random.Generator | None, window: int = 0) -> np.ndarray:
    """One epoch's row order: a permutation of all ``n`` rows, or with ``window > 0`` the
    windowed shuffle: the partition is cut into windows of ``window`` consecutive rows
    (in arrival order), the windows are visited in a random order and each window's rows
    in a random order. Consecutive batches then read one region of a spilled file at a
    time, at the price of batches drawn from fewer, neighbouring rows. Seeded by ``rng``
    alone, so spilled and in-memory runs still see the same batches."""
    if rng is None:
        return np.arange(n)
    if window <= 0 or window >= n:
        return rng.permutation(n)
    starts = rng.permutation(np.arange(0, n, window))
    return np.concatenate([s + rng.permutation(min(window, n - s)) for s in starts])


def steps_for(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Mini-batches in an epoch of ``n`` rows: ``ceil(n / b)``, or ``n // b`` with
    ``drop_last``."""
    return n // batch_size if drop_last else -(-n // batch_size)
