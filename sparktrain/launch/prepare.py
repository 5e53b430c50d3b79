"""Driver-side data preparation: check columns and types, tag validation rows, match the
partition count to ``num_workers``, and find the feature width — before any task starts.

Sample weights (``weight_col``, DataFrames only): one aggregation job checks the column
(no nulls, NaN, infinities or negative values, not all zero) and finds the mean weight
``w̄`` over the training rows; the workers receive ``w / w̄`` in the
:data:`~sparktrain.worker.data.WEIGHT` column. With weights of mean 1, each batch's loss
``sum w_i l_i / n`` (``builders.Loss``) makes the training set's gradient exactly that of
the weighted mean loss ``sum w_i l_i / sum w_i``, while every step's sample-count averaged
gradient stays an unbiased estimate of it; the gradient machinery is unchanged.
``validation_data`` needs no weight column: validation metrics are unweighted. With
``validation_fraction`` instead, ``w̄`` is taken over every row of ``data`` before the
workers' random hold-out, so the training rows' weights have mean ≈ 1 rather than exactly
1: the objective's minimiser is the same, its gradient is scaled by that ratio.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from sparktrain.errors import DataError
from sparktrain.worker.data import FEATURES, IS_VALIDATION, LABEL, WEIGHT

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
    mean_weight: float | None = None
    """The training rows' mean raw weight (``None``: unweighted); the frame's
    :data:`~sparktrain.worker.data.WEIGHT` column is already divided by it."""

    def shuffled(self, partitions: int) -> PreparedData:
        """The same rows, shuffled into exactly ``partitions`` partitions."""
        if self.frame is not None:
            frame = self.frame.repartition(partitions)
            return PreparedData(frame, None, self.feature_width, self.mean_weight)
        assert self.rdd is not None
        return PreparedData(None, self.rdd.repartition(partitions), self.feature_width)


def prepare(
    data: Any,
    validation_data: Any,
    features_col: str,
    label_col: str,
    num_workers: int,
    weight_col: str | None = None,
) -> PreparedData:
    """Normalise a DataFrame or RDD (plus optional validation set) for the barrier stage.

    ``weight_col`` names a numeric column of non-negative sample weights in ``data`` (a
    DataFrame); see the module docstring for how they are normalised."""
    from pyspark import RDD
    from pyspark.sql import DataFrame

    if isinstance(data, DataFrame):
        if validation_data is not None and not isinstance(validation_data, DataFrame):
            raise DataError("validation_data must be a DataFrame when data is a DataFrame")
        return _prepare_frame(
            data, validation_data, features_col, label_col, num_workers, weight_col or None
        )
    if isinstance(data, RDD):
        if weight_col:
            raise DataError(
                f"weight_col={weight_col!r} needs a DataFrame; turn the RDD into one first, "
                "e.g. spark.createDataFrame(rdd, ['features', 'label', 'weight'])"
            )
        if validation_data is not None and not isinstance(validation_data, RDD):
            raise DataError("validation_data must be an RDD when data is an RDD")
        return _prepare_rdd(data, validation_data, num_workers)
    raise DataError(
        f"data must be a pyspark DataFrame or an RDD of (features, label) pairs, "
        f"got {type(data).__name__}"
    )


def _prepare_frame(
    df: DataFrame,
    val: DataFrame | None,
    features_col: str,
    label_col: str,
    num_workers: int,
    weight_col: str | None = None,
) -> PreparedData:
    from pyspark.sql import functions as F

    train = _select(df, features_col, label_col, "data", weight_col)
    mean_weight = None
    if weight_col is not None:
        mean_weight = _mean_weight(train, weight_col)
        train = train.withColumn(WEIGHT, F.col(WEIGHT) / F.lit(mean_weight))
    train = train.withColumn(IS_VALIDATION, F.lit(False))
    combined = train
    if val is not None:
        tagged = _select(val, features_col, label_col, "validation_data")
        if weight_col is not None:  # validation metrics are unweighted
            tagged = tagged.withColumn(WEIGHT, F.lit(1.0))
        combined = train.unionByName(tagged.withColumn(IS_VALIDATION, F.lit(True)))
    first = combined.where(F.col(FEATURES).isNotNull()).select(F.size(FEATURES).alias("w")).first()
    if first is None:
        raise DataError("the training data is empty: nothing to train on")
    width = int(first["w"])
    if width <= 0:
        raise DataError("the features column holds empty arrays; each row needs at least one value")
    if val is not None:
        # A union never feeds a barrier stage as it is (Spark refuses RDD chains whose
        # partition counts differ, and a union's inputs each have fewer partitions than
        # it), so shuffle at once: asking the union for its partition count would first
        # run its inputs' shuffles under adaptive execution, only to shuffle again.
        log.info("shuffling the data and validation_data into num_workers=%d", num_workers)
        return PreparedData(combined.repartition(num_workers), None, width, mean_weight)
    parts = combined.rdd.getNumPartitions()
    if parts != num_workers:
        log.info("repartitioning the data from %d partitions to num_workers=%d", parts, num_workers)
        combined = combined.repartition(num_workers)
    return PreparedData(combined, None, width, mean_weight)


def _mean_weight(train: DataFrame, weight_col: str) -> float:
    """One aggregation job: check the training rows' weights and return their mean."""
    from pyspark.sql import functions as F

    w = F.col(WEIGHT)
    bad = w.isNull() | F.isnan(w) | (F.abs(w) == float("inf"))
    row = train.agg(
        F.count(F.lit(1)).alias("rows"),
        F.count(F.when(bad, 1)).alias("bad"),
        F.count(F.when(~bad & (w < 0), 1)).alias("negative"),
        F.sum(F.when(~bad, w)).alias("total"),
        F.max(F.when(~bad, w)).alias("max"),
    ).first()
    assert row is not None  # a global aggregate always has one row
    where = f"weight column {weight_col!r}"
    if not row["rows"]:
        raise DataError("the training data is empty: nothing to train on")
    if row["bad"]:
        raise DataError(
            f"{where}: {row['bad']} rows have a null, NaN or infinite weight; drop them or "
            "give them a finite weight >= 0 before training"
        )
    if row["negative"]:
        raise DataError(
            f"{where}: {row['negative']} rows have a negative weight; sample weights must be "
            ">= 0 (use 0 to ignore a row)"
        )
    if not row["max"] or not row["total"] > 0:
        raise DataError(
            f"{where}: every weight is 0, so there is nothing to train on; give some rows a "
            "positive weight (or leave the weight column out)"
        )
    mean = float(row["total"]) / float(row["rows"])
    log.info("sample weights %r: mean %.6g over %d training rows", weight_col, mean, row["rows"])
    return mean


def _select(
    df: DataFrame, features_col: str, label_col: str, what: str, weight_col: str | None = None
) -> DataFrame:
    """features -> array<float>, label -> double (and weight -> double, unnormalised),
    with errors that say how to fix the input."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, NumericType

    if weight_col is not None:
        if weight_col not in df.columns:
            raise DataError(
                f"{what} has no weight column {weight_col!r}; its columns are {df.columns}. "
                "Pass weight_col= the name of a numeric column of sample weights, or None"
            )
        wtype = df.schema[weight_col].dataType
        if not isinstance(wtype, NumericType):
            raise DataError(
                f"weight column {weight_col!r} has type {wtype.simpleString()}; sample "
                "weights must be numeric (cast the column, e.g. F.col(name).cast('double'))"
            )
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
    columns = [features.alias(FEATURES), F.col(label_col).cast("double").alias(LABEL)]
    if weight_col is not None:
        columns.append(F.col(weight_col).cast("double").alias(WEIGHT))
    return df.select(*columns)


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
