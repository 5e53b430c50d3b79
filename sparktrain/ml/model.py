"""Fitted sparktrain models: distributed batch inference and persistence.

``transform`` broadcasts the weights once (``torch.save`` bytes, read back on the
executors with ``weights_only=True``), rebuilds the module from ``modelFn`` once per
Python worker, and runs an iterator Arrow UDF over the features column: every Arrow batch
becomes one ``(n, width)`` float32 tensor and one forward pass under ``torch.no_grad``.
There is no per-row Python. The UDF returns a struct of ``prediction`` (double) and, for
classifiers, ``rawPrediction`` / ``probability`` as ``array<double>``, turned into ml
Vectors by the JVM's ``array_to_vector``; every input column is kept.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import pyarrow as pa
import torch
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable
from torch import nn

from sparktrain.builders import build_model, import_callable
from sparktrain.errors import ConfigError, DataError
from sparktrain.ml.params import _TorchClassifierParams, _TorchParams, _TorchRegressorParams
from sparktrain.ml.persistence import TorchModelReader, TorchModelWriter
from sparktrain.result import state_from_bytes

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

__all__ = ["TorchClassificationModel", "TorchModel", "TorchRegressionModel"]

_OUT = "__sparktrain_output"


class TorchModel(Model, _TorchParams, MLWritable, MLReadable["TorchModel"]):
    """Base of the fitted sparktrain models (see :class:`TorchClassificationModel` and
    :class:`TorchRegressionModel`). Holds the trained weights and the params it was
    trained with; ``transform`` adds the prediction columns and keeps every input column.
    """

    _kind = "regression"

    def __init__(self) -> None:
        super().__init__()
        self._state_bytes = b""
        self._num_features = 0
        self._num_outputs = 1
        self._token = uuid.uuid4().hex
        self._summary: dict[str, Any] | None = None

    # ------------------------------------------------------------------ state
    def _set_state(
        self,
        state_bytes: bytes,
        *,
        num_features: int,
        num_outputs: int | None,
        summary: dict[str, Any] | None = None,
    ) -> Self:
        self._state_bytes = state_bytes
        self._num_features = int(num_features)
        self._num_outputs = int(num_outputs) if num_outputs else 1
        self._token = uuid.uuid4().hex
        self._summary = summary
        return self

    def _num_outputs_meta(self) -> int | None:
        """numClasses in the saved metadata (None for regressors)."""
        return None

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
        """Width of the feature vectors the model was trained on."""
        return self._num_features

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

    def getModule(self) -> nn.Module:
        """A fresh ``torch.nn.Module`` on the driver with the trained weights, in eval mode."""
        module = self._build_module()
        module.load_state_dict(state_from_bytes(self._state_bytes))
        return module.eval()

    # ------------------------------------------------------------------ setters
    def setFeaturesCol(self, value: str) -> Self:
        """Sets the value of :py:attr:`featuresCol`."""
        return self._set(featuresCol=value)

    def setPredictionCol(self, value: str) -> Self:
        """Sets the value of :py:attr:`predictionCol`."""
        return self._set(predictionCol=value)

    # ------------------------------------------------------------------ transform
    def _output_columns(self) -> list[tuple[str, str]]:
        """(param value, struct field) for every output column that is switched on."""
        return [(self.getPredictionCol(), "prediction")] if self.getPredictionCol() else []

    def _transform(self, dataset: DataFrame) -> DataFrame:
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import functions as F
        from pyspark.sql.functions import arrow_udf

        features = _features_as_float_array(dataset, self.getFeaturesCol(), "transform")
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
        spark = dataset.sparkSession
        sc = spark.sparkContext
        from sparktrain.launch.resources import task_cpus

        plan = _InferencePlan(
            token=self._token,
            weights=sc.broadcast(self._state_bytes),
            model_fn=self.getModelFn(),
            model_kwargs=self.getModelKwargsDict(),
            num_features=self._num_features,
            kind=self._kind,
            threads=task_cpus(sc),
            fields=tuple(field for _, field in outputs),
        )
        fields = ", ".join(f"{field} {_FIELD_TYPES[field]}" for _, field in outputs)
        udf = arrow_udf(plan.run, f"struct<{fields}>")  # type: ignore[call-overload]
        out = dataset.withColumn(_OUT, udf(features))
        columns: dict[str, Column] = {}
        for name, field in outputs:
            value = F.col(_OUT).getField(field)
            columns[name] = value if field == "prediction" else array_to_vector(value)
        return out.withColumns(columns).drop(_OUT)

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

        The saved ``modelFn`` must be in an allowed module
        (:func:`sparktrain.ml.allow_model_modules`, default ``sparktrain.models``),
        checked before anything is imported. ``model_fn="package.module:function"``
        replaces it with a factory of your choice, which is not checked.
        """
        return TorchModelReader(cls, model_fn=model_fn).load(path)


class TorchClassificationModel(TorchModel, _TorchClassifierParams):
    """A classifier fitted by :class:`~sparktrain.ml.TorchClassifier`.

    ``transform`` adds ``rawPrediction`` (the model's logits as an ml Vector; for a
    single-logit binary model ``[-z, z]``, as MLlib's LogisticRegression does),
    ``probability`` (softmax, or ``[1 - sigmoid(z), sigmoid(z)]``) and ``prediction``
    (the most probable class index, as a double). Set any of the three column params to
    ``""`` to leave that column out.

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

    def _output_columns(self) -> list[tuple[str, str]]:
        wanted = [
            (self.getRawPredictionCol(), "rawPrediction"),
            (self.getProbabilityCol(), "probability"),
            (self.getPredictionCol(), "prediction"),
        ]
        return [(name, field) for name, field in wanted if name]


class TorchRegressionModel(TorchModel, _TorchRegressorParams):
    """A regressor fitted by :class:`~sparktrain.ml.TorchRegressor`: ``transform`` adds
    ``prediction`` (double), the model's single output.

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


_FIELD_TYPES = {
    "prediction": "double",
    "rawPrediction": "array<double>",
    "probability": "array<double>",
}


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


@dataclass
class _InferencePlan:
    """What each inference task needs; picklable (the weights travel in the broadcast)."""

    token: str
    weights: Any  # pyspark Broadcast[bytes]
    model_fn: str
    model_kwargs: dict[str, Any]
    num_features: int
    kind: str
    threads: int
    fields: tuple[str, ...]

    def module(self) -> nn.Module:
        # copies of a model share weights (and token) but may differ in modelFn/modelKwargs
        key = f"{self.token}|{self.model_fn}|{json.dumps(self.model_kwargs, sort_keys=True)}"
        with _MODULES_LOCK:
            cached = _MODULES.get(key)
            if cached is not None:
                _MODULES.move_to_end(key)
                return cached
        module = build_module(self.model_fn, self.model_kwargs)
        module.load_state_dict(state_from_bytes(self.weights.value))
        module.eval()
        with _MODULES_LOCK:
            _MODULES[key] = module
            while len(_MODULES) > _MODULES_KEPT:
                _MODULES.popitem(last=False)
        return module

    def run(self, batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        """The Arrow UDF body: one forward pass per Arrow batch."""
        torch.set_num_threads(max(1, self.threads))
        module = self.module()
        with torch.no_grad():
            for features in batches:
                yield self.predict(module, features)

    def predict(self, module: nn.Module, features: pa.Array) -> pa.Array:
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
        out = module(x)
        out = out.flatten(1) if out.ndim > 1 else out.unsqueeze(1)
        columns: dict[str, pa.Array] = {}
        if self.kind == "regression":
            columns["prediction"] = pa.array(out[:, 0].double().numpy())
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
            columns["prediction"] = pa.array(prob.argmax(dim=1).double().numpy())
        return pa.StructArray.from_arrays(
            [columns[f] for f in self.fields], names=list(self.fields)
        )


def _list_array(matrix: np.ndarray) -> pa.Array:
    """An ``(n, k)`` float64 matrix as an Arrow ``list<double>`` array, without row loops."""
    n, k = matrix.shape
    offsets = pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1)))
