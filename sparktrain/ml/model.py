"""Fitted sparktrain models: distributed batch inference and persistence.

``transform`` broadcasts the weights once (``torch.save`` bytes, read back on the
executors with ``weights_only=True``; under Spark Connect, which has no broadcasts, they
travel in the UDF's closure up to half the server's request cap, and beyond it each
Python worker fetches them from this client's payload service,
:mod:`sparktrain.driver.services.payload_server`), rebuilds the module
from ``modelFn`` once per
Python worker (kept for every later task and transform with the same weights), and runs
an iterator Arrow UDF over the features column: every Arrow batch (Spark's
``spark.sql.execution.arrow.maxRecordsPerBatch`` rows) becomes one ``(n, width)`` float32
tensor and one forward pass under ``torch.inference_mode``, on the task's GPU when the
``device`` Param allows it and Spark gave the task one (:func:`inference_device`).
There is no per-row Python. The UDF returns the model's outputs alone (``array<double>``
for a classifier, one ``double`` for a regressor); the output columns are Spark
expressions over them (:func:`_output_columns_of`): ``array_to_vector`` for
``rawPrediction``, a softmax of higher-order functions for ``probability``,
``array_position(s, array_max(s))`` for the prediction, ``s * std + mean`` for a scaled
regressor. A Python UDF runs whole whatever a query keeps of its result, but Spark prunes
expressions nobody selects: ``model.transform(df).select("prediction")`` runs the UDF
once and builds no vector (``tests/integration/test_ml_pruning.py`` checks the plans).
Every input column is kept.

A model trained on several or typed columns (``featuresCols``, ``featureShapes``...) keeps
the trained :class:`~sparktrain.data.columns.Layout`, saved in its metadata as
``inputs``. Its ``transform`` ships the same columns as one struct
(:func:`sparktrain.driver.prepare.input_columns`: the types and casts of training), turns
each Arrow batch's columns into rows as the training workers do (dense: one reshape;
variable-length and binary: per-row arrays or bytes), batches them with the layout's
:class:`~sparktrain.data.batch.Collator` (padding and masks, ``decode``, ``collate``) and
calls the model as in training (:func:`~sparktrain.data.batch.forward`). The plain layout
(one float vector column) keeps the single-reshape path above. A model saved before
layouts were kept loads as the plain layout of its ``numFeatures``.

A regressor trained with ``labelScaling`` (the default) learned standardised labels: it
keeps the module ``modelFn`` builds with its trained weights, plus the labels' ``(mean,
std)`` (:attr:`TorchModel.labelStats`, saved in the metadata as ``labelScaling``), and
``transform`` predicts ``output * std + mean`` in float64. A model without the figures
(``labelScaling=False``, or saved before label scaling) predicts its output as it is.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from pyspark.ml.base import PredictionModel
from pyspark.ml.classification import ProbabilisticClassificationModel
from pyspark.ml.linalg import DenseVector, Vector
from pyspark.ml.regression import RegressionModel
from pyspark.ml.util import MLReadable, MLWritable
from torch import nn

from sparktrain.builders import LabelScaled, build_model, import_callable
from sparktrain.config import parse_port_range
from sparktrain.data.batch import Collator, forward
from sparktrain.data.columns import BINARY, DENSE, RAGGED, Layout, parse_columns
from sparktrain.data.columns import Column as InputColumn
from sparktrain.driver.services.payload_server import discard_shared, fits_in_closure, serve_shared
from sparktrain.driver.spark_env import CONNECT_MAX_MESSAGE, spark_env
from sparktrain.errors import ConfigError, DataError, not_a_spark_frame
from sparktrain.ml.params import (
    ML_DEFAULTS,
    _TorchClassifierParams,
    _TorchParams,
    _TorchRegressorParams,
)
from sparktrain.ml.persistence import TorchModelReader, TorchModelWriter
from sparktrain.result import state_from_bytes
from sparktrain.task.payload_client import ServedBytes

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from sparktrain.driver.spark_env import SparkEnv

__all__ = ["TorchClassificationModel", "TorchModel", "TorchRegressionModel"]

log = logging.getLogger(__name__)

_OUT = "__sparktrain_scores"
_PROBABILITY = "__sparktrain_probability"


class TorchModel(PredictionModel[Vector], _TorchParams, MLWritable, MLReadable["TorchModel"]):
    """Base of the fitted sparktrain models (see :class:`TorchClassificationModel` and
    :class:`TorchRegressionModel`). Holds the trained weights and the params it was
    trained with; ``transform`` adds the prediction columns and keeps every input column.
    A pyspark.ml ``PredictionModel``: :meth:`predict` scores one ml Vector on the driver.
    """

    _kind = "regression"

    def __init__(self) -> None:
        super().__init__()
        self._state_bytes = b""
        self._num_features = 0
        self._num_outputs = 1
        self._token = uuid.uuid4().hex
        self._summary: dict[str, Any] | None = None
        self._layout: Layout | None = None
        self._label_stats: tuple[float, float] | None = None
        # weights on this process's payload service (Spark Connect, large models):
        # (what they were shipped for, the reference), reused by later transforms
        self._served: tuple[str, ServedBytes] | None = None
        # (key, module) of the module predict() scores with on the driver
        self._driver_module: tuple[str, nn.Module] | None = None

    def copy(self, extra: Any = None) -> Self:
        """A copy with the same weights (pyspark.ml's ``copy``); it ships its weights
        to a payload service on its own, so each copy's lifetime governs its own."""
        that = super().copy(extra)
        that._served = None
        return that

    # ------------------------------------------------------------------ state
    def _set_state(
        self,
        state_bytes: bytes,
        *,
        num_features: int,
        num_outputs: int | None,
        summary: dict[str, Any] | None = None,
        layout: Layout | None = None,
        label_stats: tuple[float, float] | None = None,
    ) -> Self:
        """``layout=None``: the plain layout of ``num_features`` (one float vector).
        ``label_stats``: the ``(mean, std)`` a regressor's labels were standardised with
        (``labelScaling``); its predictions are ``output * std + mean``. ``None``: the
        outputs are the predictions."""
        self._state_bytes = state_bytes
        self._num_features = int(num_features)
        self._num_outputs = int(num_outputs) if num_outputs else 1
        self._token = uuid.uuid4().hex
        self._summary = summary
        self._layout = layout
        self._label_stats = _checked_label_stats(label_stats)
        return self

    def _num_outputs_meta(self) -> int | None:
        """numClasses in the saved metadata (None for regressors)."""
        return None

    def _label_stats_meta(self) -> dict[str, float] | None:
        """labelScaling in the saved metadata: ``{"mean": ..., "std": ...}``, or None when
        the model's outputs are its predictions."""
        if self._label_stats is None:
            return None
        mean, std = self._label_stats
        return {"mean": mean, "std": std}

    def _check_state(self, state: dict[str, torch.Tensor]) -> None:
        """Does ``modelFn(**modelKwargs)`` build a module that takes these weights?"""
        module = self._build_module()
        try:
            module.load_state_dict(state)
        except RuntimeError as exc:
            raise ConfigError(
                f"modelFn={self.getModelFn()!r} with modelKwargs={self.getModelKwargs()} builds "
                f"a module that does not fit the saved weights ({exc}); use the factory and "
                "arguments the model was trained with"
            ) from exc

    def _build_module(self) -> nn.Module:
        return build_module(self.getModelFn(), self.getModelKwargsDict())

    @property
    def numFeatures(self) -> int:
        """Width of the feature vectors the model was trained on; for several or typed
        inputs the values a row holds over all of them when each has a fixed size, else
        -1 (see :attr:`layout`)."""
        return self._num_features

    @property
    def layout(self) -> Layout:
        """The model's input columns as trained: which columns, as what, and how the
        model is called (the run summary's ``inputs``, saved with the model)."""
        return self._layout or Layout.plain(self._num_features)

    @property
    def hasSummary(self) -> bool:
        """Whether the training summary is available (it is not after ``load``)."""
        return self._summary is not None

    @property
    def summary(self) -> dict[str, Any]:
        """The Trainer's summary of the run that fitted this model (history, strategy,
        bytes sent, final metric...; see docs/summary.md for the keys)."""
        if self._summary is None:
            raise RuntimeError(
                f"no training summary is available for this {type(self).__name__} "
                "(summaries are not saved; it exists only on a freshly fitted model)"
            )
        return self._summary

    @property
    def labelStats(self) -> tuple[float, float] | None:
        """``(mean, std)`` the labels were standardised with in training
        (``labelScaling``): predictions are the model's output ``* std + mean``. ``None``
        when the output is the prediction (classifiers, ``labelScaling=False``, models
        saved before label scaling)."""
        return self._label_stats

    def getModule(self) -> nn.Module:
        """A fresh ``torch.nn.Module`` on the driver with the trained weights, in eval mode;
        its outputs are what ``transform`` predicts from. A regressor trained with
        ``labelScaling`` returns a :class:`sparktrain.builders.LabelScaled` (outputs in
        label units), whose ``inner`` is the module ``modelFn`` builds."""
        module = self._build_module()
        module.load_state_dict(state_from_bytes(self._state_bytes))
        if self._label_stats is not None:
            module = LabelScaled(module, *self._label_stats)
        return module.eval()

    # ------------------------------------------------------------------ one row
    def predict(self, value: Vector) -> float:
        """The prediction for one ml Vector of features, on the driver (MLlib's
        ``PredictionModel.predict``): what ``transform`` puts in the prediction column for a
        row with these features (the same float32 features and code; a regressor's in
        label units)."""
        return float(self._one_row(value, ("prediction",))["prediction"])

    def _one_row(self, value: Vector, fields: tuple[str, ...]) -> dict[str, Any]:
        """``fields`` of the output struct for one row of features, scored on the driver
        through :meth:`_InferencePlan.predict`: the forward pass of one Arrow batch of
        ``transform``, the columns computed in torch (``transform`` computes them as Spark
        expressions, :func:`_output_columns_of`, by the same formulas)."""
        name = type(self).__name__
        if not self.layout.is_plain:
            raise ConfigError(
                f"{name}.predict takes one ml Vector of features, but the "
                f"{self.layout.describe()}; score such a model with transform"
            )
        if not self._state_bytes:
            raise ConfigError(f"this {name} holds no weights: fit or load one")
        values = value.toArray() if isinstance(value, Vector) else np.asarray(value, np.float64)
        if values.ndim != 1:
            raise DataError(f"{name}.predict takes one row of features, got shape {values.shape}")
        flat = pa.array(np.asarray(values, np.float32))
        features = pa.ListArray.from_arrays(pa.array([0, len(flat)], pa.int32()), flat)
        plan = _InferencePlan(
            token=self._token,
            weights=InlineWeights(b""),  # unused: the driver's module is built below
            model_fn=self.getModelFn(),
            model_kwargs=self.getModelKwargsDict(),
            num_features=self._num_features,
            kind=self._kind,
            threads=1,
            fields=fields,
            label_stats=self._label_stats,
            thresholds=self._thresholds(),
        )
        with torch.inference_mode():
            out = plan.predict(self._scoring_module(), features)
        return {field: out.field(field)[0].as_py() for field in fields}

    def _scoring_module(self) -> nn.Module:
        """The module ``modelFn`` builds with the trained weights, in eval mode, built once
        per weights, ``modelFn`` and ``modelKwargs`` (:meth:`predict` runs per row)."""
        kwargs = json.dumps(self.getModelKwargsDict(), sort_keys=True)
        key = f"{self._token}|{self.getModelFn()}|{kwargs}"
        if self._driver_module is None or self._driver_module[0] != key:
            module = self._build_module()
            module.load_state_dict(state_from_bytes(self._state_bytes))
            self._driver_module = (key, module.eval())
        return self._driver_module[1]

    def _thresholds(self) -> tuple[float, ...] | None:
        """The classifier's ``thresholds`` when set (checked), else None."""
        return None

    def _output_metadata(self) -> dict[str, dict[str, Any]]:
        """Column metadata by output field, as MLlib writes it (a classifier's)."""
        return {}

    # ------------------------------------------------------------------ setters
    def setFeaturesCol(self, value: str) -> Self:
        """Sets the value of :py:attr:`featuresCol`."""
        return self._set(featuresCol=value)

    def setFeaturesCols(self, value: list[str] | dict[str, str]) -> Self:
        """Sets the value of :py:attr:`featuresCols` (the columns ``transform`` reads,
        in the form the model was trained with; set and non-empty, it overrides
        ``featuresCol``)."""
        return self._set(featuresCols=value)

    def setPredictionCol(self, value: str) -> Self:
        """Sets the value of :py:attr:`predictionCol`."""
        return self._set(predictionCol=value)

    def setDriverServicesHost(self, value: str) -> Self:
        """Sets the value of :py:attr:`driverServicesHost`: under Spark Connect, where
        ``transform`` serves weights too large for the plan (an address of this client
        the executors reach)."""
        return self._set(driverServicesHost=value)

    def setDriverServicesPorts(self, value: str) -> Self:
        """Sets the value of :py:attr:`driverServicesPorts` (``"LOW-HIGH"``)."""
        return self._set(driverServicesPorts=value)

    # ------------------------------------------------------------------ transform
    def _output_columns(self) -> list[tuple[str, str]]:
        """(param value, struct field) for every output column that is switched on."""
        return [(self.getPredictionCol(), "prediction")] if self.getPredictionCol() else []

    def _transform(self, dataset: DataFrame) -> DataFrame:
        require_spark_frame(dataset, "transform's dataset")
        from pyspark.sql import functions as F
        from pyspark.sql.functions import arrow_udf

        layout = self.layout
        sources = self._input_sources(layout)
        features: Column
        typed: Layout | None = None
        if layout.is_plain:
            features = _features_as_float_array(dataset, sources[0], "transform")
        else:
            features, typed = self._typed_input(dataset, layout, sources)
        outputs = self._output_columns()
        if not outputs:
            return dataset
        for name, _ in outputs:
            if name in dataset.columns:
                raise DataError(
                    f"output column {name!r} already exists in the input; rename it or set "
                    "another output column name on the model"
                )
        if not self._state_bytes:
            raise ConfigError(f"this {type(self).__name__} holds no weights: fit or load one")
        env = spark_env(dataset.sparkSession)
        plan = _InferencePlan(
            token=self._token,
            weights=self._shipped_weights(env),
            model_fn=self.getModelFn(),
            model_kwargs=self.getModelKwargsDict(),
            num_features=self._num_features,
            kind=self._kind,
            threads=env.task_cpus(),
            fields=tuple(field for _, field in outputs),
            device=self.getDevice(),
            layout=typed,
            label_stats=self._label_stats,
            thresholds=self._thresholds(),
            classes=self._num_outputs if self._kind == "classification" else None,
        )
        udf = arrow_udf(plan.run, plan.scores_type())  # type: ignore[call-overload]
        # the UDF emits the model's outputs only; each output column is an expression
        # over them, so the optimizer drops the columns a query does not select (a
        # Python UDF's result is computed whole, whatever the query keeps of it)
        scored = dataset.withColumn(_OUT, udf(features))
        wanted = {field for _, field in outputs}
        thresholds = plan.thresholds
        scores = F.col(_OUT)
        probability: Column | None = None
        if self._kind == "classification" and (
            "probability" in wanted or ("prediction" in wanted and thresholds is not None)
        ):
            # its own column: used twice (probability and a thresholded prediction) it
            # is computed once per row, used once Spark inlines it
            scored = scored.withColumn(_PROBABILITY, _probability(scores, plan.classes))
            probability = F.col(_PROBABILITY)
        exprs = _output_columns_of(
            scores,
            self._kind,
            probability,
            outputs=plan.classes,
            thresholds=thresholds,
            label_stats=self._label_stats,
        )
        result = scored.withColumns({name: exprs[field] for name, field in outputs}).drop(
            _OUT, _PROBABILITY
        )
        metadata = self._output_metadata()
        for name, field in outputs:
            if field in metadata:
                result = result.withMetadata(name, metadata[field])
        return result

    def _shipped_weights(self, env: SparkEnv) -> Any:
        """:func:`ship_weights` of this model's weights. Weights put on a payload service
        stay there while this model lives (a transformed DataFrame may be evaluated any
        time later) and serve every later transform with the same weights and address."""
        host = self.getDriverServicesHost()
        ports = parse_port_range(self.getDriverServicesPorts())
        key = f"{self._token}|{host}|{ports}"
        if self._served is not None and self._served[0] == key:
            return self._served[1]
        shipped = ship_weights(env, self._state_bytes, host=host, ports=ports)
        if isinstance(shipped, ServedBytes):
            if self._served is not None:  # other weights or another address: drop them
                unship_weights(self._served[1])
            self._served = (key, shipped)
            weakref.finalize(self, unship_weights, shipped)
        return shipped

    def _input_sources(self, layout: Layout) -> list[str]:
        """The columns ``transform`` reads, one per trained input column in the layout's
        order: ``featuresCols`` (set and non-empty) or else ``featuresCol``, which must
        name the inputs the way the model was trained (one column, a list of the same
        length, or the same model arguments)."""
        spec, param = self._features_spec()
        call, pairs = parse_columns(spec, param)
        keys = layout.keys
        if layout.call == "keyword":
            given = dict(pairs)
            if call == "keyword" and set(given) == set(keys):
                return [given[k] for k in keys]
            wanted = [f"{c.key}={c.source}" for c in layout.columns]
        else:
            if call != "keyword" and len(pairs) == len(keys):
                return [source for _, source in pairs]
            wanted = [c.source for c in layout.columns]
        if layout.call == "single":
            fix = f"set featuresCol to the column that feeds it (trained on {wanted[0]!r})"
            if param == "featuresCols":
                fix = f"clear featuresCols (set it to []) and {fix}"
        else:
            fix = f"set featuresCols like the training's: {wanted}"
        raise ConfigError(
            f"{param}={spec!r} does not name this model's inputs; the {layout.describe()}: {fix}"
        )

    def _typed_input(
        self, dataset: DataFrame, layout: Layout, sources: list[str]
    ) -> tuple[Column, Layout]:
        """(a struct of the input columns as the trained layout ships them, that layout
        with the wire names the struct's fields carry)."""
        import dataclasses

        from pyspark.sql import functions as F

        from sparktrain.driver.prepare import input_columns

        param = "featuresCols" if self.getFeaturesCols() else "featuresCol"
        for source in sources:
            if source not in dataset.columns:
                raise DataError(
                    f"transform: the input has no column {source!r} ({param}); its columns "
                    f"are {dataset.columns}. The {layout.describe()}"
                )
        # input_columns reads the columns a layout names; a list or a single column is
        # keyed by its column name, so the renamed columns take that name as their key
        renamed = tuple(
            dataclasses.replace(c, source=source, key=c.key if layout.call == "keyword" else source)
            for c, source in zip(layout.columns, sources, strict=True)
        )
        shipped = dataclasses.replace(layout, columns=renamed)
        return F.struct(*input_columns(dataset, shipped)), layout

    # ------------------------------------------------------------------ persistence
    def write(self) -> TorchModelWriter:
        """An MLWriter that saves the params as MLlib metadata and the weights as a
        ``torch.save`` state_dict (read back with ``weights_only=True``)."""
        return TorchModelWriter(self)

    @classmethod
    def read(cls) -> TorchModelReader[Self]:
        """An MLReader for this class."""
        return TorchModelReader(cls)

    @classmethod
    def load(cls, path: str, model_fn: str | None = None) -> Self:
        """Load a model saved with :meth:`save` (weights read with ``weights_only=True``;
        the module is rebuilt from ``modelFn`` and ``modelKwargs``).

        Every function the metadata names (``modelFn``, and the ``decode`` / ``collate``
        hooks of the params and of the saved input layout, which ``transform`` runs on
        the executors) must be in an allowed module
        (:func:`sparktrain.ml.allow_model_modules`, default ``sparktrain.models``),
        checked before anything is imported; the weights file must lie inside ``path``.
        ``model_fn="package.module:function"`` replaces the saved ``modelFn`` with a
        factory of your choice, which is not checked.
        """
        return TorchModelReader(cls, model_fn=model_fn).load(path)


class TorchClassificationModel(
    TorchModel, ProbabilisticClassificationModel, _TorchClassifierParams
):
    """A classifier fitted by :class:`~sparktrain.ml.TorchClassifier`.

    ``transform`` adds ``rawPrediction`` (the model's logits as an ml Vector; for a
    single-logit binary model ``[-z, z]``, as MLlib's LogisticRegression does),
    ``probability`` (softmax, or ``[1 - sigmoid(z), sigmoid(z)]``) and ``prediction``
    (the most probable class index, as a double; with ``thresholds``, the class with the
    largest ``probability / threshold``, as MLlib's): Spark expressions over the model's
    outputs, so a query computes only the columns it selects. Set any of the three
    column params to ``""`` to leave that column out. The prediction column is NOT NULL
    and carries MLlib's nominal attribute (``{"ml_attr": {"num_vals": numClasses,
    "type": "nominal"}}``), which ``IndexToString`` reads; the vectors carry
    ``{"ml_attr": {"num_attrs": numClasses}}``, as MLlib's. A pyspark.ml
    ``ProbabilisticClassificationModel``: :meth:`predict`, :meth:`predictRaw` and
    :meth:`predictProbability` score one ml Vector on the driver.

    Examples
    --------
    >>> model = TorchClassifier(modelFn="sparktrain.models:digits_mlp").fit(train)  # doctest: +SKIP
    >>> model.numClasses  # doctest: +SKIP
    10
    >>> model.transform(test).select("prediction", "probability").show(3)  # doctest: +SKIP
    >>> model.save("/tmp/digits-model")  # doctest: +SKIP
    >>> TorchClassificationModel.load("/tmp/digits-model")  # doctest: +SKIP
    """

    _kind = "classification"

    @property
    def numClasses(self) -> int:
        """Number of classes (2 for a single-logit binary model)."""
        return max(2, self._num_outputs)

    def _num_outputs_meta(self) -> int | None:
        return self._num_outputs

    def setProbabilityCol(self, value: str) -> Self:
        """Sets the value of :py:attr:`probabilityCol`."""
        return self._set(probabilityCol=value)

    def setRawPredictionCol(self, value: str) -> Self:
        """Sets the value of :py:attr:`rawPredictionCol`."""
        return self._set(rawPredictionCol=value)

    def setThresholds(self, value: list[float]) -> Self:
        """Sets the value of :py:attr:`thresholds`: one per class, >= 0, at most one 0;
        the prediction is the class with the largest ``probability / threshold``."""
        return self._set(thresholds=value)

    def predictRaw(self, value: Vector) -> DenseVector:
        """The raw prediction (logits; ``[-z, z]`` for a single logit) for one ml Vector of
        features, on the driver: ``transform``'s ``rawPrediction`` for such a row."""
        return DenseVector(self._one_row(value, ("rawPrediction",))["rawPrediction"])

    def predictProbability(self, value: Vector) -> DenseVector:
        """The class probabilities for one ml Vector of features, on the driver:
        ``transform``'s ``probability`` for such a row."""
        return DenseVector(self._one_row(value, ("probability",))["probability"])

    def _thresholds(self) -> tuple[float, ...] | None:
        if not self.isDefined(self.thresholds):
            return None
        thresholds = tuple(float(t) for t in self.getThresholds())
        k = self.numClasses
        if len(thresholds) != k or any(not t >= 0 for t in thresholds) or thresholds.count(0) > 1:
            raise ConfigError(
                f"thresholds={list(thresholds)} must hold one value >= 0 per class ({k} "
                "for this model), at most one of them 0; or clear it (model.clear("
                "model.thresholds)) to predict the most probable class"
            )
        return thresholds

    def _output_metadata(self) -> dict[str, dict[str, Any]]:
        # what MLlib's classification models write: a NominalAttribute with numValues on
        # the prediction, an AttributeGroup of numClasses on the vectors
        k = self.numClasses
        group = {"ml_attr": {"num_attrs": k}}
        return {
            "prediction": {"ml_attr": {"num_vals": k, "type": "nominal"}},
            "rawPrediction": group,
            "probability": group,
        }

    def _output_columns(self) -> list[tuple[str, str]]:
        wanted = [
            (self.getRawPredictionCol(), "rawPrediction"),
            (self.getProbabilityCol(), "probability"),
            (self.getPredictionCol(), "prediction"),
        ]
        return [(name, field) for name, field in wanted if name]


class TorchRegressionModel(TorchModel, RegressionModel[Vector], _TorchRegressorParams):
    """A regressor fitted by :class:`~sparktrain.ml.TorchRegressor`: ``transform`` adds
    ``prediction`` (double): the model's single output, brought back to label units
    (``output * std + mean``) when it was trained with ``labelScaling``
    (:attr:`labelStats`), in a NOT NULL column. A pyspark.ml ``RegressionModel``:
    :meth:`predict` scores one ml Vector on the driver, in label units too.

    Examples
    --------
    >>> reg = TorchRegressor(modelFn="sparktrain.models:mlp",
    ...                      modelKwargs={"in_features": 10, "out_features": 1})
    >>> model = reg.fit(df)  # doctest: +SKIP
    >>> model.transform(df).select("label", "prediction").show(3)  # doctest: +SKIP
    """

    _kind = "regression"


# ---------------------------------------------------------------------- inference
def build_module(model_fn: str, model_kwargs: dict[str, Any]) -> nn.Module:
    """``modelFn(**modelKwargs)``, with import errors that name the ``modelFn`` param."""
    fn = import_callable(model_fn, what="modelFn")
    return build_model(lambda: fn(**model_kwargs))


_SCORES = pa.list_(pa.float64())


def _features_as_float_array(dataset: DataFrame, col: str, what: str) -> Column:
    """The features column as ``array<float>`` (ml Vectors, dense or sparse, or arrays of
    numbers), computed in the JVM; a clear error for anything else."""
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, NumericType

    if col not in dataset.columns:
        raise DataError(
            f"{what}: the input has no features column {col!r} (featuresCol); its columns "
            f"are {dataset.columns}. Assemble one with pyspark.ml.feature.VectorAssembler or "
            "call setFeaturesCol(...)"
        )
    ftype = dataset.schema[col].dataType
    if isinstance(ftype, VectorUDT):
        return vector_to_array(F.col(col), "float32")
    if isinstance(ftype, ArrayType) and isinstance(ftype.elementType, NumericType):
        return F.col(col).cast("array<float>")
    raise DataError(
        f"{what}: column {col!r} (featuresCol) has type {ftype.simpleString()}; features must "
        "be an ml Vector (e.g. from VectorAssembler) or an array of numbers"
    )


# A Python worker runs one task at a time but is reused across tasks (and transforms):
# keep the last few rebuilt modules, keyed by the model's token.
_MODULES: OrderedDict[str, nn.Module] = OrderedDict()
_MODULES_LOCK = threading.Lock()
_MODULES_KEPT = 4


@dataclass(frozen=True)
class InlineWeights:
    """Weights that travel inside the UDF's closure (what a Spark Connect session ships
    instead of a broadcast); ``value`` as on a broadcast."""

    value: bytes


TRANSFORM_REMEDY = (
    "Set driverServicesHost (and driverServicesPorts, to open them in a firewall) on the "
    "model to an address of this client the executors can reach, raise "
    "spark.connect.grpc.maxInboundMessageSize on the Connect server to more than twice "
    "the weights' size (they then travel in the plan), or transform from a classic session"
)


def ship_weights(
    env: SparkEnv,
    blob: bytes,
    *,
    host: str = "",
    ports: tuple[int, int] | None = None,
) -> Any:
    """How ``transform``'s tasks get the weights: a broadcast in a classic session; under
    Spark Connect in the closure while at most half the server's request cap
    (``spark.connect.grpc.maxInboundMessageSize``, :func:`fits_in_closure`), else from
    this process's payload service (:func:`serve_shared` on ``host``, default the
    address the driver services use, within ``ports``): a
    :class:`~sparktrain.task.payload_client.ServedBytes` whose ``value`` each Python worker
    fetches once. The service keeps the weights until :func:`unship_weights`."""
    if not env.connect:
        return env.spark_context("transform").broadcast(blob)
    cap = env.max_request_bytes() or CONNECT_MAX_MESSAGE
    if fits_in_closure(len(blob), cap):
        return InlineWeights(blob)
    from sparktrain.driver.resources import spark_wire_encryption

    where = host or env.driver_host()
    # Spark encrypts its own wire: the weights must not leave this process in plaintext
    served = serve_shared(
        blob,
        host=where,
        ports=ports,
        tls=bool(spark_wire_encryption(env)),
        what="the model's weights for transform",
        timeout=ML_DEFAULTS.comm_timeout,
        remedy=TRANSFORM_REMEDY,
    )
    log.info(
        "Spark Connect: the weights (%.1f MiB) are over half the server's request cap "
        "(spark.connect.grpc.maxInboundMessageSize: %.0f MiB); transform's tasks fetch them "
        "from this client's payload service on %s",
        len(blob) / 2**20,
        cap / 2**20,
        served.address,
    )
    return served


def unship_weights(shipped: Any) -> None:
    """Stop serving weights :func:`ship_weights` put on a payload service (nothing for a
    broadcast or closure weights)."""
    if isinstance(shipped, ServedBytes):
        discard_shared(shipped)


@dataclass
class _InferencePlan:
    """What each inference task needs; picklable (the weights travel in a broadcast, or
    under Spark Connect in the plan itself or, when large, as a reference to this
    process's payload service)."""

    token: str
    weights: Any  # pyspark Broadcast[bytes], InlineWeights or ServedBytes: .value is the bytes
    model_fn: str
    model_kwargs: dict[str, Any]
    num_features: int
    kind: str
    threads: int
    fields: tuple[str, ...]
    layout: Layout | None = None
    """``None``: the plain layout (one float vector, :meth:`predict`); else the trained
    layout, whose columns arrive as the fields of one struct (:meth:`predict_typed`)."""
    label_stats: tuple[float, float] | None = None
    """A regressor's ``(mean, std)`` (``labelScaling``): prediction = output * std + mean,
    in float64; ``None``: the output is the prediction."""
    thresholds: tuple[float, ...] | None = None
    """A classifier's ``thresholds`` (one per class): the prediction is the class with
    the largest ``probability / threshold`` (a 0 threshold: infinity), as MLlib's;
    ``None``: the most probable class."""
    device: str = "cpu"
    """The model's ``device`` Param: ``"cuda"`` or ``"auto"`` score on the task's GPU when
    Spark gave it one and CUDA works (:func:`inference_device`), else on the CPU."""
    classes: int | None = None
    """A classifier's outputs per row, as fitted: the output columns' expressions read
    that many (:func:`_output_columns_of`), so :meth:`scores` refuses a model that returns
    another number; ``None``: not checked."""

    def module(self, device: torch.device | None = None) -> nn.Module:
        """The module with the trained weights on ``device`` (default the CPU), built once
        per Python worker: a worker runs task after task, and rebuilding (import,
        ``load_state_dict`` of the decoded weights) for each would cost every task."""
        device = device or torch.device("cpu")
        # copies of a model share weights (and token) but may differ in modelFn/modelKwargs
        key = (
            f"{self.token}|{self.model_fn}|{json.dumps(self.model_kwargs, sort_keys=True)}|{device}"
        )
        with _MODULES_LOCK:
            cached = _MODULES.get(key)
            if cached is not None:
                _MODULES.move_to_end(key)
                return cached
        module = build_module(self.model_fn, self.model_kwargs)
        module.load_state_dict(state_from_bytes(self.weights.value))
        module.eval().to(device)
        with _MODULES_LOCK:
            _MODULES[key] = module
            while len(_MODULES) > _MODULES_KEPT:
                _MODULES.popitem(last=False)
        return module

    def run(self, batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        """The Arrow UDF body: one forward pass per Arrow batch, the batch's
        :meth:`scores` out (the output columns are Spark expressions over them)."""
        # torch's default is one thread per core in every Python worker: with one worker
        # per task slot they would oversubscribe the cores the tasks were given
        torch.set_num_threads(max(1, self.threads))
        device = inference_device(self.device)
        module = self.module(device)
        # inference_mode: no autograd bookkeeping at all (no version counters either)
        if self.layout is not None:
            collator = Collator(self.layout)
            with torch.inference_mode():
                for inputs in batches:
                    yield self.scores(self.forward_typed(module, collator, inputs, device))
            return
        with torch.inference_mode():
            for features in batches:
                yield self.scores(self.forward(module, features, device))

    def scores_type(self) -> str:
        """The UDF's return type: a classifier's outputs per row, or a regressor's one."""
        return "double" if self.kind == "regression" else "array<double>"

    def scores(self, out: torch.Tensor | None) -> pa.Array:
        """One batch's model outputs as the UDF returns them (:meth:`scores_type`), in
        float64 (exact for any model dtype, and the rawPrediction column's type): a
        regressor's first output (label scaling is the prediction column's expression),
        a classifier's outputs per row (``None``: an empty batch)."""
        if out is None:
            return pa.array([], pa.float64() if self.kind == "regression" else _SCORES)
        out = out.detach().cpu()
        out = out.flatten(1) if out.ndim > 1 else out.unsqueeze(1)
        if self.kind == "regression":
            return pa.array(out[:, 0].double().numpy())
        if self.classes is not None and out.shape[1] != self.classes:
            raise DataError(
                f"the model {self.model_fn!r} returns {out.shape[1]} outputs per row, this "
                f"classifier was fitted with {self.classes}: score with the model function "
                "and modelKwargs it was fitted with"
            )
        return _list_array(out.double().numpy())

    def predict(
        self, module: nn.Module, features: pa.Array, device: torch.device | None = None
    ) -> pa.Array:
        """The output struct of one Arrow batch of ``array<float>`` feature rows
        (:meth:`forward`, then :meth:`outputs`): what ``predict`` on the driver reads."""
        return self.outputs(self.forward(module, features, device))

    def forward(
        self, module: nn.Module, features: pa.Array, device: torch.device | None = None
    ) -> torch.Tensor:
        """One Arrow batch of ``array<float>`` feature rows: one ``(n, width)`` tensor,
        one forward pass on ``device`` (default the CPU), the model's outputs."""
        n = len(features)
        width = self.num_features
        if features.null_count:
            raise DataError(
                f"{features.null_count} rows have a null features value; drop or impute them "
                "before transform"
            )
        values = features.flatten().to_numpy(zero_copy_only=False)
        if values.size != n * width:
            raise DataError(
                f"a features row does not have the {width} values the model was trained on; "
                "every row must have the same width as in training"
            )
        x = torch.from_numpy(np.array(values, dtype=np.float32).reshape(n, width))  # writable
        if device is not None and device.type != "cpu":
            x = x.to(device, non_blocking=True)
        out: torch.Tensor = module(x)
        return out

    def predict_typed(
        self,
        module: nn.Module,
        collator: Collator,
        inputs: pa.Array,
        device: torch.device | None = None,
    ) -> pa.Array:
        """The output struct of one Arrow batch of the struct of input columns
        (:meth:`forward_typed`, then :meth:`outputs`)."""
        return self.outputs(self.forward_typed(module, collator, inputs, device))

    def forward_typed(
        self,
        module: nn.Module,
        collator: Collator,
        inputs: pa.Array,
        device: torch.device | None = None,
    ) -> torch.Tensor | None:
        """One Arrow batch of the struct of input columns: rows as the training workers
        read them, one :class:`~sparktrain.data.batch.Batch`, one forward pass; the
        model's outputs (``None`` for an empty batch)."""
        layout = collator.layout
        n = len(inputs)
        if not n:
            return None
        children = inputs.flatten()
        columns = [_rows(c, values, n) for c, values in zip(layout.columns, children, strict=True)]
        batch = collator.batch(columns, None, None, partition=-1)
        if device is not None and device.type != "cpu":
            batch = batch.to(device)
        out = forward(module, batch)
        if not isinstance(out, torch.Tensor):
            raise DataError(
                f"the model returned {type(out).__name__}; transform needs one output tensor "
                "of shape (batch, outputs)"
            )
        return out

    def outputs(self, out: torch.Tensor | None) -> pa.Array:
        """The output struct of one batch's model outputs (``None``: an empty batch),
        computed in torch: what :meth:`TorchModel.predict` and its kin return for one
        row. ``transform`` computes the same columns as Spark expressions
        (:func:`_output_columns_of`); the two agree to float64 rounding."""
        if out is None:
            empty = {
                "prediction": pa.array([], pa.float64()),
                "rawPrediction": pa.array([], pa.list_(pa.float64())),
                "probability": pa.array([], pa.list_(pa.float64())),
            }
            return pa.StructArray.from_arrays(
                [empty[f] for f in self.fields], names=list(self.fields)
            )
        out = out.detach().cpu()
        out = out.flatten(1) if out.ndim > 1 else out.unsqueeze(1)
        columns: dict[str, pa.Array] = {}
        if self.kind == "regression":
            prediction = out[:, 0].double()
            if self.label_stats is not None:
                mean, std = self.label_stats
                prediction = prediction * std + mean
            columns["prediction"] = pa.array(prediction.numpy())
        elif (
            self.thresholds is None
            and "probability" not in self.fields
            and "rawPrediction" not in self.fields
        ):
            columns["prediction"] = pa.array(_classes(out).numpy())
        else:
            logits = out.double()
            if logits.shape[1] == 1:  # one logit: binary, as MLlib's LogisticRegression
                z = logits[:, 0]
                raw = torch.stack([-z, z], dim=1)
                p1 = torch.sigmoid(z)
                prob = torch.stack([1 - p1, p1], dim=1)
            else:
                raw = logits
                prob = torch.softmax(logits, dim=1)
            columns["rawPrediction"] = _list_array(raw.numpy())
            columns["probability"] = _list_array(prob.numpy())
            columns["prediction"] = pa.array(_predicted(prob, self.thresholds).numpy())
        return pa.StructArray.from_arrays(
            [columns[f] for f in self.fields], names=list(self.fields)
        )


def _predicted(prob: torch.Tensor, thresholds: tuple[float, ...] | None) -> torch.Tensor:
    """The predicted class of each row of ``(n, k)`` probabilities as float64: the most
    probable, or with ``thresholds`` the largest ``p / t`` (infinity where ``t`` is 0),
    the first on a tie, as MLlib's ``ProbabilisticClassificationModel``."""
    if thresholds is None:
        return prob.argmax(dim=1).double()
    t = torch.tensor(thresholds, dtype=prob.dtype)
    scaled = torch.where(t == 0, torch.full_like(prob, float("inf")), prob / t)
    return scaled.argmax(dim=1).double()


def _classes(out: torch.Tensor) -> torch.Tensor:
    """The predicted class of each row of ``(n, k)`` model outputs as float64, without
    the probabilities (for a transform whose probability and rawPrediction columns are
    switched off). The same classes as ``argmax`` of the probabilities: softmax is
    monotonic, so its argmax is the logits' (the first on a tie, as there); a single
    logit ``z`` is class 1 where ``sigmoid(z) > 1 - sigmoid(z)``, computed the same way
    in float64 so that rounding ties fall as they do there."""
    logits = out.double()
    if logits.shape[1] == 1:
        p1 = torch.sigmoid(logits[:, 0])
        return (p1 > 1 - p1).double()
    return logits.argmax(dim=1).double()


# ---------------------------------------------------------------------- output columns
def _output_columns_of(
    scores: Column,
    kind: str,
    probability: Column | None = None,
    *,
    outputs: int | None = None,
    thresholds: tuple[float, ...] | None = None,
    label_stats: tuple[float, float] | None = None,
) -> dict[str, Column]:
    """The output columns by field, as Spark expressions over the UDF's ``scores``
    (:meth:`_InferencePlan.scores`): the values :meth:`_InferencePlan.outputs` computes in
    torch, to float64 rounding (the prediction exactly, but for rows with NaN outputs).
    ``probability``: a column that holds :func:`_probability` of the scores (default that
    expression itself). ``outputs``: a classifier's outputs per row, when the UDF
    guarantees it (the expressions then read each output by position); ``None``: any
    number. Spark evaluates only the expressions a query selects.

    The classifier's columns: ``rawPrediction`` the outputs (``[-z, z]`` for a single
    logit ``z``), ``probability`` their softmax (``[1 - sigmoid(z), sigmoid(z)]``), and
    ``prediction`` the first largest output (a single logit: ``sigmoid(z) > 1 -
    sigmoid(z)``, as the probabilities' argmax), or with ``thresholds`` the first largest
    ``probability / threshold`` (infinity for a 0 threshold), as MLlib's. A regressor's
    ``prediction`` is its output, ``* std + mean`` with ``label_stats``."""
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    nan = F.lit(float("nan"))
    if kind == "regression":
        prediction = scores
        if label_stats is not None:
            mean, std = label_stats
            # a float64 product, then a sum, as outputs() in torch: Java fuses no
            # multiply-add, so the two agree bit for bit
            prediction = prediction * F.lit(std) + F.lit(mean)
        # the UDF scores every row: coalesce only makes the column NOT NULL, as MLlib's
        # prediction is (a projection, no second pass over the data)
        return {"prediction": F.coalesce(prediction, nan)}
    z = F.element_at(scores, 1)
    single = F.lit(outputs == 1) if outputs is not None else F.size(scores) == 1
    prob = _probability(scores, outputs) if probability is None else probability
    if thresholds is None:
        # softmax is monotonic: the most probable class is the largest output's, and no
        # probability need be computed for it; a single logit compares as the
        # probabilities do, so that sigmoid's rounding ties fall as they do there
        p1 = _sigmoid(z)
        by_logit = (p1 > F.lit(1.0) - p1).cast("double")
        if outputs is None:
            classes = F.when(single, by_logit).otherwise(_argmax(scores))
        else:
            classes = by_logit if outputs == 1 else _argmax(scores)
    elif _unrolled(outputs, len(thresholds)):
        inf = F.lit(float("inf"))
        scaled = [
            inf if t == 0 else prob.getItem(i) / F.lit(float(t)) for i, t in enumerate(thresholds)
        ]
        classes = _argmax(F.array(*scaled))
    else:
        t = F.array(*(F.lit(float(v)) for v in thresholds))
        scaled_all = F.zip_with(
            prob, t, lambda p, ti: F.when(ti == 0, F.lit(float("inf"))).otherwise(p / ti)
        )
        classes = _let(scaled_all, _argmax)
    raw = scores if outputs is not None and outputs > 1 else F.array(-z, z)
    if outputs is None:
        raw = F.when(single, raw).otherwise(scores)
    return {
        "rawPrediction": array_to_vector(raw),
        "probability": array_to_vector(prob),
        "prediction": F.coalesce(classes, nan),
    }


_UNROLL_MAX = 16
"""Up to this many classes the softmax is one plain expression per class, which Spark
compiles (whole-stage code generation, the maximum and each exponential shared by
subexpression elimination): at 10 classes about half the time of higher-order functions
over the array, which Spark interprets element by element. Each class's expression
repeats the others' exponentials in the plan's tree, which grows with the square of the
classes: above this, planning costs more than the compiled code saves."""


def _unrolled(outputs: int | None, width: int) -> bool:
    return outputs is not None and outputs == width and 1 < outputs <= _UNROLL_MAX


def _probability(scores: Column, outputs: int | None = None) -> Column:
    """The class probabilities of each row's outputs as a Spark expression: the softmax,
    or for a single logit ``z`` ``[1 - sigmoid(z), sigmoid(z)]``. ``outputs``: the number
    of outputs every row has (``None``: any number)."""
    from pyspark.sql import functions as F

    p1 = _sigmoid(F.element_at(scores, 1))
    binary = F.array(F.lit(1.0) - p1, p1)
    if outputs == 1:
        return binary
    if outputs is not None and _unrolled(outputs, outputs):
        return _softmax_of(scores, outputs)
    return F.when(F.size(scores) == 1, binary).otherwise(_softmax(scores))


def _softmax_of(scores: Column, outputs: int) -> Column:
    """:func:`_softmax` of exactly ``outputs`` values per row, as plain expressions: the
    same operations in the same order (the sum from 0.0, left to right), so the same
    doubles."""
    from pyspark.sql import functions as F

    values = [scores.getItem(i) for i in range(outputs)]
    largest = F.greatest(*values)
    exps = [F.exp(v - largest) for v in values]
    total = F.lit(0.0)
    for e in exps:
        total = total + e
    scale = F.lit(1.0) / total
    return F.array(*(e * scale for e in exps))


def _softmax(scores: Column) -> Column:
    """``exp(s - max(s)) * (1 / sum)`` per row, as torch's float64 softmax computes it,
    each intermediate bound once (:func:`_let`): written inline, the maximum and the sum
    inside the lambdas would be evaluated again for every element."""
    from pyspark.sql import functions as F

    def normalised(e: Column) -> Column:
        total = F.aggregate(e, F.lit(0.0), lambda acc, x: acc + x)
        return _let(F.lit(1.0) / total, lambda r: F.transform(e, lambda x: x * r))

    return _let(
        F.array_max(scores),
        lambda m: _let(F.transform(scores, lambda x: F.exp(x - m)), normalised),
    )


def _sigmoid(z: Column) -> Column:
    """``1 / (1 + exp(-z))``, torch's float64 sigmoid."""
    from pyspark.sql import functions as F

    return F.lit(1.0) / (F.lit(1.0) + F.exp(-z))


def _argmax(values: Column) -> Column:
    """The index of each row's first largest value as a double (NaN counts as the
    largest and equals itself, as in torch's ``argmax``)."""
    from pyspark.sql import functions as F

    return (F.array_position(values, F.array_max(values)) - 1).cast("double")


def _let(value: Column, body: Callable[[Column], Column]) -> Column:
    """``body(value)`` with ``value`` evaluated once per row: the lambda of a
    one-element array's ``transform`` binds it. Spark has no ``let``, and inlines an
    expression a lambda reads into the lambda, once per element."""
    from pyspark.sql import functions as F

    return F.element_at(F.transform(F.array(value), body), 1)


def inference_device(requested: str) -> torch.device:
    """Where this task scores: the task's GPU when ``device`` (the model's Param) is
    ``"auto"`` or ``"cuda"``, Spark gave the task a GPU and CUDA works in this Python
    worker (:func:`sparktrain.task.device.resolve`, as training places itself), else
    the CPU. Unlike training, ``"cuda"`` without a GPU scores on the CPU (with a warning):
    a model fitted on GPUs keeps working on a CPU-only cluster."""
    from pyspark import TaskContext

    from sparktrain.errors import ResourceError
    from sparktrain.task.device import place

    if requested == "cpu":
        return torch.device("cpu")
    ctx = TaskContext.get()
    gpu = ctx.resources().get("gpu") if ctx is not None else None
    gpus = list(gpu.addresses) if gpu is not None else []
    try:
        return place(requested, gpus).device
    except ResourceError as exc:
        if requested != "cuda":
            raise
        log.warning("transform scores on the CPU: %s", exc)
        return torch.device("cpu")


def _rows(column: InputColumn, values: pa.Array, n: int) -> Any:
    """One input column of an Arrow batch as the Collator takes it (as the training
    workers' ingest reads it, ``sparktrain.data.partition_data``): ``(n, width)`` values of the
    stored dtype for a dense column, per-row arrays or ``bytes`` for a variable-length or
    binary one."""
    from sparktrain.data.ragged import Ragged, chunk_of_arrow

    where = f"column {column.source!r}"
    if values.null_count:
        raise DataError(
            f"transform: {values.null_count} rows have a null {where}; drop them "
            "(df.dropna(subset=[...])) or fill them before transform"
        )
    listed = (
        pa.types.is_list(values.type)
        or pa.types.is_large_list(values.type)
        or pa.types.is_fixed_size_list(values.type)
    )
    if listed and values.flatten().null_count:
        raise DataError(f"transform: {where} holds arrays with null elements; fill or drop them")
    if column.kind != DENSE:
        binary = column.kind == BINARY
        assert binary or column.kind == RAGGED
        chunk = chunk_of_arrow(values, None if binary else column.stored_dtype)
        return Ragged([chunk], binary).take(np.arange(n))
    if not listed:
        # a copy: torch takes only writable arrays
        return np.array(values.to_numpy(zero_copy_only=False), column.stored_dtype).reshape(n, 1)
    width = column.width
    lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
    if lengths.min() != width or lengths.max() != width:
        bad = int(lengths[lengths != width][0])
        raise DataError(
            f"transform: a row of {where} has {bad} values, the model was trained on "
            f"{width} ({column.describe()}); every row needs that many"
        )
    flat = values.flatten().to_numpy(zero_copy_only=False)
    return np.array(flat, dtype=column.stored_dtype).reshape(n, width)


def _checked_label_stats(stats: Any) -> tuple[float, float] | None:
    """``(mean, std)`` as two floats (a finite mean, a finite std > 0), or ``None``."""
    if stats is None:
        return None
    mean, std = (float(v) for v in stats)
    if not (np.isfinite(mean) and np.isfinite(std) and std > 0):
        raise DataError(
            f"label scaling figures mean={mean!r}, std={std!r} must be finite with std > 0"
        )
    return mean, std


def trained_module(
    model: nn.Module, summary: dict[str, Any] | None = None
) -> tuple[nn.Module, tuple[float, float] | None]:
    """(the module ``modelFn`` built, with its trained weights; the ``(mean, std)`` of
    label scaling or ``None``) of a :class:`~sparktrain.TrainResult`'s ``model`` and
    ``summary``. The figures are the summary's ``label_scaling`` (the driver's float64
    values) when it has them, else the wrapper's (float32) buffers."""
    if not isinstance(model, LabelScaled):
        return model, None
    figures = (summary or {}).get("label_scaling")
    if figures:
        return model.inner, (float(figures["mean"]), float(figures["std"]))
    mean = float(model.get_buffer("label_mean"))
    std = float(model.get_buffer("label_std"))
    return model.inner, (mean, std)


def layout_width(layout: Layout) -> int:
    """A model's ``numFeatures``: the values a row holds over its input columns when every
    column has a fixed size (the plain layout's width), else -1."""
    if any(c.kind != DENSE for c in layout.columns):
        return -1
    return sum(c.width for c in layout.columns)


def _list_array(matrix: np.ndarray) -> pa.Array:
    """An ``(n, k)`` float64 matrix as an Arrow ``list<double>`` array, without row loops."""
    n, k = matrix.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1)))


def require_spark_frame(dataset: object, what: str) -> None:
    """Refuse a pandas (or any other) frame where pyspark.ml takes a Spark DataFrame, with
    the call that converts it (pyspark.ml would fail later on a missing ``schema``)."""
    from pyspark.sql import DataFrame as SparkFrame

    if not isinstance(dataset, SparkFrame):
        raise not_a_spark_frame(dataset, what)
