"""sparktrain as pyspark.ml Estimators: ``fit`` runs the :class:`~sparktrain.Trainer`.

``fit`` resolves everything on the driver first (as xgboost.spark does): the params become
a validated :class:`~sparktrain.TrainConfig`, the model factory is imported and built once,
and one aggregation job checks the features width and the labels, so a wrong column, an
unimportable ``modelFn`` or a non-integral class label fails at once with a message that
says what to change — before any barrier stage starts.

Several or typed inputs (``featuresCols``, or any of ``featureShapes``, ``featureDtypes``,
``decode``, ``collate``): ``fit`` hands the columns to the Trainer as ``features_col`` (a
name, a list or an ``{argument: column}`` mapping) and lets it check them; the driver still
checks the label column (schema, then one label aggregation job) against the model's
outputs, found by calling the model once on a sample batch of the inputs. The fitted
model keeps the trained :class:`~sparktrain.data.columns.Layout` (``model.layout``), and
``transform`` feeds it the same columns.

``weightCol`` (optional) names a numeric column of sample weights ``>= 0``: the training
objective is then the weighted mean loss ``sum w_i l_i / sum w_i``, as in MLlib's weighted
estimators (see :class:`sparktrain.builders.Loss` and ``driver/prepare.py`` for how the
workers compute it exactly). The reported training loss is weighted too; the validation
metric (``validationFraction``) and the model's outputs are not affected by weights.
"""

from __future__ import annotations

from abc import abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Self, TypeVar

import torch
from pyspark import inheritable_thread_target
from pyspark.ml.base import Predictor
from pyspark.ml.classification import ProbabilisticClassifier
from pyspark.ml.regression import Regressor
from pyspark.ml.util import DefaultParamsReadable, DefaultParamsReader, DefaultParamsWritable

from sparktrain.data.columns import Layout, parse_columns
from sparktrain.driver.job import check_job
from sparktrain.driver.prepare import ColumnOptions, prepare
from sparktrain.errors import ConfigError, DataError
from sparktrain.ml.model import (
    TorchClassificationModel,
    TorchModel,
    TorchRegressionModel,
    _features_as_float_array,
    build_module,
    layout_width,
    require_spark_frame,
    trained_module,
)
from sparktrain.ml.params import (
    CLASSIFICATION_LOSSES,
    REGRESSION_LOSSES,
    _TorchClassifierParams,
    _TorchParams,
    _TorchRegressorParams,
)
from sparktrain.ml.persistence import TorchEstimatorReader, TorchEstimatorWriter
from sparktrain.ml.shared_params import (
    _TorchClassifierKeywords,
    _TorchEstimatorSetters,
    _TorchRegressorKeywords,
)
from sparktrain.result import state_to_bytes
from sparktrain.trainer import Trainer

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row

__all__ = ["TorchClassifier", "TorchEstimator", "TorchRegressor"]

M = TypeVar("M", bound=TorchModel)


class TorchEstimator(
    Predictor[M],
    _TorchParams,
    _TorchEstimatorSetters,
    DefaultParamsWritable,
    DefaultParamsReadable[Any],
):
    """Base of the sparktrain estimators (see :class:`TorchClassifier` and
    :class:`TorchRegressor`): ``fit`` trains ``modelFn`` with the Trainer on the
    ``featuresCol`` / ``labelCol`` of a DataFrame and returns the fitted model. Its
    setters (``setLearningRate``...), and the classifier's and regressor's keyword
    arguments, are generated from :data:`sparktrain.ml.paramgen.PARAMS`."""

    _allowed_losses: tuple[str, ...] = ()

    @abstractmethod
    def _create_model(self) -> M:
        """An empty model of the matching class."""

    # ------------------------------------------------------------------ fit
    def _fit(self, dataset: DataFrame) -> M:
        require_spark_frame(dataset, "fit's dataset")
        cfg, model_fn, model_kwargs = self._resolve()
        if not self._is_plain_fit():
            return self._fit_typed(dataset, cfg, model_fn, model_kwargs)
        features_col = self.getFeaturesCol()
        features = _features_as_float_array(dataset, features_col, "fit")
        label_col, weight_col, module = self._checked_labels_and_module(
            dataset, cfg, model_fn, model_kwargs
        )
        stats = _column_stats(dataset, features, label_col)
        width = _check_stats(stats, features_col, label_col)
        num_outputs = _num_outputs(module, width)
        self._check_targets(stats, num_outputs)

        trainer = Trainer(model_fn, cfg, model_kwargs=model_kwargs, spark=dataset.sparkSession)
        result = trainer.fit(
            dataset, features_col=features_col, label_col=label_col, weight_col=weight_col or None
        )
        module, label_stats = trained_module(result.model, result.summary)
        model = self._create_model()._set_state(
            state_to_bytes(module.state_dict()),
            num_features=width,
            num_outputs=num_outputs,
            summary=result.summary,
            label_stats=label_stats,
        )
        return self._copyValues(model)

    def _checked_labels_and_module(
        self, dataset: DataFrame, cfg: Any, model_fn: str, model_kwargs: dict[str, Any]
    ) -> tuple[str, str | None, torch.nn.Module]:
        """(label column, weight column or None, the model built once, seeded): checks
        the label and weight columns, and imports and builds the model here, so that an
        unimportable modelFn fails before Spark."""
        label_col = self.getLabelCol()
        _check_label_column(dataset, label_col)
        weight_col = self.getWeightCol() if self.isDefined(self.weightCol) else None
        if weight_col:
            _check_weight_column(dataset, weight_col)
        torch.manual_seed(cfg.seed)
        return label_col, weight_col or None, build_module(model_fn, model_kwargs)

    def _fit_typed(
        self, dataset: DataFrame, cfg: Any, model_fn: str, model_kwargs: dict[str, Any]
    ) -> M:
        """Several or typed input columns: the Trainer checks and ships them; the driver
        checks the labels against the model's outputs before training starts."""
        spec, param = self._features_spec()
        _, pairs = parse_columns(spec, param)
        for _, source in pairs:
            if source not in dataset.columns:
                raise DataError(
                    f"fit: the input has no column {source!r} ({param}); its columns are "
                    f"{dataset.columns}. Call set{param[0].upper()}{param[1:]}(...)"
                )
        label_col, weight_col, module = self._checked_labels_and_module(
            dataset, cfg, model_fn, model_kwargs
        )
        trainer = Trainer(model_fn, cfg, model_kwargs=model_kwargs, spark=dataset.sparkSession)
        # The Trainer's own column checks and model probe, run once here for the model's
        # number of outputs, which the labels are checked against; the label job runs
        # meanwhile (both are small jobs, mostly waiting on Spark), in the caller's job
        # group, scheduler pool and tags (the thread inherits them).
        with ThreadPoolExecutor(1, thread_name_prefix="sparktrain-labels") as pool:
            in_caller_scope = inheritable_thread_target(dataset.sparkSession)
            labels = pool.submit(in_caller_scope(_label_stats), dataset, label_col)
            probe = prepare(
                dataset, None, spec, label_col, cfg.num_workers, None, ColumnOptions.of(cfg)
            )
            _, num_outputs = trainer.check_model(probe.data_layout, module, None, probe.samples)
            stats = labels.result()
        _check_label_stats(stats, label_col)
        self._check_targets(stats, num_outputs)

        result = trainer.fit(
            dataset, features_col=spec, label_col=label_col, weight_col=weight_col or None
        )
        layout = Layout.from_dict(result.summary["inputs"])
        module, label_stats = trained_module(result.model, result.summary)
        model = self._create_model()._set_state(
            state_to_bytes(module.state_dict()),
            num_features=layout_width(layout),
            num_outputs=num_outputs,
            summary=result.summary,
            layout=layout,
            label_stats=label_stats,
        )
        return self._copyValues(model)

    def _resolve(self) -> tuple[Any, str, dict[str, Any]]:
        """(TrainConfig, modelFn, modelKwargs), or a ConfigError saying which param to set."""
        if not self.isDefined(self.modelFn) or not self.getModelFn():
            raise ConfigError(
                f"{type(self).__name__}: set modelFn to an importable 'package.module:function' "
                "model factory, e.g. modelFn='sparktrain.models:mlp'"
            )
        if self.getLoss() not in self._allowed_losses:
            raise ConfigError(
                f"{type(self).__name__} does not train with loss={self.getLoss()!r}; allowed: "
                f"{', '.join(self._allowed_losses)}"
            )
        cfg = self._train_config()
        check_job(cfg)  # what the strategy makes of the params, before any Spark job
        return cfg, self.getModelFn(), self.getModelKwargsDict()

    def _check_targets(self, stats: Row, num_outputs: int) -> None:
        """Labels against the model's outputs (classifiers and regressors differ)."""

    # ------------------------------------------------------------------ persistence
    def write(self) -> TorchEstimatorWriter:
        """An MLWriter of the params (MLlib metadata), whose ``overwrite()`` also works
        under Spark Connect."""
        return TorchEstimatorWriter(self)

    @classmethod
    def read(cls) -> DefaultParamsReader[Self]:
        """An MLReader for this class (params only: an estimator holds no data)."""
        return TorchEstimatorReader(cls)

    @classmethod
    def load(cls, path: str, model_fn: str | None = None) -> Self:
        """Load an estimator saved with :meth:`save`. Its ``modelFn`` (unless ``model_fn``
        replaces it) and its ``decode`` / ``collate`` hooks must be in allowed modules
        (:func:`sparktrain.ml.allow_model_modules`). Its logger destinations
        (``tensorboardDir``, ``mlflowTrackingUri``) are not kept, with a warning: set
        them again if you trust them."""
        return TorchEstimatorReader(cls, model_fn=model_fn).load(path)


class TorchClassifier(
    _TorchClassifierKeywords,
    TorchEstimator[TorchClassificationModel],
    ProbabilisticClassifier,
    _TorchClassifierParams,
):
    """Train a torch classifier on a Spark DataFrame, as a pyspark.ml Estimator.

    ``modelFn`` builds a module mapping ``(n, numFeatures)`` float32 features to ``(n, C)``
    logits (``loss="cross_entropy"``) or ``(n, 1)`` logits (``loss="bce_with_logits"``,
    binary). Labels must be integral class indices ``0..C-1`` (index other labels with
    ``StringIndexer``). Features come from an ml Vector column (dense or sparse, e.g. from
    ``VectorAssembler``) or an ``array<float|double>`` column; with ``featuresCols`` the
    model takes several typed columns instead (``model(a, b)`` or ``model(user=...,
    item=...)``).

    Parameters
    ----------
    featuresCol, labelCol, predictionCol, probabilityCol, rawPredictionCol : str
        Input and output columns, as in MLlib; an empty output name leaves it out.
    featuresCols : list of str or dict, optional
        Several model inputs; when set and non-empty it overrides ``featuresCol``.
        ``["a", "b"]`` calls ``model(a, b)``; ``["user=user_id", "item=item_id"]`` (or the
        dict ``{"user": "user_id", "item": "item_id"}``) calls ``model(user=..., item=...)``.
        Integer columns arrive as int64 (ids stay exact), floats as float32; numeric
        scalars, numeric arrays, ml Vectors and bytes (with ``decode``) are accepted.
    featureShapes, featureDtypes, decode, collate : str or dict
        Per input column (by column name or model argument), as JSON objects: the row's
        shape (``{"image": [1, 28, 28]}``, ``[-1]`` for variable length, padded with a
        mask), its dtype, a ``"module:function"`` decoding a binary value, a
        ``"module:function"`` batching a variable-length or binary column. Any of them,
        or ``featuresCols``, makes ``featuresCol`` a typed input too (a numeric scalar, an
        int64 array, a shaped image...). See :mod:`sparktrain.data.columns`.
    weightCol : str, optional
        A numeric column of sample weights ``>= 0`` (not all zero; no nulls, NaN or
        infinities). The training objective becomes the weighted mean loss
        ``sum w_i l_i / sum w_i``, as in MLlib's weighted estimators; the reported training
        loss is weighted, the validation metric is not. Unset (default): every row weighs 1.
    modelFn : str
        Importable model factory ``"package.module:function"`` (required). It must be
        importable on the driver and on every executor.
    modelKwargs : str or dict
        Keyword arguments for ``modelFn``, as JSON text or a dict.
    loss : {"cross_entropy", "bce_with_logits"}
    optimizer : {"adam", "sgd", "adamw", "adagrad", "sparse_adam"}
        ``"adam"`` by default (the estimators' defaults are chosen to train standardised
        tabular data out of the box; docs/ml.md says why each).
    optimizerKwargs : str or dict
        Extra optimizer arguments, e.g. ``{"momentum": 0.9}``.
    learningRate : float
        0.001 by default (Adam's usual rate, as scikit-learn's MLP estimators).
    batchSize : int
        Samples per worker per step (32).
    maxEpochs : int
        Passes over the training data (50: enough for tables of a few hundred rows;
        lower it for large tables, or set ``earlyStopping``).
    numWorkers : int
        Training tasks; each needs a free task slot at once (except for
        ``strategy="tree_aggregate"``).
    strategy : {"ring", "tree", "ps", "tree_aggregate"}
        How the workers combine their gradients.
    compression : str
        Gradient compression spec (``"none"``).
    psMode : {"sync", "async", "ssp"}
        Parameter server consistency, for ``strategy="ps"``.
    seed : int
        Seeds initialisation, shuffling and the validation split.
    validationFraction : float
        Share of each partition held out to report a validation metric per epoch.
    dataMemoryInMB : float
        MiB a worker may hold its partition's rows in (512); a larger partition spills to
        a memory-mapped file under ``spark.local.dir`` (see docs/data.md).
    lrSchedule, lrScheduleKwargs, lrScheduleInterval, warmupSteps : str, str or dict, str, int
        A ``torch.optim.lr_scheduler`` class by name (``"none"``: a constant rate) with its
        keyword arguments (JSON or dict), stepped every ``"step"`` or ``"epoch"``, after a
        linear warm-up over ``warmupSteps`` optimizer steps (TrainConfig ``lr_schedule``...).
    precision, fp16SkipLimit : str, int
        ``"fp32"``, ``"bf16"`` or ``"fp16"`` (autocast; parameters stay float32); with
        fp16, the consecutive non-finite steps after which the run stops.
    accumulateSteps, clipGradNorm : int, float
        Mini-batches per optimizer step (1), and the global gradient norm to clip to (0:
        no clipping).
    earlyStopping : str or dict
        ``{"metric": "accuracy", "patience": 3}`` (also ``mode``, ``min_delta``,
        ``restore_best``) stops when the metric stops improving; ``{}`` (default): off.
    metrics : list of str
        Extra validation metrics by name, e.g. ``["macro_f1", "top_k:3"]`` (``[]``).
    tensorboardDir, mlflowTrackingUri, mlflowExperiment : str
        Log per-epoch metrics to TensorBoard event files there, and the run to MLflow
        (``""``: off; experiment ``"sparktrain"``).
    device, gpusPerTask : str, int
        ``"auto"`` (a GPU Spark gave the task when CUDA works, else the CPU), ``"cpu"``
        or ``"cuda"``; GPUs the training stage asks for per task (0: none asked; see
        docs/gpu.md).
    commBackend : str
        ``"sparktrain"`` (its own sockets) or ``"torch"`` (torch.distributed Gloo; see
        docs/torch.md) for ring/tree gradients.
    shardOptimizer : bool
        Shard the optimizer state over the ranks (ZeRO-1, ring/tree without
        compression; ``False``). See docs/sharding.md.
    driverServicesHost, driverServicesPorts : str
        The address (``""``: Spark's driver host, or the Connect client's) and port range
        ``"LOW-HIGH"`` (``""``: any) of the driver's services, which executors must reach;
        a model's ``transform`` serves large weights there under Spark Connect.

    Examples
    --------
    >>> from pyspark.ml import Pipeline
    >>> from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    >>> from pyspark.ml.feature import StandardScaler, VectorAssembler
    >>> from sparktrain.ml import TorchClassifier
    >>> clf = TorchClassifier(modelFn="sparktrain.models:mlp",
    ...                       modelKwargs={"in_features": 64, "out_features": 10},
    ...                       optimizer="adam", learningRate=0.01, maxEpochs=10,
    ...                       featuresCol="scaled")
    >>> pipeline = Pipeline(stages=[
    ...     VectorAssembler(inputCols=pixel_columns, outputCol="raw"),
    ...     StandardScaler(inputCol="raw", outputCol="scaled"),
    ...     clf])  # doctest: +SKIP
    >>> model = pipeline.fit(train)  # doctest: +SKIP
    >>> MulticlassClassificationEvaluator(metricName="accuracy").evaluate(
    ...     model.transform(test))  # doctest: +SKIP
    0.97...
    """

    _allowed_losses = CLASSIFICATION_LOSSES

    def _create_model(self) -> TorchClassificationModel:
        return TorchClassificationModel()

    def _check_targets(self, stats: Row, num_outputs: int) -> None:
        label = self.getLabelCol()
        if self.getLoss() == "bce_with_logits" and num_outputs != 1:
            raise ConfigError(
                f"loss='bce_with_logits' is binary: the model must have one output, it has "
                f"{num_outputs}; use loss='cross_entropy' for {num_outputs} classes"
            )
        if self.getLoss() == "cross_entropy" and num_outputs < 2:
            raise ConfigError(
                f"loss='cross_entropy' needs one output per class, the model has {num_outputs}; "
                "use loss='bce_with_logits' for a single logit"
            )
        classes = max(2, num_outputs)
        fix = (
            f"labels in {label!r} (labelCol) must be integral class indices 0..{classes - 1} "
            f"for the model's {classes} classes"
        )
        if stats["fractional"]:
            raise DataError(
                f"{fix}; {stats['fractional']} rows are not whole numbers (e.g. "
                f"{stats['fractional_example']}). Index labels with "
                "pyspark.ml.feature.StringIndexer"
            )
        if stats["min_label"] < 0 or stats["max_label"] > classes - 1:
            raise DataError(
                f"{fix}; found labels in [{stats['min_label']:g}, {stats['max_label']:g}]. Give "
                "the model one output per class (e.g. modelKwargs out_features) or re-index "
                "the labels with pyspark.ml.feature.StringIndexer"
            )


class TorchRegressor(
    _TorchRegressorKeywords,
    TorchEstimator[TorchRegressionModel],
    Regressor[TorchRegressionModel],
    _TorchRegressorParams,
):
    """Train a torch regressor on a Spark DataFrame, as a pyspark.ml Estimator.

    ``modelFn`` builds a module mapping ``(n, numFeatures)`` float32 features to ``(n, 1)``
    (or ``(n,)``) predictions, trained with ``loss="mse"``. The params are those of
    :class:`TorchClassifier` without the probability and raw prediction columns, plus:

    Parameters
    ----------
    labelScaling : bool
        ``True`` (default): standardise the label with the training rows' mean and
        standard deviation (one aggregation job on the driver) while training, so the
        loss starts near 1 whatever the label's units, and bring predictions back to
        label units: ``prediction = output * std + mean``. The fitted model keeps the
        two figures (``model.labelStats``, saved with it). Applies to ``loss="mse"``
        only. ``False``: train on the labels as they are.

    Examples
    --------
    >>> from pyspark.ml.evaluation import RegressionEvaluator
    >>> from sparktrain.ml import TorchRegressor
    >>> reg = TorchRegressor(modelFn="sparktrain.models:mlp",
    ...                      modelKwargs={"in_features": 10, "hidden": [32], "out_features": 1})
    >>> model = reg.fit(train)  # doctest: +SKIP
    >>> model.labelStats  # doctest: +SKIP
    (153.7..., 77.9...)
    >>> RegressionEvaluator(metricName="rmse").evaluate(model.transform(test))  # doctest: +SKIP
    """

    _allowed_losses = REGRESSION_LOSSES

    def _create_model(self) -> TorchRegressionModel:
        return TorchRegressionModel()

    def _check_targets(self, stats: Row, num_outputs: int) -> None:
        if num_outputs != 1:
            raise ConfigError(
                f"TorchRegressor needs a model with one output per row; modelFn="
                f"{self.getModelFn()!r} has {num_outputs} (e.g. set modelKwargs out_features=1)"
            )


# ---------------------------------------------------------------------- driver checks
def _check_numeric_column(
    dataset: DataFrame, column: str, param: str, missing_hint: str, type_hint: str
) -> None:
    """A schema-only check that ``column`` (the value of ``param``) exists and is numeric."""
    from pyspark.sql.types import NumericType

    if column not in dataset.columns:
        raise DataError(
            f"fit: the input has no {param.removesuffix('Col')} column {column!r} ({param}); "
            f"its columns are {dataset.columns}. {missing_hint}"
        )
    dtype = dataset.schema[column].dataType
    if not isinstance(dtype, NumericType):
        raise DataError(
            f"fit: column {column!r} ({param}) has type {dtype.simpleString()}; {type_hint}"
        )


def _check_label_column(dataset: DataFrame, label_col: str) -> None:
    _check_numeric_column(
        dataset,
        label_col,
        "labelCol",
        "Call setLabelCol(...)",
        "labels must be numeric (index string labels with pyspark.ml.feature.StringIndexer)",
    )


def _check_weight_column(dataset: DataFrame, weight_col: str) -> None:
    """A schema-only check; the values are checked in the Trainer's one weight job."""
    _check_numeric_column(
        dataset,
        weight_col,
        "weightCol",
        "Call setWeightCol(...) with a numeric column, or clear it",
        "sample weights must be numeric (cast the column to double)",
    )


def _label_aggregates() -> list[Any]:
    """Aggregates of the double label column ``y``: null/non-finite/fractional labels and
    the finite labels' range."""
    from pyspark.sql import functions as F

    y = F.col("y")
    not_finite = F.isnan(y) | (F.abs(y) == float("inf"))
    fractional = ~not_finite & (y != F.floor(y))
    return [
        F.count(F.when(y.isNull(), 1)).alias("null_labels"),
        F.count(F.when(not_finite, 1)).alias("not_finite"),
        F.count(F.when(fractional, 1)).alias("fractional"),
        F.first(F.when(fractional, y), ignorenulls=True).alias("fractional_example"),
        F.min(F.when(~not_finite, y)).alias("min_label"),
        F.max(F.when(~not_finite, y)).alias("max_label"),
    ]


def _column_stats(dataset: DataFrame, features: Any, label_col: str) -> Row:
    """One Spark job: row count, feature widths, null/non-finite/fractional labels."""
    from pyspark.sql import functions as F

    row = (
        dataset.select(
            F.size(features).alias("w"),
            features.isNull().alias("no_x"),
            F.col(label_col).cast("double").alias("y"),
        )
        .agg(
            F.count(F.lit(1)).alias("rows"),
            F.count(F.when(F.col("no_x"), 1)).alias("null_features"),
            F.min(F.when(~F.col("no_x"), F.col("w"))).alias("min_width"),
            F.max(F.when(~F.col("no_x"), F.col("w"))).alias("max_width"),
            *_label_aggregates(),
        )
        .first()
    )
    assert row is not None  # a global aggregate always has one row
    return row


def _label_stats(dataset: DataFrame, label_col: str) -> Row:
    """One Spark job over the labels alone (the typed fit: the Trainer checks the inputs)."""
    from pyspark.sql import functions as F

    row = (
        dataset.select(F.col(label_col).cast("double").alias("y"))
        .agg(F.count(F.lit(1)).alias("rows"), *_label_aggregates())
        .first()
    )
    assert row is not None  # a global aggregate always has one row
    return row


def _check_label_stats(stats: Row, label_col: str) -> None:
    """The label checks of :func:`_check_stats`, with the same messages."""
    if not stats["rows"]:
        raise DataError("fit: the training data is empty: nothing to train on")
    if stats["null_labels"] or stats["not_finite"]:
        raise DataError(
            f"fit: {stats['null_labels'] + stats['not_finite']} rows have a null, NaN or "
            f"infinite {label_col!r} (labelCol); drop them before fit"
        )


def _check_stats(stats: Row, features_col: str, label_col: str) -> int:
    """The feature width, after the checks every estimator shares."""
    if not stats["rows"]:
        raise DataError("fit: the training data is empty: nothing to train on")
    if stats["null_features"]:
        raise DataError(
            f"fit: {stats['null_features']} rows have a null {features_col!r} (featuresCol); "
            "drop or impute them before fit"
        )
    if stats["min_width"] != stats["max_width"]:
        raise DataError(
            f"fit: {features_col!r} (featuresCol) holds vectors of different sizes "
            f"({stats['min_width']}..{stats['max_width']}); every row needs the same width"
        )
    if not stats["min_width"]:
        raise DataError(f"fit: {features_col!r} (featuresCol) holds empty vectors")
    if stats["null_labels"] or stats["not_finite"]:
        raise DataError(
            f"fit: {stats['null_labels'] + stats['not_finite']} rows have a null, NaN or "
            f"infinite {label_col!r} (labelCol); drop them before fit"
        )
    return int(stats["min_width"])


def _num_outputs(module: torch.nn.Module, width: int) -> int:
    module.eval()
    try:
        with torch.no_grad():
            out = module(torch.zeros(2, width))
    except Exception as exc:
        raise DataError(
            f"the model does not accept features of width {width} ({exc}); check featuresCol "
            "or the model's input size (modelKwargs)"
        ) from exc
    return int(out[0].numel())
