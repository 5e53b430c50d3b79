"""Driver-side data preparation: check columns and types, tag validation rows, match the
partition count to ``num_workers``, and find the feature width — before any task starts."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sparktrain.errors import DataError
from sparktrain.worker.data import FEATURES, IS_VALIDATION, LABEL

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)


@dataclass
class PreparedData:
    """What the launcher runs on: a DataFrame or an RDD with exactly num_workers partitions."""

    frame: DataFrame | None
    rdd: RDD[Any] | None
    feature_width: int

    def shuffled(self, partitions: int) -> PreparedData:
        """The same rows, shuffled into exactly ``partitions`` partitions."""
        if self.frame is not None:
            return PreparedData(self.frame.repartition(partitions), None, self.feature_width)
        assert self.rdd is not None
        return PreparedData(None, self.rdd.repartition(partitions), self.feature_width)


def prepare(
    data: Any,
    validation_data: Any,
    features_col: str,
    label_col: str,
    num_workers: int,
) -> PreparedData:
    """Normalise a DataFrame or RDD (plus optional validation set) for the barrier stage."""
    from pyspark import RDD
    from pyspark.sql import DataFrame

    if isinstance(data, DataFrame):
        if validation_data is not None and not isinstance(validation_data, DataFrame):
            raise DataError("validation_data must be a DataFrame when data is a DataFrame")
        return _prepare_frame(data, validation_data, features_col, label_col, num_workers)
    if isinstance(data, RDD):
        if validation_data is not None and not isinstance(validation_data, RDD):
            raise DataError("validation_data must be an RDD when data is an RDD")
        return _prepare_rdd(data, validation_data, num_workers)
    raise DataError(
        f"data must be a pyspark DataFrame or an RDD of (features, label) pairs, "
        f"got {type(data).__name__}"
    )


def _prepare_frame(
    df: DataFrame, val: DataFrame | None, features_col: str, label_col: str, num_workers: int
) -> PreparedData:
    from pyspark.sql import functions as F

    train = _select(df, features_col, label_col, "data").withColumn(IS_VALIDATION, F.lit(False))
    combined = train
    if val is not None:
        tagged = _select(val, features_col, label_col, "validation_data")
        combined = train.unionByName(tagged.withColumn(IS_VALIDATION, F.lit(True)))
    first = combined.where(F.col(FEATURES).isNotNull()).select(F.size(FEATURES).alias("w")).first()
    if first is None:
        raise DataError("the training data is empty: nothing to train on")
    width = int(first["w"])
    if width <= 0:
        raise DataError("the features column holds empty arrays; each row needs at least one value")
    parts = combined.rdd.getNumPartitions()
    if parts != num_workers:
        log.info("repartitioning the data from %d partitions to num_workers=%d", parts, num_workers)
        combined = combined.repartition(num_workers)
    return PreparedData(combined, None, width)


def _select(df: DataFrame, features_col: str, label_col: str, what: str) -> DataFrame:
    """features -> array<float>, label -> double, with errors that say how to fix the input."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, NumericType

    for col in (features_col, label_col):
        if col not in df.columns:
            raise DataError(
                f"{what} has no column {col!r}; its columns are {df.columns}. "
                "Pass features_col=/label_col= to fit()"
            )
    ftype = df.schema[features_col].dataType
    if isinstance(ftype, VectorUDT):
        features = vector_to_array(F.col(features_col), "float32")
    elif isinstance(ftype, ArrayType) and isinstance(ftype.elementType, NumericType):
        features = F.col(features_col).cast("array<float>")
    else:
        raise DataError(
            f"column {features_col!r} has type {ftype.simpleString()}; features must be an "
            "ml Vector (e.g. from VectorAssembler) or an array of numbers"
        )
    ltype = df.schema[label_col].dataType
    if not isinstance(ltype, NumericType):
        raise DataError(
            f"column {label_col!r} has type {ltype.simpleString()}; labels must be numeric "
            "(index string labels with pyspark.ml.feature.StringIndexer)"
        )
    return df.select(features.alias(FEATURES), F.col(label_col).cast("double").alias(LABEL))


def _prepare_rdd(rdd: RDD[Any], val: RDD[Any] | None, num_workers: int) -> PreparedData:
    try:
        first = rdd.first()
    except ValueError:
        raise DataError("the training RDD is empty: nothing to train on") from None
    if not isinstance(first, tuple | list) or len(first) != 2:
        raise DataError(f"RDD rows must be (features, label) pairs; the first row is {first!r}")
    width = int(np.asarray(first[0]).size)
    combined = rdd.map(lambda row: (row[0], row[1], False))
    if val is not None:
        combined = combined.union(val.map(lambda row: (row[0], row[1], True)))
    parts = combined.getNumPartitions()
    if parts != num_workers:
        log.info("repartitioning the data from %d partitions to num_workers=%d", parts, num_workers)
        combined = combined.repartition(num_workers)
    return PreparedData(None, combined, width)
