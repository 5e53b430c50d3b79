"""Driver-side data preparation: check columns and types, tag validation rows, match the
partition count to ``num_workers``, and find the feature width — before any task starts.

Sample weights (``weight_col``, DataFrames only): one aggregation job checks the column
(no nulls, NaN, infinities or negative values, not all zero) and finds the mean weight
``w̄`` over the training rows; the workers receive ``w / w̄`` in the
:data:`~sparktrain.data.partition_data.WEIGHT` column. With weights of mean 1, each batch's loss
``sum w_i l_i / n`` (``builders.Loss``) makes the training set's gradient exactly that of
the weighted mean loss ``sum w_i l_i / sum w_i``, while every step's sample-count averaged
gradient stays an unbiased estimate of it; the gradient machinery is unchanged.
``validation_data`` needs no weight column: validation metrics are unweighted. With
``validation_fraction`` instead, ``w̄`` is taken over every row of ``data`` before the
workers' random hold-out, so the training rows' weights have mean ≈ 1 rather than exactly
1: the objective's minimiser is the same, its gradient is scaled by that ratio.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from sparktrain.data.columns import (
    BINARY,
    DEFAULT_FLOAT,
    DENSE,
    INT_DTYPE,
    RAGGED,
    Call,
    Column,
    ColumnsSpec,
    Hook,
    Kind,
    Layout,
    check_dtype,
    check_options,
    check_shape,
    option_for,
    parse_columns,
    parse_labels,
)
from sparktrain.data.partition_data import FEATURES, IS_VALIDATION, LABEL, WEIGHT
from sparktrain.driver import warmup
from sparktrain.driver.console import progress_bar_held
from sparktrain.errors import DataError, not_a_spark_frame

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext
    from pyspark.sql import DataFrame

    from sparktrain.result import TrainResult

log = logging.getLogger(__name__)

FeaturesVeto = Callable[[], "str | None"]
"""Asked before ``feature_scaling="auto"`` scales: why the model needs its features as
they are (a sentence), or None."""


@dataclass
class PreparedData:
    """What the launcher runs on: a DataFrame or an RDD with exactly num_workers partitions."""

    frame: DataFrame | None
    rdd: RDD[Any] | None
    feature_width: int
    """The plain layout's feature width (0 for other layouts: see ``layout``)."""
    mean_weight: float | None = None
    """The training rows' mean raw weight (``None``: unweighted); the frame's
    :data:`~sparktrain.data.partition_data.WEIGHT` column is already divided by it."""
    layout: Layout | None = None
    """The model's input columns (``None``: the plain layout of ``feature_width``)."""
    samples: dict[str, bytes] = field(default_factory=dict)
    """One raw value per binary column, decoded on the driver to try the model."""
    label_stats: tuple[float, float] | None = None
    """``(mean, std)`` the labels were standardised with (``label_scaling``), else
    ``None``."""
    feature_stats: tuple[np.ndarray, np.ndarray] | None = None
    """Each feature's ``(mean, std)`` the features were standardised with
    (``feature_scaling``), else ``None``."""

    @property
    def label_scale(self) -> float:
        """What turns a standardised label difference back into label units."""
        return 1.0 if self.label_stats is None else self.label_stats[1]

    @property
    def data_layout(self) -> Layout:
        return self.layout or Layout.plain(self.feature_width)

    def shuffled(self, partitions: int) -> PreparedData:
        """The same rows, shuffled into exactly ``partitions`` partitions."""
        if self.frame is not None:
            frame = self.frame.repartition(partitions)
            return dataclasses.replace(self, frame=frame)
        assert self.rdd is not None
        return dataclasses.replace(self, rdd=self.rdd.repartition(partitions))


def unscale_result(result: TrainResult, prepared: PreparedData) -> None:
    """With ``feature_scaling``, wrap the trained model so it takes raw features again
    (:class:`~sparktrain.builders.FeatureScaled`); with ``label_scaling``, so its outputs
    are in label units again (:class:`~sparktrain.builders.LabelScaled`); and say so in
    the summary: before loggers and callbacks see the model."""
    from sparktrain.builders import FeatureScaled, LabelScaled

    if prepared.feature_stats is not None and "feature_scaling" not in result.summary:
        means, stds = prepared.feature_stats
        result.model = FeatureScaled(result.model, means, stds)
        result.summary["feature_scaling"] = {"features": int(means.size)}
    if prepared.label_stats is not None and "label_scaling" not in result.summary:
        mean, std = prepared.label_stats
        result.model = LabelScaled(result.model, mean, std)
        result.summary["label_scaling"] = {"mean": mean, "std": std}


@dataclass(frozen=True)
class ColumnOptions:
    """The per-column options of a fit (``TrainConfig`` keys of the same names)."""

    feature_shapes: Mapping[str, Any] = field(default_factory=dict)
    feature_dtypes: Mapping[str, Any] = field(default_factory=dict)
    decode: Mapping[str, Hook] = field(default_factory=dict)
    collate: Mapping[str, Hook] = field(default_factory=dict)

    @staticmethod
    def of(cfg: Any) -> ColumnOptions:
        return ColumnOptions(
            dict(cfg.feature_shapes), dict(cfg.feature_dtypes), dict(cfg.decode), dict(cfg.collate)
        )

    @property
    def given(self) -> bool:
        return bool(self.feature_shapes or self.feature_dtypes or self.decode or self.collate)


def prepare(
    data: Any,
    validation_data: Any,
    features_col: ColumnsSpec,
    label_col: str | Sequence[str],
    num_workers: int,
    weight_col: str | None = None,
    options: ColumnOptions | None = None,
    label_scaling: bool | str = False,
    feature_scaling: bool | str = False,
    features_veto: FeaturesVeto | None = None,
) -> PreparedData:
    """Normalise a DataFrame or RDD (plus optional validation set) for the barrier stage.

    ``features_col`` is a column name, a list of names or a ``{model_argument: column}``
    mapping and ``label_col`` a name or a list of names (see
    :mod:`sparktrain.data.columns`); ``options`` holds the per-column shapes, dtypes,
    decoders and collates. ``label_scaling`` standardises a scalar label with the
    training rows' mean and standard deviation, and ``feature_scaling`` each feature of
    one numeric features column: one aggregation job for both, which also measures the
    columns' widths (otherwise a ``first()`` job reads them);
    ``"auto"`` for either: where the data allows it (a DataFrame; a scalar label; one
    plain features column, and a model that does not say no: ``features_veto``, asked
    only then, returns why the features must stay as they are, e.g. indices into an
    embedding), ``True``: an error where it does not. ``weight_col`` names a numeric
    column of non-negative sample weights in ``data`` (a DataFrame); see the module
    docstring for how they are normalised."""
    sc = _classic_context(data)
    held = contextlib.nullcontext() if sc is None else progress_bar_held(sc)
    try:
        with held:
            prepared = _prepare(
                data,
                validation_data,
                features_col,
                label_col,
                num_workers,
                weight_col,
                options or ColumnOptions(),
                label_scaling,
                feature_scaling,
                features_veto,
            )
    finally:
        # No warm-up job may outlive the fit's data preparation (see warmup.settle):
        # a session stopped right after a failed fit would break it, and Spark print that.
        if sc is not None:
            warmup.settle(sc)
    return prepared


def _classic_context(data: Any) -> SparkContext | None:
    """The SparkContext of a classic DataFrame or an RDD (None: Spark Connect, other)."""
    from pyspark import RDD
    from pyspark.sql import DataFrame

    from sparktrain.driver.spark_env import is_connect

    if isinstance(data, RDD):
        return data.context
    if isinstance(data, DataFrame) and not is_connect(data):
        return data.sparkSession.sparkContext
    return None


def _prepare(
    data: Any,
    validation_data: Any,
    features_col: ColumnsSpec,
    label_col: str | Sequence[str],
    num_workers: int,
    weight_col: str | None,
    options: ColumnOptions,
    label_scaling: bool | str,
    feature_scaling: bool | str,
    features_veto: FeaturesVeto | None = None,
) -> PreparedData:
    from pyspark import RDD
    from pyspark.sql import DataFrame

    if isinstance(data, DataFrame):
        if validation_data is not None and not isinstance(validation_data, DataFrame):
            raise DataError("validation_data must be a DataFrame when data is a DataFrame")
        return _prepare_frame(
            data,
            validation_data,
            features_col,
            label_col,
            num_workers,
            weight_col or None,
            options,
            label_scaling,
            feature_scaling,
            features_veto,
        )
    if isinstance(data, RDD):
        if weight_col:
            raise DataError(
                f"weight_col={weight_col!r} needs a DataFrame; turn the RDD into one first, "
                "e.g. spark.createDataFrame(rdd, ['features', 'label', 'weight'])"
            )
        for key, value in (("label_scaling", label_scaling), ("feature_scaling", feature_scaling)):
            if value is True:
                raise DataError(
                    f"{key} needs a DataFrame (the driver computes the statistics with "
                    "Spark SQL): spark.createDataFrame(rdd, ['features', 'label']) first"
                )
        if not isinstance(features_col, str) or not isinstance(label_col, str) or options.given:
            raise DataError(
                "an RDD of (features, label) pairs has one float features vector and one label; "
                "several or typed columns (features_col/label_col lists or mappings, "
                "feature_shapes, feature_dtypes, decode, collate) need a DataFrame: "
                "spark.createDataFrame(rdd, [...]) first"
            )
        if validation_data is not None and not isinstance(validation_data, RDD):
            raise DataError("validation_data must be an RDD when data is an RDD")
        return _prepare_rdd(data, validation_data, num_workers)
    raise not_a_spark_frame(data)


def _prepare_frame(
    df: DataFrame,
    val: DataFrame | None,
    features_col: ColumnsSpec,
    label_col: str | Sequence[str],
    num_workers: int,
    weight_col: str | None,
    options: ColumnOptions,
    label_scaling: bool | str = False,
    feature_scaling: bool | str = False,
    features_veto: FeaturesVeto | None = None,
) -> PreparedData:
    from pyspark.sql import functions as F

    plan = _plan_columns(df, features_col, label_col, options)
    train = _select(df, plan, "data", weight_col)
    scale_labels = label_scaling is True or (label_scaling == "auto" and not plan.label_is_array)
    if scale_labels:
        _check_scalar_label(plan)
    scale_features = _scales_features(plan, feature_scaling)
    summary = None
    if scale_labels or scale_features:
        # one job for the statistics and the widths: a Spark job in a fresh application
        # costs about a second of planning and scheduling, whatever its size
        summary = _summarise(train, plan, scale_labels, scale_features, feature_scaling)
    stats = summary.labels if summary is not None else None
    features = summary.features if summary is not None else None
    if features is not None and feature_scaling == "auto" and features_veto is not None:
        # asked after the job, which so runs while the driver still builds the model
        reason = features_veto()
        if reason:
            log.info("feature_scaling: %s; training on the features as they are", reason)
            features = None
    scaling = _scaling(plan, features)
    train = _features_scaled(train, scaling)
    mean_weight = None
    if weight_col is not None:
        mean_weight = _mean_weight(train, weight_col)
        train = train.withColumn(WEIGHT, F.col(WEIGHT) / F.lit(mean_weight))
    train = _scaled(train, stats).withColumn(IS_VALIDATION, F.lit(False))
    combined = train
    if val is not None:
        tagged = _scaled(_features_scaled(_select(val, plan, "validation_data"), scaling), stats)
        if weight_col is not None:  # validation metrics are unweighted
            tagged = tagged.withColumn(WEIGHT, F.lit(1.0))
        combined = train.unionByName(tagged.withColumn(IS_VALIDATION, F.lit(True)))
    if summary is not None and summary.widths is not None:
        layout = _layout(plan, summary.widths, summary.label_width, "the rows")
        samples: dict[str, bytes] = {}
    else:
        layout, samples = _measure(combined, plan)
    width = layout.width if layout.is_plain else 0
    if val is not None:
        # A union never feeds a barrier stage as it is (Spark refuses RDD chains whose
        # partition counts differ, and a union's inputs each have fewer partitions than
        # it), so shuffle at once: asking the union for its partition count would first
        # run its inputs' shuffles under adaptive execution, only to shuffle again.
        log.info("shuffling the data and validation_data into num_workers=%d", num_workers)
        return PreparedData(
            combined.repartition(num_workers),
            None,
            width,
            mean_weight,
            layout,
            samples,
            stats,
            features,
        )
    parts = _partitions(combined)
    if parts is None:
        # A Spark Connect client cannot ask a plan for its partition count (no RDDs), and
        # an adaptive plan knows it only once its shuffles ran, which the stage would run
        # again: one shuffle into exactly num_workers partitions is the price.
        log.info(
            "the data's partition count is not known before its shuffles run; "
            "shuffling it into num_workers=%d partitions",
            num_workers,
        )
        combined = combined.repartition(num_workers)
    elif parts != num_workers:
        log.info("repartitioning the data from %d partitions to num_workers=%d", parts, num_workers)
        combined = combined.repartition(num_workers)
    return PreparedData(combined, None, width, mean_weight, layout, samples, stats, features)


# Logical plan nodes whose output has their input's partitions.
_SAME_PARTITIONS = ("Project", "Filter", "BatchEvalPython", "ArrowEvalPython")


def _partitions(frame: DataFrame) -> int | None:
    """The frame's partition count where it is known without a Spark job; None under
    Spark Connect (no RDDs) and for an adaptive plan (one with a shuffle) unless its last
    shuffle is a ``repartition(n)``: such a plan runs its shuffles to say how many
    partitions it has (adaptive execution may coalesce them), and the stage would run
    them again."""
    from sparktrain.driver.spark_env import is_connect

    if is_connect(frame):
        return None
    execution = frame._jdf.queryExecution()
    if execution.executedPlan().getClass().getSimpleName() != "AdaptiveSparkPlanExec":
        return int(frame.rdd.getNumPartitions())  # no shuffle: planning alone says
    node = execution.optimizedPlan()
    while node.getClass().getSimpleName() in _SAME_PARTITIONS:
        node = node.children().head()
    kind = node.getClass().getSimpleName()
    # a count the user gave: adaptive execution coalesces only the shuffles it sized
    if kind == "Repartition" and node.shuffle():
        return int(node.numPartitions())
    if kind == "RepartitionByExpression" and node.optNumPartitions().isDefined():
        return int(node.numPartitions())
    return None


def _check_scalar_label(plan: _Plan) -> None:
    if plan.label_is_array:
        raise DataError(
            f"label_scaling standardises one scalar label; label_col "
            f"{', '.join(plan.label_sources)!r} holds several values a row: scale them "
            "yourself (pyspark.ml.feature.StandardScaler) and set label_scaling=false"
        )


MAX_SCALED_FEATURES = 65_536
"""``feature_scaling="auto"`` leaves wider features as they are: their figures would
ride in every query plan."""


def _scales_features(plan: _Plan, feature_scaling: bool | str) -> bool:
    """Whether ``feature_scaling`` applies to ``plan``'s inputs: one fixed-width float
    vector or array column (``True`` elsewhere is an error that says what to do)."""
    if feature_scaling is False:
        return False
    inputs = plan.inputs
    plain = (
        plan.call == "single"
        and len(inputs) == 1
        and inputs[0].measure
        and inputs[0].column.kind == DENSE
        and inputs[0].column.dtype in ("float32", "float64")
        and not inputs[0].column.shape
    )
    if not plain and feature_scaling is True:
        raise DataError(
            "feature_scaling standardises one column of numeric feature vectors; "
            f"these inputs ({', '.join(p.column.source for p in inputs)}) are several "
            "or typed columns: scale them yourself (pyspark.ml.feature.StandardScaler) "
            "and set feature_scaling=false"
        )
    return plain


# The summary's group keys below 0 (features are 0..width-1): the label, an array
# label's width, then one per fixed-size input column (its row widths).
_LABEL_KEY = -1
_LABEL_WIDTH_KEY = -2
_WIDTH_KEY = -3


@dataclass
class _Summary:
    """What one aggregation job found in the training rows."""

    widths: dict[int, int] | None
    """Row width of each fixed-size input (by its index in the plan), when the job
    measured them: every training row of a column has that many values."""
    label_width: int | None
    labels: tuple[float, float] | None
    """The labels' ``(mean, std)``, when asked for."""
    features: tuple[np.ndarray, np.ndarray] | None
    """Each feature's ``(mean, std)``, when asked for (``None`` also for an ``"auto"``
    fit whose features are wider than :data:`MAX_SCALED_FEATURES`)."""


def _summarise(
    train: DataFrame, plan: _Plan, labels: bool, features: bool, feature_scaling: bool | str
) -> _Summary:
    """One aggregation job over the training rows for every figure the driver needs of
    them: the labels' mean and (population) standard deviation (``labels``), each
    feature's (``features``), and the row widths of the fixed-size inputs and of an array
    label, which are then not read from a first row (no binary column needs a sample).
    Each figure is one group of ``(key, value)`` pairs: a feature's key is its index,
    the others' are below 0. A constant label or feature keeps a scale of 1."""
    from pyspark.sql import functions as F

    # one SQL expression rather than a Python call per part: each call is a round trip
    # to the JVM, and a fresh driver makes them while it imports torch on a thread
    def pair(key: object, value: str) -> str:
        return f"named_struct('k', {key}, 'v', cast({value} as double))"

    def width(column: str) -> str:  # null for a null array (size() of null is -1 or null)
        return f"if(`{column}` is null, null, size(`{column}`))"

    parts = []
    if features:
        values = f"transform(`{FEATURES}`, (x, i) -> {pair('i', 'x')})"
        parts.append(f"coalesce({values}, cast(array() as array<struct<k:int,v:double>>))")
    markers = []
    if labels:
        markers.append(pair(_LABEL_KEY, f"`{LABEL}`"))
    measured = not any(p.column.kind == BINARY for p in plan.inputs)
    if measured:
        for i, p in enumerate(plan.inputs):
            if p.measure:
                markers.append(pair(_WIDTH_KEY - i, width(p.column.wire)))
        if plan.label_is_array and plan.label_width is None:
            markers.append(pair(_LABEL_WIDTH_KEY, width(LABEL)))
    if markers:
        parts.append(f"array({', '.join(markers)})")
    figures = (
        "count(v) as n",
        "mean(v) as m",
        "stddev_pop(v) as s",
        "min(v) as lo",
        "max(v) as hi",
    )
    rows = (
        train.selectExpr(f"inline(concat({', '.join(parts)}))")
        .groupBy("k")
        .agg(*(F.expr(f) for f in figures))
        .collect()
    )
    groups = {int(row["k"]): row for row in rows}
    label_stats = _label_figures(groups.get(_LABEL_KEY), plan) if labels else None
    feature_stats = _feature_figures(groups, plan, feature_scaling) if features else None
    if not measured:
        return _Summary(None, plan.label_width, label_stats, feature_stats)
    found = {
        i: _one_width(groups.get(_WIDTH_KEY - i)) for i, p in enumerate(plan.inputs) if p.measure
    }
    label_width = plan.label_width
    if plan.label_is_array and label_width is None:
        label_width = _one_width(groups.get(_LABEL_WIDTH_KEY))
        if label_width is None:
            return _Summary(None, None, label_stats, feature_stats)
    if any(w is None for w in found.values()):
        return _Summary(None, label_width, label_stats, feature_stats)
    widths = {i: w for i, w in found.items() if w is not None}
    return _Summary(widths, label_width, label_stats, feature_stats)


def _label_figures(group: Any, plan: _Plan) -> tuple[float, float]:
    if group is None or group["m"] is None:
        raise DataError("the training data is empty: nothing to train on")
    mean, std = float(group["m"]), float(group["s"] or 0.0)
    if not math.isfinite(mean) or not math.isfinite(std):
        raise DataError(
            f"label column {plan.label_sources[0]!r} holds NaN or infinite values; drop "
            "those rows first"
        )
    std = std if std > 0 else 1.0
    log.info("label_scaling: labels standardised with mean %.6g and std %.6g", mean, std)
    return mean, std


def _one_width(group: Any) -> int | None:
    """The one row width of a fixed-size column or array label, from its summary group;
    None when its training rows have none (no rows, all null, empty arrays) or several:
    then the first row decides, as it did, and the tasks' ingest names the rows that
    differ."""
    if group is None or not group["n"] or group["lo"] != group["hi"] or group["lo"] <= 0:
        return None
    return int(group["hi"])


def _empty_arrays(column: Column, plan: _Plan) -> None:
    if plan.call == "single" and column.dtype == DEFAULT_FLOAT and not column.shape:
        raise DataError("the features column holds empty arrays; each row needs at least one value")
    raise DataError(
        f"column {column.source!r} holds empty arrays; each row needs at least one "
        "value (or declare it variable-length: "
        f"feature_shapes={{{column.key!r}: [-1]}})"
    )


def _feature_figures(
    groups: dict[int, Any], plan: _Plan, feature_scaling: bool | str
) -> tuple[np.ndarray, np.ndarray] | None:
    count = sum(1 for k in groups if k >= 0)
    if not count:
        raise DataError("the training data is empty: nothing to train on")
    if count > MAX_SCALED_FEATURES and feature_scaling == "auto":
        log.info(
            "feature_scaling: %d features are more than %d; training on them as they are",
            count,
            MAX_SCALED_FEATURES,
        )
        return None
    figures = np.zeros((2, count))
    for k, row in groups.items():
        if k >= 0:  # indices 0..count-1: a row of k values holds every lower index
            figures[:, k] = (row["m"], row["s"] if row["s"] is not None else 0.0)
    if not np.isfinite(figures).all():
        raise DataError(
            f"features column {plan.inputs[0].column.source!r} holds NaN or infinite values; "
            "drop or fill those rows first (pyspark.ml.feature.Imputer)"
        )
    means, stds = figures
    stds[stds <= 0] = 1.0
    log.info("feature_scaling: %d features standardised with their mean and std", count)
    return means, stds


def _features_scaled(frame: DataFrame, scaling: Any) -> DataFrame:
    return frame if scaling is None else frame.withColumn(FEATURES, scaling)


def _scaling(plan: _Plan, stats: tuple[np.ndarray, np.ndarray] | None) -> Any:
    """The expression that standardises the features column with ``stats`` (None: none),
    as one SQL expression: built from one Python call per figure, it made a thousand
    round trips to the JVM for 64 features. ``repr`` of a float reads back as the same
    double."""
    from pyspark.sql import functions as F

    if stats is None:
        return None
    element = "double" if plan.inputs[0].column.dtype == "float64" else "float"

    def figures(values: np.ndarray) -> str:
        return "array(" + ", ".join(f"{float(v)!r}D" for v in values) + ")"

    return F.expr(
        f"cast(transform(`{FEATURES}`, (x, i) -> (x - element_at({figures(stats[0])}, i + 1)) "
        f"/ element_at({figures(stats[1])}, i + 1)) as array<{element}>)"
    )


def _scaled(frame: DataFrame, stats: tuple[float, float] | None) -> DataFrame:
    from pyspark.sql import functions as F

    if stats is None:
        return frame
    mean, std = stats
    return frame.withColumn(LABEL, (F.col(LABEL) - F.lit(mean)) / F.lit(std))


@dataclass
class _Planned:
    """One input column before its width is measured: the column, the Spark expression
    that ships it, and whether its width comes from the first row."""

    column: Column
    expr: Any
    measure: bool


@dataclass
class _Plan:
    inputs: list[_Planned]
    call: Call
    label_sources: list[str]
    label_expr: Any
    label_is_array: bool
    label_width: int | None


def input_columns(df: DataFrame, layout: Layout) -> list[Any]:
    """The Spark expressions that ship ``df``'s model inputs as a trained ``layout`` reads
    them (named by each column's ``wire``): how ``transform`` feeds a fitted model. The
    columns must have the types they had in training; errors name the column."""
    spec: ColumnsSpec
    if layout.call == "single":
        spec = layout.columns[0].source
    elif layout.call == "positional":
        spec = [c.source for c in layout.columns]
    else:
        spec = {c.key: c.source for c in layout.columns}
    variable: dict[str, Any] = {c.key: [-1] for c in layout.columns if c.kind == RAGGED}
    fixed = {c.key: list(c.shape) for c in layout.columns if c.kind == DENSE and len(c.shape) > 1}
    options = ColumnOptions(
        feature_shapes={**variable, **fixed},
        feature_dtypes={c.key: c.dtype for c in layout.columns if c.kind != BINARY},
        decode={c.key: c.decode for c in layout.columns if c.decode is not None},
        collate={c.key: c.collate for c in layout.columns if c.collate is not None},
    )
    if layout.is_plain:
        options = ColumnOptions()
    plan = _plan_columns(df, spec, None, options)
    for planned, trained in zip(plan.inputs, layout.columns, strict=True):
        if planned.column.kind != trained.kind:
            raise DataError(
                f"column {trained.source!r} is {planned.column.kind} here but was "
                f"{trained.kind} in training; give it the type it had then"
            )
    return [p.expr for p in plan.inputs]


def _plan_columns(
    df: DataFrame,
    features_col: ColumnsSpec,
    label_col: str | Sequence[str] | None,
    opts: ColumnOptions,
) -> _Plan:
    """Check every named column's type against its options; the expressions that ship
    them as the workers read them."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, BinaryType, IntegralType, NumericType

    call, pairs = parse_columns(features_col)
    labels = [] if label_col is None else parse_labels(label_col)
    check_options(
        [k for k, _ in pairs],
        [s for _, s in pairs],
        opts.feature_shapes,
        opts.feature_dtypes,
        opts.decode,
        opts.collate,
    )
    for col in [*(s for _, s in pairs), *labels]:
        if col not in df.columns:
            raise DataError(
                f"data has no column {col!r}; its columns are {df.columns}. "
                "Pass features_col=/label_col= to fit()"
            )
    inputs: list[_Planned] = []
    keys = [k for k, _ in pairs]
    for i, (key, source) in enumerate(pairs):
        wire = FEATURES if call == "single" else f"{FEATURES}_{i}"
        dtype_opt = option_for(opts.feature_dtypes, key, source, keys)
        dtype = check_dtype(key, dtype_opt) if dtype_opt is not None else None
        shape_opt = option_for(opts.feature_shapes, key, source, keys)
        shape = check_shape(key, shape_opt) if shape_opt is not None else None
        decode = option_for(opts.decode, key, source, keys)
        collate = option_for(opts.collate, key, source, keys)
        ftype = df.schema[source].dataType
        where = f"column {source!r}" + ("" if key == source else f" (model argument {key!r})")

        def spark_float(dtype: str) -> str:
            return "double" if dtype == "float64" else "float"

        if isinstance(ftype, BinaryType):
            if decode is None:
                raise DataError(
                    f"{where} holds bytes: give decode={{{key!r}: 'module:function'}} that turns "
                    "one value into an array (e.g. image bytes into a float tensor)"
                )
            if shape is not None or dtype is not None:
                raise DataError(
                    f"{where} holds bytes: its decode gives the shape and dtype, so leave it out "
                    "of feature_shapes/feature_dtypes"
                )
            column = Column(key, source, wire, BINARY, "binary", (), decode, collate)
            inputs.append(_Planned(column, F.col(source).alias(wire), False))
            continue
        if decode is not None:
            raise DataError(
                f"decode is for binary columns; {where} has type {ftype.simpleString()}"
            )
        if isinstance(ftype, VectorUDT) or (
            isinstance(ftype, ArrayType) and isinstance(ftype.elementType, NumericType)
        ):
            integral = isinstance(ftype, ArrayType) and isinstance(ftype.elementType, IntegralType)
            target = dtype or (INT_DTYPE if integral else DEFAULT_FLOAT)
            if isinstance(ftype, VectorUDT):
                if target == INT_DTYPE:
                    raise DataError(f"{where} is an ml Vector (floats); it cannot be int64")
                expr = vector_to_array(
                    F.col(source), "float64" if target == "float64" else "float32"
                )
            else:
                spark_type = "bigint" if target == INT_DTYPE else spark_float(target)
                expr = F.col(source).cast(f"array<{spark_type}>")
            ragged = shape == (-1,)
            if ragged and isinstance(ftype, VectorUDT):
                raise DataError(
                    f"{where} is an ml Vector, whose rows all have one size: drop its [-1]"
                )
            if collate is not None and not ragged:
                raise DataError(
                    f"collate is for variable-length and binary columns; declare {where} "
                    f"variable-length with feature_shapes={{{key!r}: [-1]}} to collate it"
                )
            kind: Kind = RAGGED if ragged else DENSE
            column = Column(key, source, wire, kind, target, shape or (), None, collate)
            inputs.append(_Planned(column, expr.alias(wire), not ragged))
            continue
        if isinstance(ftype, NumericType):
            if shape is not None and shape != (1,):
                raise DataError(
                    f"{where} holds one number a row; its feature_shapes entry must be [1] "
                    "or absent"
                )
            integral = isinstance(ftype, IntegralType)
            target = dtype or (INT_DTYPE if integral else DEFAULT_FLOAT)
            spark_type = "bigint" if target == INT_DTYPE else spark_float(target)
            column = Column(key, source, wire, DENSE, target, shape or ())
            inputs.append(_Planned(column, F.col(source).cast(spark_type).alias(wire), False))
            continue
        raise DataError(
            f"{where} has type {ftype.simpleString()}, which no model input takes: use numbers, "
            "arrays of numbers, ml Vectors, or bytes with a decode (index strings with "
            "pyspark.ml.feature.StringIndexer; tokenise text into an int array)"
        )
    for planned in inputs:
        mask_arg = f"{planned.column.key}_mask"
        if planned.column.kind == RAGGED and mask_arg in keys:
            raise DataError(
                f"model argument {mask_arg!r} is taken by column "
                f"{dict(pairs)[mask_arg]!r}, but it is where variable-length input "
                f"{planned.column.key!r} passes its mask: rename one of them"
            )
    if not labels:
        return _Plan(inputs, call, [], None, False, None)
    label_expr, label_is_array, label_width = _label_plan(df, labels)
    return _Plan(inputs, call, labels, label_expr, label_is_array, label_width)


def _label_plan(df: DataFrame, labels: list[str]) -> tuple[Any, bool, int | None]:
    """(expression of the LABEL column, whether it is an array, its width if known)."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, NumericType

    for col in labels:
        ltype = df.schema[col].dataType
        array = isinstance(ltype, VectorUDT) or (
            isinstance(ltype, ArrayType) and isinstance(ltype.elementType, NumericType)
        )
        if not isinstance(ltype, NumericType) and not (array and len(labels) == 1):
            raise DataError(
                f"column {col!r} has type {ltype.simpleString()}; labels must be numeric "
                "(index string labels with pyspark.ml.feature.StringIndexer)"
                + ("" if len(labels) == 1 else "; a list of label columns takes numeric scalars")
            )
    if len(labels) > 1:
        expr = F.array(*[F.col(c).cast("double") for c in labels])
        return expr.alias(LABEL), True, len(labels)
    ltype = df.schema[labels[0]].dataType
    if isinstance(ltype, VectorUDT):
        return vector_to_array(F.col(labels[0]), "float64").alias(LABEL), True, None
    if isinstance(ltype, ArrayType):
        return F.col(labels[0]).cast("array<double>").alias(LABEL), True, None
    return F.col(labels[0]).cast("double").alias(LABEL), False, None


def _measure(combined: DataFrame, plan: _Plan) -> tuple[Layout, dict[str, bytes]]:
    """One ``first()`` job: the first row's width of every fixed-size array column (and
    of an array label), and a value of every binary column; the layout they give."""
    from pyspark.sql import functions as F

    sized = [p for p in plan.inputs if p.measure]
    binary = [p for p in plan.inputs if p.column.kind == BINARY]
    selects = [F.size(p.column.wire).alias(f"w{i}") for i, p in enumerate(sized)]
    selects += [F.col(p.column.wire).alias(f"b{i}") for i, p in enumerate(binary)]
    if plan.label_is_array and plan.label_width is None:
        selects.append(F.size(LABEL).alias("lw"))
    condition = None
    for p in [*sized, *binary]:
        test = F.col(p.column.wire).isNotNull()
        condition = test if condition is None else condition & test
    frame = combined if condition is None else combined.where(condition)
    first = _first_row(frame.select(*selects, F.lit(1).alias("_")))
    if first is None:
        raise DataError("the training data is empty: nothing to train on")
    sized_index = {id(p): i for i, p in enumerate(sized)}
    widths = {}
    for i, p in enumerate(plan.inputs):
        if p.measure:
            widths[i] = int(first[f"w{sized_index[id(p)]}"])
            if widths[i] <= 0:
                _empty_arrays(p.column, plan)
    samples = {p.column.key: bytes(first[f"b{i}"]) for i, p in enumerate(binary)}
    label_width = plan.label_width
    if plan.label_is_array and label_width is None:
        label_width = int(first["lw"])
        if label_width <= 0:
            raise DataError(f"label column {plan.label_sources[0]!r} holds empty arrays")
    return _layout(plan, widths, label_width, "the first row"), samples


def _layout(plan: _Plan, widths: dict[int, int], label_width: int | None, seen: str) -> Layout:
    """The layout of ``plan`` with the row ``widths`` of its fixed-size inputs (by index;
    ``seen``: which rows had them, for the errors)."""
    columns = []
    for i, p in enumerate(plan.inputs):
        column = p.column
        if p.measure:
            width = widths[i]
            shape = column.shape or (width,)
            if math.prod(shape) != width:
                have = "has" if seen == "the first row" else "have"
                raise DataError(
                    f"feature_shapes[{column.key!r}] = {list(shape)} needs {math.prod(shape)} "
                    f"values a row, but {seen} of column {column.source!r} {have} {width}; "
                    "fix the shape or the column"
                )
            column = dataclasses.replace(column, shape=tuple(shape))
        columns.append(column)
    layout = Layout(tuple(columns), plan.call, label_width, tuple(plan.label_sources))
    log.info("%s", layout.describe())
    return layout


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


def _select(df: DataFrame, plan: _Plan, what: str, weight_col: str | None = None) -> DataFrame:
    """The planned input columns, the label (and the weight, unnormalised), with errors
    that say how to fix the input."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import NumericType

    for p in plan.inputs:
        if p.column.source not in df.columns:
            raise DataError(
                f"{what} has no column {p.column.source!r}; its columns are {df.columns}. "
                "Pass features_col=/label_col= to fit()"
            )
    for col in plan.label_sources:
        if col not in df.columns:
            raise DataError(
                f"{what} has no column {col!r}; its columns are {df.columns}. "
                "Pass features_col=/label_col= to fit()"
            )
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
    columns = [p.expr for p in plan.inputs] + [plan.label_expr]
    if weight_col is not None:
        columns.append(F.col(weight_col).cast("double").alias(WEIGHT))
    return df.select(*columns)


# Physical plan nodes that run Python: rows made in Python (a DataFrame from a list or
# an RDD), Python and pandas UDFs, mapInPandas/mapInArrow.
_PYTHON_PLAN = re.compile(r"ExistingRDD|Python|InPandas|InArrow")


def _first_row(frame: DataFrame) -> Any:
    """The frame's first row (None when it is empty). ``first()`` when no Python runs
    in the plan; otherwise :func:`_first_element` over its rows, since ``first()`` stops
    reading a Python worker's output early and pyspark then prints that worker's
    ``BrokenPipeError`` traceback."""
    from sparktrain.driver.spark_env import is_connect

    if is_connect(frame):  # the server's workers: their output is not this console's
        return frame.first()
    try:
        plan = str(frame._jdf.queryExecution().executedPlan().toString())
    except Exception:  # cannot tell: read it to the end
        plan = "Python"
    if not _PYTHON_PLAN.search(plan):
        return frame.first()
    return _first_element(frame.rdd)


def _first_element(rdd: RDD[Any]) -> Any:
    """The first element of ``rdd`` (None when it is empty), reading each partition it
    looks at to the end: partition 0 first, then 4, 16... more at a time, as ``take``
    does, while they are empty. A Python worker whose output is read to its end exits
    cleanly (``first()``/``take()`` leave it writing into a closed socket)."""
    count = rdd.getNumPartitions()
    start, batch = 0, 1
    while start < count:
        parts = list(range(start, min(count, start + batch)))
        found = rdd.context.runJob(rdd, _first_of_partition, parts)
        if found:
            return found[0]
        start, batch = start + batch, batch * 4
    return None


def _first_of_partition(rows: Iterable[Any]) -> list[Any]:
    found: list[Any] = []
    for row in rows:  # to the end: see _first_element
        if not found:
            found.append(row)
    return found


def _prepare_rdd(rdd: RDD[Any], val: RDD[Any] | None, num_workers: int) -> PreparedData:
    first = _first_element(rdd)
    if first is None:
        raise DataError("the training RDD is empty: nothing to train on")
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
