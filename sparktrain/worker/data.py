"""A partition's rows -> numpy arrays -> shuffled mini-batches.

DataFrame partitions arrive as Arrow record batches and become numpy without per-row
Python work; RDD partitions arrive as ``(features, label)`` tuples. Each worker converts
its partition once and keeps it for all epochs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparktrain.errors import DataError

# Column names the launcher gives the data it hands to the workers.
FEATURES = "features"
LABEL = "label"
IS_VALIDATION = "is_validation"


@dataclass
class PartitionData:
    """One worker's rows: features ``x`` (n, width) float32, labels ``y`` (n,) float64,
    and which rows are validation rows."""

    x: np.ndarray
    y: np.ndarray
    is_val: np.ndarray

    @property
    def size(self) -> int:
        return int(self.x.shape[0])

    def select(self, mask: np.ndarray) -> PartitionData:
        return PartitionData(self.x[mask], self.y[mask], self.is_val[mask])

    def split(
        self, validation_fraction: float, seed: int, rank: int
    ) -> tuple[PartitionData, PartitionData]:
        """(train, validation): rows tagged as validation, or else a seeded random
        ``validation_fraction`` of this partition."""
        if self.is_val.any() or validation_fraction <= 0:
            return self.select(~self.is_val), self.select(self.is_val)
        rng = np.random.default_rng([seed, rank, 7919])
        held_out = rng.random(self.size) < validation_fraction
        return self.select(~held_out), self.select(held_out)


def from_arrow(batches: Iterable[pa.RecordBatch], width: int, rank: int) -> PartitionData:
    """Concatenate a partition's Arrow batches into numpy, checking width and values."""
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    vs: list[np.ndarray] = []
    for batch in batches:
        if batch.num_rows == 0:
            continue
        feats = batch.column(FEATURES)
        if feats.null_count:
            raise DataError(
                f"rank {rank}: {feats.null_count} rows have a null features value; "
                "drop or impute them before training"
            )
        lengths = pc.list_value_length(feats).to_numpy(zero_copy_only=False)
        if lengths.min() != width or lengths.max() != width:
            bad = int(lengths[lengths != width][0])
            raise DataError(
                f"rank {rank}: a features row has {bad} values but the model expects {width}; "
                "every row must have the same width (check the features column or model_fn)"
            )
        values = feats.flatten().to_numpy(zero_copy_only=False)
        xs.append(values.astype(np.float32, copy=False).reshape(batch.num_rows, width))
        label = batch.column(LABEL)
        if label.null_count:
            raise DataError(
                f"rank {rank}: {label.null_count} rows have a null label; drop them before training"
            )
        ys.append(label.to_numpy(zero_copy_only=False).astype(np.float64, copy=False))
        if IS_VALIDATION in batch.schema.names:
            vs.append(batch.column(IS_VALIDATION).to_numpy(zero_copy_only=False).astype(bool))
        else:
            vs.append(np.zeros(batch.num_rows, dtype=bool))
    return _finish(xs, ys, vs, width, rank)


def from_rows(rows: Iterable[tuple[object, ...]], width: int, rank: int) -> PartitionData:
    """Convert an RDD partition of ``(features, label[, is_validation])`` tuples."""
    feats: list[object] = []
    labels: list[object] = []
    flags: list[bool] = []
    for row in rows:
        if len(row) < 2:
            raise DataError(f"rank {rank}: RDD rows must be (features, label) pairs, got {row!r}")
        feats.append(row[0])
        labels.append(row[1])
        flags.append(bool(row[2]) if len(row) > 2 else False)
    if not feats:
        return _finish([], [], [], width, rank)
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
    return _finish([x], [y.reshape(-1)], [np.asarray(flags, dtype=bool)], width, rank)


def _finish(
    xs: list[np.ndarray], ys: list[np.ndarray], vs: list[np.ndarray], width: int, rank: int
) -> PartitionData:
    if not xs:
        return PartitionData(
            np.zeros((0, width), np.float32), np.zeros(0, np.float64), np.zeros(0, bool)
        )
    x = np.concatenate(xs) if len(xs) > 1 else xs[0]
    y = np.concatenate(ys) if len(ys) > 1 else ys[0]
    bad_rows = int(np.count_nonzero(~np.isfinite(x).all(axis=1)))
    if bad_rows:
        raise DataError(
            f"rank {rank}: {bad_rows} rows have NaN or infinite features; clean or impute them "
            "(e.g. pyspark.ml.feature.Imputer) before training"
        )
    if not np.isfinite(y).all():
        raise DataError(f"rank {rank}: labels contain NaN or infinity; drop those rows first")
    return PartitionData(np.ascontiguousarray(x), y, np.concatenate(vs) if len(vs) > 1 else vs[0])


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


def epoch_batches(n: int, batch_size: int, rng: np.random.Generator | None) -> Iterator[np.ndarray]:
    """Index arrays of one epoch's mini-batches (shuffled when ``rng`` is given)."""
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]
