"""Params of the sparktrain pyspark.ml stages, in the pyspark.ml style.

One ``Has<Name>`` mixin per param, each with a type converter and a default; the private
``_TorchParams`` collects them for both the estimators and their models (so a fitted model
carries the settings it was trained with). The standard column params (``featuresCol``,
``labelCol``, ``predictionCol``, ``probabilityCol``, ``rawPredictionCol``, ``weightCol``,
``seed``) are pyspark's own mixins, so evaluators and tuning see the usual names.
``weightCol`` (unset by default) passes the Trainer's ``weight_col``: sample weights
``>= 0`` that make the objective the weighted mean loss ``sum w_i l_i / sum w_i`` (MLlib's
convention); validation metrics stay unweighted.

Defaults come from :class:`~sparktrain.config.TrainConfig`: there is one source of every
training knob, and :meth:`_TorchParams._train_config` maps the params onto it::

    learningRate -> lr            maxEpochs -> epochs          batchSize -> batch_size
    numWorkers   -> num_workers   psMode    -> ps_mode         validationFraction ->
    optimizerKwargs -> optimizer_kwargs (JSON)                     validation_fraction
    dataMemoryInMB -> data_memory_mb
    loss, optimizer, strategy, compression, seed -> the keys of the same name
"""

from __future__ import annotations

import json
from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (
    HasFeaturesCol,
    HasLabelCol,
    HasPredictionCol,
    HasProbabilityCol,
    HasRawPredictionCol,
    HasSeed,
    HasWeightCol,
)

from sparktrain.config import LOSSES, OPTIMIZERS, PS_MODES, TrainConfig
from sparktrain.strategies import registry

__all__ = [
    "HasBatchSize",
    "HasCompression",
    "HasLearningRate",
    "HasLoss",
    "HasMaxEpochs",
    "HasModelFn",
    "HasModelKwargs",
    "HasNumWorkers",
    "HasOptimizer",
    "HasOptimizerKwargs",
    "HasPsMode",
    "HasStrategy",
    "HasValidationFraction",
]

_DEFAULTS = TrainConfig()

CLASSIFICATION_LOSSES = ("cross_entropy", "bce_with_logits")
REGRESSION_LOSSES = tuple(loss for loss in LOSSES if loss not in CLASSIFICATION_LOSSES)


# ---------------------------------------------------------------------- converters
# A converter raises TypeError for a value of the wrong kind (pyspark then names the
# param) and ValueError for a value of the right kind that is out of range.
def _one_of(name: str, allowed: tuple[str, ...]) -> Any:
    def convert(value: Any) -> str:
        text = TypeConverters.toString(value)
        if text not in allowed:
            raise ValueError(
                f"{name}={text!r} is not supported; allowed values: {', '.join(allowed)}"
            )
        return text

    return convert


def _registered_strategy(value: Any) -> str:
    text = TypeConverters.toString(value)
    if not registry.is_known(text):
        registry.get(text)  # raises, listing the registered strategies
    return text


def _int_at_least(name: str, low: int) -> Any:
    def convert(value: Any) -> int:
        number = TypeConverters.toInt(value)
        if number < low:
            raise ValueError(f"{name}={number!r} must be an integer >= {low}")
        return number

    return convert


def _to_positive_float(name: str) -> Any:
    def convert(value: Any) -> float:
        number = TypeConverters.toFloat(value)
        if not number > 0:
            raise ValueError(f"{name}={number!r} must be a number > 0")
        return number

    return convert


def _to_fraction(value: Any) -> float:
    number = TypeConverters.toFloat(value)
    if not 0.0 <= number < 1.0:
        raise ValueError(
            f"validationFraction={number!r} is out of range: use a value in [0, 1), e.g. 0.2"
        )
    return number


def _to_model_fn(value: Any) -> str:
    """``"package.module:function"``; the import itself happens at fit/transform time."""
    text = TypeConverters.toString(value).strip()
    module, sep, attr = text.partition(":")
    if not sep or not module or not attr:
        raise ValueError(
            f"modelFn={text!r} must be an importable 'package.module:function' string, "
            "e.g. 'sparktrain.models:mlp'"
        )
    return text


def _json_object(name: str) -> Any:
    """A dict, or a string holding a JSON object; stored as canonical JSON text (so params
    stay JSON-serialisable for MLlib metadata and compare equal in a ParamGrid)."""

    def convert(value: Any) -> str:
        if isinstance(value, dict):
            parsed: Any = value
        elif isinstance(value, str):
            try:
                parsed = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"{name} is not valid JSON ({exc}): {value!r}") from exc
        else:
            raise TypeError(f"{name} must be a dict or a JSON object string, got {value!r}")
        if not isinstance(parsed, dict):
            raise ValueError(
                f"{name} must be a JSON object like '{{\"hidden\": [64]}}', got {value!r}"
            )
        try:
            return json.dumps(parsed, sort_keys=True)
        except TypeError as exc:
            raise TypeError(f"{name} must hold only JSON values: {exc}") from exc

    return convert


def _to_spec(value: Any) -> str:
    text = TypeConverters.toString(value).strip()
    if not text:
        raise ValueError("compression must be a compression spec such as 'none'")
    return text


# ---------------------------------------------------------------------- mixins
class HasModelFn(Params):
    """Mixin for param modelFn: the model factory, ``"package.module:function"``."""

    modelFn: Param[str] = Param(
        Params._dummy(),
        "modelFn",
        "importable model factory 'package.module:function' returning a torch.nn.Module; "
        "it must be importable on the driver and the executors",
        typeConverter=_to_model_fn,
    )

    def getModelFn(self) -> str:
        """Gets the value of modelFn (there is no default: it must be set)."""
        return self.getOrDefault(self.modelFn)


class HasModelKwargs(Params):
    """Mixin for param modelKwargs: keyword arguments of the model factory, as JSON."""

    modelKwargs: Param[str] = Param(
        Params._dummy(),
        "modelKwargs",
        "keyword arguments for modelFn as a JSON object (a dict is accepted and stored as JSON)",
        typeConverter=_json_object("modelKwargs"),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(modelKwargs="{}")

    def getModelKwargs(self) -> str:
        """Gets the value of modelKwargs (JSON text) or its default ``"{}"``."""
        return self.getOrDefault(self.modelKwargs)

    def getModelKwargsDict(self) -> dict[str, Any]:
        """modelKwargs parsed into a dict."""
        parsed: dict[str, Any] = json.loads(self.getModelKwargs())
        return parsed


class HasLoss(Params):
    """Mixin for param loss: the training loss."""

    loss: Param[str] = Param(
        Params._dummy(),
        "loss",
        f"training loss, one of {', '.join(LOSSES)}",
        typeConverter=_one_of("loss", LOSSES),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(loss=str(_DEFAULTS.loss))

    def getLoss(self) -> str:
        """Gets the value of loss or its default."""
        return self.getOrDefault(self.loss)


class HasOptimizer(Params):
    """Mixin for param optimizer."""

    optimizer: Param[str] = Param(
        Params._dummy(),
        "optimizer",
        f"optimizer, one of {', '.join(OPTIMIZERS)}",
        typeConverter=_one_of("optimizer", OPTIMIZERS),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(optimizer=str(_DEFAULTS.optimizer))

    def getOptimizer(self) -> str:
        """Gets the value of optimizer or its default."""
        return self.getOrDefault(self.optimizer)


class HasOptimizerKwargs(Params):
    """Mixin for param optimizerKwargs: extra optimizer arguments, as JSON."""

    optimizerKwargs: Param[str] = Param(
        Params._dummy(),
        "optimizerKwargs",
        "extra optimizer arguments as a JSON object, e.g. '{\"momentum\": 0.9}'",
        typeConverter=_json_object("optimizerKwargs"),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(optimizerKwargs=json.dumps(_DEFAULTS.optimizer_kwargs))

    def getOptimizerKwargs(self) -> str:
        """Gets the value of optimizerKwargs (JSON text) or its default ``"{}"``."""
        return self.getOrDefault(self.optimizerKwargs)


class HasLearningRate(Params):
    """Mixin for param learningRate."""

    learningRate: Param[float] = Param(
        Params._dummy(),
        "learningRate",
        "learning rate (> 0)",
        typeConverter=_to_positive_float("learningRate"),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(learningRate=_DEFAULTS.lr)

    def getLearningRate(self) -> float:
        """Gets the value of learningRate or its default."""
        return self.getOrDefault(self.learningRate)


class HasBatchSize(Params):
    """Mixin for param batchSize: samples per worker per step."""

    batchSize: Param[int] = Param(
        Params._dummy(),
        "batchSize",
        "mini-batch size per worker (>= 1)",
        typeConverter=_int_at_least("batchSize", 1),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(batchSize=_DEFAULTS.batch_size)

    def getBatchSize(self) -> int:
        """Gets the value of batchSize or its default."""
        return self.getOrDefault(self.batchSize)


class HasMaxEpochs(Params):
    """Mixin for param maxEpochs: passes over the training data."""

    maxEpochs: Param[int] = Param(
        Params._dummy(),
        "maxEpochs",
        "number of passes over the training data (>= 1)",
        typeConverter=_int_at_least("maxEpochs", 1),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(maxEpochs=_DEFAULTS.epochs)

    def getMaxEpochs(self) -> int:
        """Gets the value of maxEpochs or its default."""
        return self.getOrDefault(self.maxEpochs)


class HasNumWorkers(Params):
    """Mixin for param numWorkers: training tasks (one Spark task slot each)."""

    numWorkers: Param[int] = Param(
        Params._dummy(),
        "numWorkers",
        "number of training workers (Spark tasks, one free slot each; >= 1)",
        typeConverter=_int_at_least("numWorkers", 1),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(numWorkers=_DEFAULTS.num_workers)

    def getNumWorkers(self) -> int:
        """Gets the value of numWorkers or its default."""
        return self.getOrDefault(self.numWorkers)


class HasStrategy(Params):
    """Mixin for param strategy: how the workers combine their gradients."""

    strategy: Param[str] = Param(
        Params._dummy(),
        "strategy",
        "aggregation strategy: a registered name (sparktrain.strategies.names(): "
        f"{', '.join(registry.names())}, or a plug-in)",
        typeConverter=_registered_strategy,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(strategy=_DEFAULTS.strategy)

    def getStrategy(self) -> str:
        """Gets the value of strategy or its default."""
        return self.getOrDefault(self.strategy)


class HasCompression(Params):
    """Mixin for param compression: the gradient compression spec."""

    compression: Param[str] = Param(
        Params._dummy(),
        "compression",
        "gradient compression spec (see TrainConfig.compression), 'none' for none",
        typeConverter=_to_spec,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(compression=_DEFAULTS.compression)

    def getCompression(self) -> str:
        """Gets the value of compression or its default."""
        return self.getOrDefault(self.compression)


class HasPsMode(Params):
    """Mixin for param psMode: parameter-server consistency (``strategy="ps"`` only)."""

    psMode: Param[str] = Param(
        Params._dummy(),
        "psMode",
        f"parameter server mode for strategy='ps', one of {', '.join(PS_MODES)}",
        typeConverter=_one_of("psMode", PS_MODES),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(psMode=_DEFAULTS.ps_mode)

    def getPsMode(self) -> str:
        """Gets the value of psMode or its default."""
        return self.getOrDefault(self.psMode)


class HasValidationFraction(Params):
    """Mixin for param validationFraction: share of each partition held out."""

    validationFraction: Param[float] = Param(
        Params._dummy(),
        "validationFraction",
        "fraction of each partition held out to measure the per-epoch metric, in [0, 1)",
        typeConverter=_to_fraction,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(validationFraction=_DEFAULTS.validation_fraction)

    def getValidationFraction(self) -> float:
        """Gets the value of validationFraction or its default."""
        return self.getOrDefault(self.validationFraction)


class HasDataMemoryInMB(Params):
    """Mixin for param dataMemoryInMB: each worker's memory for its partition's rows."""

    dataMemoryInMB: Param[float] = Param(
        Params._dummy(),
        "dataMemoryInMB",
        "MiB a worker may hold its partition's rows in; a larger partition spills once to "
        "a memory-mapped file under spark.local.dir (0 spills every row)",
        typeConverter=TypeConverters.toFloat,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(dataMemoryInMB=_DEFAULTS.data_memory_mb)

    def getDataMemoryInMB(self) -> float:
        """Gets the value of dataMemoryInMB or its default."""
        return self.getOrDefault(self.dataMemoryInMB)


# ---------------------------------------------------------------------- shared sets
class _TorchParams(
    HasFeaturesCol,
    HasLabelCol,
    HasPredictionCol,
    HasWeightCol,
    HasSeed,
    HasModelFn,
    HasModelKwargs,
    HasLoss,
    HasOptimizer,
    HasOptimizerKwargs,
    HasLearningRate,
    HasBatchSize,
    HasMaxEpochs,
    HasNumWorkers,
    HasStrategy,
    HasCompression,
    HasPsMode,
    HasValidationFraction,
    HasDataMemoryInMB,
):
    """Params shared by :class:`TorchEstimator` and :class:`TorchModel`."""

    def __init__(self) -> None:
        super().__init__()
        # pyspark's HasSeed default is hash(class name), which changes between processes.
        self._setDefault(seed=_DEFAULTS.seed)

    def _train_config(self) -> TrainConfig:
        """The TrainConfig these params describe (validated: a bad value is a ConfigError
        naming the TrainConfig key)."""
        return _DEFAULTS.replace(
            loss=self.getLoss(),
            optimizer=self.getOptimizer(),
            optimizer_kwargs=json.loads(self.getOptimizerKwargs()),
            lr=self.getLearningRate(),
            batch_size=self.getBatchSize(),
            epochs=self.getMaxEpochs(),
            num_workers=self.getNumWorkers(),
            strategy=self.getStrategy(),
            compression=self.getCompression(),
            ps_mode=self.getPsMode(),
            seed=self.getSeed(),
            validation_fraction=self.getValidationFraction(),
            data_memory_mb=self.getDataMemoryInMB(),
        )


class _TorchClassifierParams(_TorchParams, HasProbabilityCol, HasRawPredictionCol):
    """Params of :class:`TorchClassifier` and :class:`TorchClassificationModel`."""

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(loss="cross_entropy")


class _TorchRegressorParams(_TorchParams):
    """Params of :class:`TorchRegressor` and :class:`TorchRegressionModel`."""

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(loss="mse")
