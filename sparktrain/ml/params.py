"""Params of the sparktrain pyspark.ml stages, in the pyspark.ml style.

One ``Has<Name>`` mixin per param, each with a type converter and a default; the private
``_TorchParams`` collects them for both the estimators and their models (so a fitted model
carries the settings it was trained with). The standard column params (``featuresCol``,
``labelCol``, ``predictionCol``, ``probabilityCol``, ``rawPredictionCol``, ``weightCol``,
``seed``) are pyspark's own mixins, so evaluators and tuning see the usual names.
``weightCol`` (unset by default) passes the Trainer's ``weight_col``: sample weights
``>= 0`` that make the objective the weighted mean loss ``sum w_i l_i / sum w_i`` (MLlib's
convention); validation metrics stay unweighted.

Defaults come from :data:`ML_DEFAULTS`: :class:`~sparktrain.config.TrainConfig`'s, except
``optimizer="adam"``, ``learningRate=0.001``, ``maxEpochs=50`` (and ``batchSize=32``,
TrainConfig's), chosen so that a model trains standardised tabular data well out of the
box (docs/ml.md has the table and why), and the regressor's ``labelScaling=True``.
:meth:`_TorchParams._train_config` maps the params onto TrainConfig::

    learningRate -> lr            maxEpochs -> epochs          batchSize -> batch_size
    numWorkers   -> num_workers   psMode    -> ps_mode         validationFraction ->
    optimizerKwargs -> optimizer_kwargs (JSON)                     validation_fraction
    dataMemoryInMB -> data_memory_mb
    labelScaling -> label_scaling (regressor; only with loss="mse")
    featureShapes -> feature_shapes   featureDtypes -> feature_dtypes   (JSON objects)
    decode, collate (JSON objects), loss, optimizer, strategy, compression, seed -> the keys
                                                                          of the same name
    lrSchedule -> lr_schedule     lrScheduleKwargs -> lr_schedule_kwargs (JSON)
    lrScheduleInterval -> lr_schedule_interval   warmupSteps -> warmup_steps
    fp16SkipLimit -> fp16_skip_limit   accumulateSteps -> accumulate_steps
    clipGradNorm -> clip_grad_norm     earlyStopping -> early_stopping (JSON object)
    tensorboardDir -> tensorboard_dir  mlflowTrackingUri -> mlflow_tracking_uri
    mlflowExperiment -> mlflow_experiment   precision, metrics (names only) -> the keys
                                                                          of the same name
    device -> device              gpusPerTask -> gpus_per_task   commBackend -> comm_backend
    shardOptimizer -> shard_optimizer
    driverServicesHost -> driver_services_host   driverServicesPorts -> driver_services_ports

The training-loop params (schedule to metrics and loggers) and the placement params
(``device`` to ``driverServicesPorts``) have TrainConfig's defaults. A model keeps
``driverServicesHost``/``driverServicesPorts``: under Spark Connect its ``transform``
serves large weights from there.
Their converters check a value when it is set, with TrainConfig's wording under the
param's name; ``lrSchedule`` and ``earlyStopping`` are checked by TrainConfig itself, so
the two cannot disagree on what a schedule name or an early-stopping table is. ``metrics``
takes names only: a param must be JSON for MLlib metadata, so a callable metric goes
through :class:`~sparktrain.Trainer` (TrainConfig ``metrics``).

The model's inputs: ``featuresCol`` names one column (``model(x)``); ``featuresCols``, when
set and non-empty, overrides it with several columns, ``["a", "b"]`` for ``model(a, b)``
or ``["user=user_id", "item=item_id"]`` for ``model(user=..., item=...)`` (see
:mod:`sparktrain.data.columns`). A fit with only ``featuresCol`` and none of the four
per-column options is the *plain* fit of one float vector column.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
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

from sparktrain.comm_backend import COMM_BACKENDS
from sparktrain.config import (
    DEVICES,
    LOSSES,
    METRICS,
    OPTIMIZERS,
    PRECISIONS,
    PS_MODES,
    SCHEDULE_INTERVALS,
    TrainConfig,
    check_metric_name,
    parse_port_range,
)
from sparktrain.data.columns import ColumnsSpec, check_dtype, check_shape
from sparktrain.errors import ConfigError
from sparktrain.strategies import registry

__all__ = [
    "ML_DEFAULTS",
    "HasAccumulateSteps",
    "HasBatchSize",
    "HasClipGradNorm",
    "HasCollate",
    "HasCommBackend",
    "HasCompression",
    "HasDataMemoryInMB",
    "HasDecode",
    "HasDevice",
    "HasDriverServicesHost",
    "HasDriverServicesPorts",
    "HasEarlyStopping",
    "HasFeatureDtypes",
    "HasFeatureShapes",
    "HasFeaturesCols",
    "HasFp16SkipLimit",
    "HasGpusPerTask",
    "HasLabelScaling",
    "HasLearningRate",
    "HasLoss",
    "HasLrSchedule",
    "HasLrScheduleInterval",
    "HasLrScheduleKwargs",
    "HasMaxEpochs",
    "HasMetrics",
    "HasMlflowExperiment",
    "HasMlflowTrackingUri",
    "HasModelFn",
    "HasModelKwargs",
    "HasNumWorkers",
    "HasOptimizer",
    "HasOptimizerKwargs",
    "HasPrecision",
    "HasPsMode",
    "HasShardOptimizer",
    "HasStrategy",
    "HasTensorboardDir",
    "HasValidationFraction",
    "HasWarmupSteps",
]

_DEFAULTS = TrainConfig()

ML_DEFAULTS = _DEFAULTS.replace(optimizer="adam", lr=1e-3, epochs=50, batch_size=32)
"""The estimators' defaults: TrainConfig's, except the training-loop knobs chosen so that
a model trains well out of the box on standardised tabular data (Adam at 1e-3 as
scikit-learn's MLP estimators, 50 epochs; ``batch_size`` is TrainConfig's 32, pinned here
so that the estimators' figures do not move with it; see the table in docs/ml.md for why
each). Estimators saved before these defaults keep the defaults they were saved with
(MLlib metadata records them)."""

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


def _column_table(name: str, check: Any) -> Any:
    """A JSON object of column -> value (a dict is accepted), every value passed through
    ``check(column, value)``; stored as canonical JSON text like :func:`_json_object`."""
    as_json = _json_object(name)

    def convert(value: Any) -> str:
        text: str = as_json(value)
        for column, entry in json.loads(text).items():
            try:
                check(column, entry)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from exc
        return text

    return convert


def _check_hook(column: str, value: Any) -> None:
    """A ``decode``/``collate`` entry: ``"package.module:function"``."""
    module, sep, attr = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not module.strip() or not attr.strip():
        raise ValueError(
            f"[{column!r}] = {value!r}: give an importable 'package.module:function' string"
        )


def _to_features_cols(value: Any) -> list[str]:
    """``featuresCols``: a list of ``col`` or of ``arg=col`` entries (not both), or a
    ``{arg: col}`` dict, stored as ``["arg=col", ...]``."""
    if isinstance(value, Mapping):
        entries = []
        for arg, col in value.items():
            if not isinstance(arg, str) or not isinstance(col, str):
                raise TypeError(
                    f"featuresCols as a dict maps argument names to column names, got {value!r}"
                )
            entries.append(f"{arg}={col}")
        value = entries
    entries = [e.strip() for e in TypeConverters.toListString(value)]
    features_spec(entries)  # raises ValueError for a malformed list
    return entries


def features_spec(entries: list[str] | None) -> ColumnsSpec | None:
    """The ``features_col`` of :meth:`Trainer.fit` that ``featuresCols`` entries describe:
    ``None`` for none, a list of column names, or a ``{model_argument: column}`` dict."""
    if not entries:
        return None
    keyword = ["=" in e for e in entries]
    if any(keyword) and not all(keyword):
        raise ValueError(
            f"featuresCols={entries!r} mixes plain column names with 'argument=column' "
            "entries; give either only column names (model(a, b)) or only "
            "'argument=column' entries (model(user=..., item=...))"
        )
    if not all(keyword):
        if not all(entries):
            raise ValueError(f"featuresCols={entries!r} holds an empty column name")
        if len(set(entries)) != len(entries):
            raise ValueError(f"featuresCols names a column twice: {entries!r}")
        return list(entries)
    mapping: dict[str, str] = {}
    for entry in entries:
        arg, _, col = (part.strip() for part in entry.partition("="))
        if not arg.isidentifier():
            raise ValueError(
                f"featuresCols entry {entry!r}: {arg!r} is not a Python identifier, so it "
                "cannot be a keyword argument of the model's forward()"
            )
        if not col:
            raise ValueError(f"featuresCols entry {entry!r} names no column after '='")
        if arg in mapping:
            raise ValueError(f"featuresCols gives the model argument {arg!r} twice: {entries!r}")
        mapping[arg] = col
    return mapping


def _to_spec(value: Any) -> str:
    text = TypeConverters.toString(value).strip()
    if not text:
        raise ValueError("compression must be a compression spec such as 'none'")
    return text


def _non_negative_float(name: str, note: str) -> Any:
    def convert(value: Any) -> float:
        number = TypeConverters.toFloat(value)
        if not number >= 0:  # also refuses NaN
            raise ValueError(f"{name}={number!r} must be a number >= 0 ({note})")
        return number

    return convert


def _checked_by_train_config(
    name: str,
    key: str,
    convert: Callable[[Any], Any],
    as_config: Callable[[Any], Any] = lambda stored: stored,
) -> Any:
    """``convert``, then TrainConfig's own check of ``key`` on the result (``as_config``
    turns the stored form into the key's value). Used where the rule is more than a range
    (a torch class name, a table's keys), so the param and the TOML key cannot drift
    apart; the message is TrainConfig's, with the param's name in place of the key's."""

    def check(value: Any) -> Any:
        stored = convert(value)
        try:
            _DEFAULTS.replace(**{key: as_config(stored)})
        except ConfigError as exc:
            message = str(exc)
            if message.startswith(key):
                message = name + message.removeprefix(key)
            else:
                message = f"{name}: {message}"
            raise ValueError(message) from exc
        return stored

    return check


def _checked_port_range(value: Any) -> str:
    """``driverServicesPorts``: a string ``"LOW-HIGH"`` (or one port, or ``""``), checked
    as TrainConfig checks it, under the param's name."""
    text = TypeConverters.toString(value)
    try:
        parse_port_range(text)
    except ConfigError as exc:
        raise ValueError(str(exc).replace("driver_services_ports", "driverServicesPorts")) from exc
    return text


def _to_metric_names(value: Any) -> list[str]:
    """``metrics``: validation metric names, checked as TrainConfig checks them."""
    names = TypeConverters.toListString(value)
    for name in names:
        try:
            check_metric_name(name)
        except ConfigError as exc:
            # TrainConfig's message offers callables too, which a param cannot hold.
            raise ValueError(
                f"metrics: {name!r} is not a metric; use one of {', '.join(METRICS)} (e.g. "
                "'top_k:5'). A callable metric needs the Trainer (TrainConfig metrics): "
                "params hold names only"
            ) from exc
    return names


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
        self._setDefault(optimizer=str(ML_DEFAULTS.optimizer))

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
        self._setDefault(learningRate=ML_DEFAULTS.lr)

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
        self._setDefault(batchSize=ML_DEFAULTS.batch_size)

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
        self._setDefault(maxEpochs=ML_DEFAULTS.epochs)

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


class HasLabelScaling(Params):
    """Mixin for param labelScaling: train a regressor on standardised labels."""

    labelScaling: Param[bool] = Param(
        Params._dummy(),
        "labelScaling",
        "standardise the label with the training rows' mean and standard deviation "
        "(computed on the driver) while training, and bring predictions back to label "
        "units (prediction = output * std + mean); loss='mse' only (TrainConfig "
        "label_scaling)",
        typeConverter=TypeConverters.toBoolean,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(labelScaling=True)

    def getLabelScaling(self) -> bool:
        """Gets the value of labelScaling or its default ``True``."""
        return bool(self.getOrDefault(self.labelScaling))


class HasFeaturesCols(Params):
    """Mixin for param featuresCols: several model input columns (overrides featuresCol)."""

    featuresCols: Param[list[str]] = Param(
        Params._dummy(),
        "featuresCols",
        "model input columns; when set and non-empty it overrides featuresCol. Column "
        "names ['a', 'b'] call model(a, b); 'argument=column' entries ['user=user_id', "
        "'item=item_id'] call model(user=..., item=...) (not mixed; a {argument: column} "
        "dict is accepted). Integer columns arrive as int64, floats as float32",
        typeConverter=_to_features_cols,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(featuresCols=[])

    def getFeaturesCols(self) -> list[str]:
        """Gets the value of featuresCols or its default ``[]`` (then featuresCol is used)."""
        value: list[str] | None = self.getOrDefault(self.featuresCols)
        return list(value or [])


class HasFeatureShapes(Params):
    """Mixin for param featureShapes: each input column's row shape, as JSON."""

    featureShapes: Param[str] = Param(
        Params._dummy(),
        "featureShapes",
        "row shape per input column (by column name or model argument) as a JSON object, "
        "e.g. '{\"image\": [1, 28, 28]}'; [-1] is a variable-length array, padded per batch "
        "with a mask (TrainConfig feature_shapes)",
        typeConverter=_column_table("featureShapes", check_shape),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(featureShapes="{}")

    def getFeatureShapes(self) -> str:
        """Gets the value of featureShapes (JSON text) or its default ``"{}"``."""
        return self.getOrDefault(self.featureShapes)


class HasFeatureDtypes(Params):
    """Mixin for param featureDtypes: the dtype each input column arrives as, as JSON."""

    featureDtypes: Param[str] = Param(
        Params._dummy(),
        "featureDtypes",
        'dtype per input column as a JSON object, e.g. \'{"x": "float64"}\': float32 '
        "(floats' default), float64, float16, bfloat16 or int64 (integers' default) "
        "(TrainConfig feature_dtypes)",
        typeConverter=_column_table("featureDtypes", check_dtype),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(featureDtypes="{}")

    def getFeatureDtypes(self) -> str:
        """Gets the value of featureDtypes (JSON text) or its default ``"{}"``."""
        return self.getOrDefault(self.featureDtypes)


class HasDecode(Params):
    """Mixin for param decode: a binary column's decoder, as JSON."""

    decode: Param[str] = Param(
        Params._dummy(),
        "decode",
        "per binary input column, an importable 'package.module:function' turning one "
        "value (bytes) into an array, as a JSON object (TrainConfig decode)",
        typeConverter=_column_table("decode", _check_hook),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(decode="{}")

    def getDecode(self) -> str:
        """Gets the value of decode (JSON text) or its default ``"{}"``."""
        return self.getOrDefault(self.decode)


class HasCollate(Params):
    """Mixin for param collate: a variable-length or binary column's batcher, as JSON."""

    collate: Param[str] = Param(
        Params._dummy(),
        "collate",
        "per variable-length or binary input column, an importable "
        "'package.module:function' batching its rows into a tensor or a (tensor, mask) "
        "pair, as a JSON object (TrainConfig collate)",
        typeConverter=_column_table("collate", _check_hook),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(collate="{}")

    def getCollate(self) -> str:
        """Gets the value of collate (JSON text) or its default ``"{}"``."""
        return self.getOrDefault(self.collate)


class HasLrSchedule(Params):
    """Mixin for param lrSchedule: a ``torch.optim.lr_scheduler`` class by name."""

    lrSchedule: Param[str] = Param(
        Params._dummy(),
        "lrSchedule",
        "learning-rate schedule: a torch.optim.lr_scheduler class by name "
        "('CosineAnnealingLR', 'StepLR', 'OneCycleLR', 'ReduceLROnPlateau', ...) or 'none' "
        "for a constant rate (TrainConfig lr_schedule)",
        typeConverter=_checked_by_train_config(
            "lrSchedule", "lr_schedule", TypeConverters.toString
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(lrSchedule=_DEFAULTS.lr_schedule)

    def getLrSchedule(self) -> str:
        """Gets the value of lrSchedule or its default ``"none"``."""
        return self.getOrDefault(self.lrSchedule)


class HasLrScheduleKwargs(Params):
    """Mixin for param lrScheduleKwargs: the schedule's keyword arguments, as JSON."""

    lrScheduleKwargs: Param[str] = Param(
        Params._dummy(),
        "lrScheduleKwargs",
        "keyword arguments of lrSchedule as a JSON object, e.g. '{\"T_max\": 1000}' "
        "(TrainConfig lr_schedule_kwargs)",
        typeConverter=_json_object("lrScheduleKwargs"),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(lrScheduleKwargs=json.dumps(_DEFAULTS.lr_schedule_kwargs))

    def getLrScheduleKwargs(self) -> str:
        """Gets the value of lrScheduleKwargs (JSON text) or its default ``"{}"``."""
        return self.getOrDefault(self.lrScheduleKwargs)


class HasLrScheduleInterval(Params):
    """Mixin for param lrScheduleInterval: when the schedule steps."""

    lrScheduleInterval: Param[str] = Param(
        Params._dummy(),
        "lrScheduleInterval",
        f"step the schedule after every optimizer step or every epoch, one of "
        f"{', '.join(SCHEDULE_INTERVALS)} (TrainConfig lr_schedule_interval)",
        typeConverter=_one_of("lrScheduleInterval", SCHEDULE_INTERVALS),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(lrScheduleInterval=_DEFAULTS.lr_schedule_interval)

    def getLrScheduleInterval(self) -> str:
        """Gets the value of lrScheduleInterval or its default ``"step"``."""
        return self.getOrDefault(self.lrScheduleInterval)


class HasWarmupSteps(Params):
    """Mixin for param warmupSteps: linear learning-rate warm-up."""

    warmupSteps: Param[int] = Param(
        Params._dummy(),
        "warmupSteps",
        "optimizer steps over which the rate ramps linearly up to the schedule's (>= 0; "
        "0 = none) (TrainConfig warmup_steps)",
        typeConverter=_int_at_least("warmupSteps", 0),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(warmupSteps=_DEFAULTS.warmup_steps)

    def getWarmupSteps(self) -> int:
        """Gets the value of warmupSteps or its default 0."""
        return self.getOrDefault(self.warmupSteps)


class HasPrecision(Params):
    """Mixin for param precision: the forward and backward passes' float type."""

    precision: Param[str] = Param(
        Params._dummy(),
        "precision",
        f"training precision, one of {', '.join(PRECISIONS)}: bf16 and fp16 autocast the "
        "passes, parameters stay float32 (TrainConfig precision)",
        typeConverter=_one_of("precision", PRECISIONS),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(precision=_DEFAULTS.precision)

    def getPrecision(self) -> str:
        """Gets the value of precision or its default ``"fp32"``."""
        return self.getOrDefault(self.precision)


class HasFp16SkipLimit(Params):
    """Mixin for param fp16SkipLimit: overflowing fp16 steps tolerated in a row."""

    fp16SkipLimit: Param[int] = Param(
        Params._dummy(),
        "fp16SkipLimit",
        "with precision='fp16', consecutive steps with a non-finite loss after which the "
        "run stops (>= 1) (TrainConfig fp16_skip_limit)",
        typeConverter=_int_at_least("fp16SkipLimit", 1),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(fp16SkipLimit=_DEFAULTS.fp16_skip_limit)

    def getFp16SkipLimit(self) -> int:
        """Gets the value of fp16SkipLimit or its default."""
        return self.getOrDefault(self.fp16SkipLimit)


class HasAccumulateSteps(Params):
    """Mixin for param accumulateSteps: mini-batches per optimizer step."""

    accumulateSteps: Param[int] = Param(
        Params._dummy(),
        "accumulateSteps",
        "mini-batches whose gradients are summed before one exchange and optimizer step "
        "(>= 1) (TrainConfig accumulate_steps)",
        typeConverter=_int_at_least("accumulateSteps", 1),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(accumulateSteps=_DEFAULTS.accumulate_steps)

    def getAccumulateSteps(self) -> int:
        """Gets the value of accumulateSteps or its default 1."""
        return self.getOrDefault(self.accumulateSteps)


class HasClipGradNorm(Params):
    """Mixin for param clipGradNorm: global gradient-norm clipping."""

    clipGradNorm: Param[float] = Param(
        Params._dummy(),
        "clipGradNorm",
        "clip the averaged gradients to this global L2 norm before each step (>= 0; "
        "0 = no clipping) (TrainConfig clip_grad_norm)",
        typeConverter=_non_negative_float("clipGradNorm", "0 = no clipping"),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(clipGradNorm=_DEFAULTS.clip_grad_norm)

    def getClipGradNorm(self) -> float:
        """Gets the value of clipGradNorm or its default 0.0."""
        return self.getOrDefault(self.clipGradNorm)


class HasEarlyStopping(Params):
    """Mixin for param earlyStopping: stop when a metric stops improving, as JSON."""

    earlyStopping: Param[str] = Param(
        Params._dummy(),
        "earlyStopping",
        "early stopping as a JSON object with keys metric (required), mode ('min' or "
        "'max'), patience (epochs), min_delta, restore_best, e.g. "
        '{"metric": "accuracy", "patience": 3}; {} = off (TrainConfig early_stopping)',
        typeConverter=_checked_by_train_config(
            "earlyStopping", "early_stopping", _json_object("earlyStopping"), json.loads
        ),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(earlyStopping=json.dumps(_DEFAULTS.early_stopping))

    def getEarlyStopping(self) -> str:
        """Gets the value of earlyStopping (JSON text) or its default ``"{}"`` (off)."""
        return self.getOrDefault(self.earlyStopping)


class HasMetrics(Params):
    """Mixin for param metrics: extra validation metrics by name."""

    metrics: Param[list[str]] = Param(
        Params._dummy(),
        "metrics",
        f"extra validation metrics over the whole validation set, by name: "
        f"{', '.join(METRICS)} (e.g. 'top_k:5') (TrainConfig metrics)",
        typeConverter=_to_metric_names,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(metrics=[str(m) for m in _DEFAULTS.metrics])

    def getMetrics(self) -> list[str]:
        """Gets the value of metrics or its default ``[]``."""
        value: list[str] | None = self.getOrDefault(self.metrics)
        return list(value or [])


class HasTensorboardDir(Params):
    """Mixin for param tensorboardDir: where TensorBoard event files go."""

    tensorboardDir: Param[str] = Param(
        Params._dummy(),
        "tensorboardDir",
        "directory for per-epoch TensorBoard event files (extra sparktrain[tensorboard]); "
        "'' = off (TrainConfig tensorboard_dir)",
        typeConverter=TypeConverters.toString,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(tensorboardDir=_DEFAULTS.tensorboard_dir)

    def getTensorboardDir(self) -> str:
        """Gets the value of tensorboardDir or its default ``""`` (off)."""
        return self.getOrDefault(self.tensorboardDir)


class HasMlflowTrackingUri(Params):
    """Mixin for param mlflowTrackingUri: where the run is logged to MLflow."""

    mlflowTrackingUri: Param[str] = Param(
        Params._dummy(),
        "mlflowTrackingUri",
        "MLflow tracking URI to log the run's parameters, per-epoch metrics and model to "
        "(extra sparktrain[mlflow]); '' = off (TrainConfig mlflow_tracking_uri)",
        typeConverter=TypeConverters.toString,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(mlflowTrackingUri=_DEFAULTS.mlflow_tracking_uri)

    def getMlflowTrackingUri(self) -> str:
        """Gets the value of mlflowTrackingUri or its default ``""`` (off)."""
        return self.getOrDefault(self.mlflowTrackingUri)


class HasMlflowExperiment(Params):
    """Mixin for param mlflowExperiment: the MLflow experiment a run is logged under."""

    mlflowExperiment: Param[str] = Param(
        Params._dummy(),
        "mlflowExperiment",
        "MLflow experiment name, used with mlflowTrackingUri (TrainConfig mlflow_experiment)",
        typeConverter=TypeConverters.toString,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(mlflowExperiment=_DEFAULTS.mlflow_experiment)

    def getMlflowExperiment(self) -> str:
        """Gets the value of mlflowExperiment or its default ``"sparktrain"``."""
        return self.getOrDefault(self.mlflowExperiment)


class HasDevice(Params):
    """Mixin for param device: where each training task trains."""

    device: Param[str] = Param(
        Params._dummy(),
        "device",
        f"where each task trains, one of {', '.join(DEVICES)}: 'cuda' is the first GPU "
        "Spark assigned the task, 'auto' that GPU when there is one and CUDA works, else "
        "the CPU (TrainConfig device)",
        typeConverter=_one_of("device", DEVICES),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(device=_DEFAULTS.device)

    def getDevice(self) -> str:
        """Gets the value of device or its default ``"auto"``."""
        return self.getOrDefault(self.device)


class HasGpusPerTask(Params):
    """Mixin for param gpusPerTask: GPUs the training stage asks for per task."""

    gpusPerTask: Param[int] = Param(
        Params._dummy(),
        "gpusPerTask",
        "GPUs the training stage asks for per task with a task-level resource profile "
        "(>= 0; 0 = none asked, the application's spark.task.resource.gpu.amount applies) "
        "(TrainConfig gpus_per_task)",
        typeConverter=_int_at_least("gpusPerTask", 0),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(gpusPerTask=_DEFAULTS.gpus_per_task)

    def getGpusPerTask(self) -> int:
        """Gets the value of gpusPerTask or its default 0."""
        return self.getOrDefault(self.gpusPerTask)


class HasCommBackend(Params):
    """Mixin for param commBackend: who averages the ring/tree gradients."""

    commBackend: Param[str] = Param(
        Params._dummy(),
        "commBackend",
        f"who averages ring/tree gradients, one of {', '.join(COMM_BACKENDS)}: sparktrain's "
        "own authenticated sockets, or torch.distributed (Gloo) started from them "
        "(TrainConfig comm_backend)",
        typeConverter=_one_of("commBackend", COMM_BACKENDS),
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(commBackend=_DEFAULTS.comm_backend)

    def getCommBackend(self) -> str:
        """Gets the value of commBackend or its default ``"sparktrain"``."""
        return self.getOrDefault(self.commBackend)


class HasShardOptimizer(Params):
    """Mixin for param shardOptimizer: ZeRO-1 sharded optimizer state for ring/tree."""

    shardOptimizer: Param[bool] = Param(
        Params._dummy(),
        "shardOptimizer",
        "shard the optimizer state over the ranks (ZeRO-1: reduce-scatter the gradients, "
        "step each rank's 1/N slice, all-gather the parameters); ring/tree without "
        "compression (TrainConfig shard_optimizer)",
        typeConverter=TypeConverters.toBoolean,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(shardOptimizer=_DEFAULTS.shard_optimizer)

    def getShardOptimizer(self) -> bool:
        """Gets the value of shardOptimizer or its default ``False``."""
        return self.getOrDefault(self.shardOptimizer)


class HasDriverServicesHost(Params):
    """Mixin for param driverServicesHost: the address the driver's services listen on."""

    driverServicesHost: Param[str] = Param(
        Params._dummy(),
        "driverServicesHost",
        "an address of the driver's (under Spark Connect: the client's) host that the "
        "executors can reach, for the driver's services and, for large models under Spark "
        "Connect, transform's weights; '' = spark.driver.host or the client's address "
        "towards the Connect server (TrainConfig driver_services_host)",
        typeConverter=TypeConverters.toString,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(driverServicesHost=_DEFAULTS.driver_services_host)

    def getDriverServicesHost(self) -> str:
        """Gets the value of driverServicesHost or its default ``""`` (Spark's driver
        address, or the Connect client's)."""
        return self.getOrDefault(self.driverServicesHost)


class HasDriverServicesPorts(Params):
    """Mixin for param driverServicesPorts: the port range of the driver's services."""

    driverServicesPorts: Param[str] = Param(
        Params._dummy(),
        "driverServicesPorts",
        "the port range 'LOW-HIGH' the driver's services take (to open in a firewall); "
        "'' = any free port (TrainConfig driver_services_ports)",
        typeConverter=_checked_port_range,
    )

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(driverServicesPorts=_DEFAULTS.driver_services_ports)

    def getDriverServicesPorts(self) -> str:
        """Gets the value of driverServicesPorts or its default ``""`` (any free port)."""
        return self.getOrDefault(self.driverServicesPorts)


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
    HasFeaturesCols,
    HasFeatureShapes,
    HasFeatureDtypes,
    HasDecode,
    HasCollate,
    HasLrSchedule,
    HasLrScheduleKwargs,
    HasLrScheduleInterval,
    HasWarmupSteps,
    HasPrecision,
    HasFp16SkipLimit,
    HasAccumulateSteps,
    HasClipGradNorm,
    HasEarlyStopping,
    HasMetrics,
    HasTensorboardDir,
    HasMlflowTrackingUri,
    HasMlflowExperiment,
    HasDevice,
    HasGpusPerTask,
    HasCommBackend,
    HasShardOptimizer,
    HasDriverServicesHost,
    HasDriverServicesPorts,
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
            **self._column_options(),
            **self._loop_options(),
        )

    def _loop_options(self) -> dict[str, Any]:
        """The training loop's schedule, precision, accumulation, clipping, early
        stopping, metrics and loggers, and where and how it runs (device, GPUs, the
        gradient backend, the driver services' address) as TrainConfig keys."""
        return {
            "lr_schedule": self.getLrSchedule(),
            "lr_schedule_kwargs": json.loads(self.getLrScheduleKwargs()),
            "lr_schedule_interval": self.getLrScheduleInterval(),
            "warmup_steps": self.getWarmupSteps(),
            "precision": self.getPrecision(),
            "fp16_skip_limit": self.getFp16SkipLimit(),
            "accumulate_steps": self.getAccumulateSteps(),
            "clip_grad_norm": self.getClipGradNorm(),
            "early_stopping": json.loads(self.getEarlyStopping()),
            "metrics": self.getMetrics(),
            "tensorboard_dir": self.getTensorboardDir(),
            "mlflow_tracking_uri": self.getMlflowTrackingUri(),
            "mlflow_experiment": self.getMlflowExperiment(),
            "device": self.getDevice(),
            "gpus_per_task": self.getGpusPerTask(),
            "comm_backend": self.getCommBackend(),
            "shard_optimizer": self.getShardOptimizer(),
            "driver_services_host": self.getDriverServicesHost(),
            "driver_services_ports": self.getDriverServicesPorts(),
        }

    def _column_options(self) -> dict[str, dict[str, Any]]:
        """The per-column options as TrainConfig keys (empty tables when unset)."""
        return {
            "feature_shapes": json.loads(self.getFeatureShapes()),
            "feature_dtypes": json.loads(self.getFeatureDtypes()),
            "decode": json.loads(self.getDecode()),
            "collate": json.loads(self.getCollate()),
        }

    def _features_spec(self) -> tuple[ColumnsSpec, str]:
        """(the ``features_col`` these params describe, the param that gives it):
        ``featuresCols`` when set and non-empty, else ``featuresCol``."""
        spec = features_spec(self.getFeaturesCols())
        if spec is not None:
            return spec, "featuresCols"
        return self.getFeaturesCol(), "featuresCol"

    def _is_plain_fit(self) -> bool:
        """Only ``featuresCol`` and no per-column option: one float vector column."""
        return not self.getFeaturesCols() and not any(self._column_options().values())


class _TorchClassifierParams(_TorchParams, HasProbabilityCol, HasRawPredictionCol):
    """Params of :class:`TorchClassifier` and :class:`TorchClassificationModel`."""

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(loss="cross_entropy")


class _TorchRegressorParams(_TorchParams, HasLabelScaling):
    """Params of :class:`TorchRegressor` and :class:`TorchRegressionModel`."""

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(loss="mse")

    def _train_config(self) -> TrainConfig:
        """:meth:`_TorchParams._train_config` plus ``label_scaling``: ``labelScaling``
        applies to ``loss="mse"`` only (TrainConfig refuses it for other losses)."""
        scaling = self.getLabelScaling() and self.getLoss() == "mse"
        return super()._train_config().replace(label_scaling=scaling)
