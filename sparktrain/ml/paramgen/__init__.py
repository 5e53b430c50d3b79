"""The params of the sparktrain.ml stages as one table, and the generator of their code.

Each row of :data:`PARAMS` is one Param: the TrainConfig key it sets, what its converter
checks beyond the value's kind, and its doc. The rest comes from TrainConfig: the kind is
the field's type (a ``dict`` is stored as canonical JSON text, a ``list`` as a list of
names, ``str | Callable`` as the name), the default is :data:`ML_DEFAULTS`'s value, and the
Param's name is the key in camelCase (``batch_size`` -> ``batchSize``) unless the row
names it (``lr`` -> ``learningRate``). The params that set no TrainConfig key
(``modelFn``, ``modelKwargs``, ``featuresCols``) give their kind and default in the row;
pyspark's shared params (``featuresCol``, ``seed``...) name pyspark's mixin and keep its
Param.
:data:`STAGES` says what the classifier and the regressor change (their ``loss``).

``python -m sparktrain.ml.paramgen`` writes ``sparktrain/ml/shared_params.py`` from the
table, as pyspark's ``_shared_params_code_gen.py`` writes ``pyspark/ml/param/shared.py``:
a ``Has<Name>`` mixin per param (the Param, its default, its getter), the sets of mixins
every stage and each kind of stage has, the estimators' setters, and the ``__init__`` and
``setParams`` of TorchClassifier and TorchRegressor (pyspark's ``keyword_only`` needs each
keyword spelled out, with its default). The generated Params take their converters from
here (:func:`converter`), so each rule is written once::

    python -m sparktrain.ml.paramgen            # rewrite sparktrain/ml/shared_params.py
    python -m sparktrain.ml.paramgen --check    # exit 1 when it is stale (./dev test)
    python -m sparktrain.ml.paramgen --print    # the code on stdout, nothing written

A converter raises TypeError for a value of the wrong kind (pyspark then names the param)
and ValueError for a value of the right kind that is not allowed, naming the param (with
TrainConfig's wording where TrainConfig checks it).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple, Union, get_args, get_origin, get_type_hints

from pyspark.ml.param import Param, Params, TypeConverters
from pyspark.ml.param.shared import (
    HasFeaturesCol,
    HasLabelCol,
    HasPredictionCol,
    HasProbabilityCol,
    HasRawPredictionCol,
    HasSeed,
    HasThresholds,
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

__all__ = ["ML_DEFAULTS", "PARAMS", "STAGES", "Spec", "converter", "features_spec", "render"]

_DEFAULTS = TrainConfig()

ML_DEFAULTS = _DEFAULTS.replace(
    optimizer="adam", lr=1e-3, epochs=50, batch_size=32, label_scaling=False, feature_scaling=False
)
"""The estimators' defaults: TrainConfig's training-loop defaults (Adam at 1e-3 as
scikit-learn's MLP estimators, 50 epochs, 32 rows a step), pinned here so that the
estimators' figures do not move with TrainConfig's; see the table in docs/ml.md for why
each. The scaling keys are off: the regressor's ``labelScaling`` param turns label
scaling on, and a Pipeline standardises its features with ``StandardScaler``, MLlib's way,
so the fitted stage holds the module as trained. Estimators saved before these defaults
keep the defaults they were saved with (MLlib metadata records them)."""

TARGET = Path(__file__).resolve().parents[1] / "shared_params.py"
"""The generated file."""
_COMMAND = "python -m sparktrain.ml.paramgen"

Convert = Callable[[Any], Any]


def _same(value: Any) -> Any:
    return value


# ---------------------------------------------------------------------- kinds
@dataclass(frozen=True)
class Kind:
    """How a param's value is stored, whatever its rules."""

    stored: str
    """The Param's value type, as the generated code spells it."""
    accepts: str
    """What its setter and keyword argument take."""
    convert: Callable[[str], Convert]
    """The param's name -> the conversion of a value to ``stored`` (TypeError if it cannot)."""
    to_config: Convert = _same
    """The stored value -> the TrainConfig key's value."""
    hint: str = ""
    """What a setter's docstring adds about the value it takes."""


def _json_object(name: str) -> Convert:
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


STR = Kind("str", "str", lambda _: TypeConverters.toString)
INT = Kind("int", "int", lambda _: TypeConverters.toInt)
FLOAT = Kind("float", "float", lambda _: TypeConverters.toFloat)
BOOL = Kind("bool", "bool", lambda _: TypeConverters.toBoolean)
NAMES = Kind("list[str]", "list[str]", lambda _: TypeConverters.toListString)
FLOATS = Kind("list[float]", "list[float]", lambda _: TypeConverters.toListFloat)
JSON = Kind(
    "str", "str | dict[str, Any]", _json_object, json.loads, hint=" (a dict or JSON object text)"
)
COLUMNS = Kind(
    "list[str]",
    "list[str] | dict[str, str]",
    lambda _: _to_features_cols,
    hint=" (column names, 'argument=column' entries, or an {argument: column} dict)",
)

_SIMPLE = {str: STR, int: INT, float: FLOAT, bool: BOOL}
_PYSPARK: dict[Any, Kind] = {
    TypeConverters.toString: STR,
    TypeConverters.toInt: INT,
    TypeConverters.toListFloat: FLOATS,
}


def kind_of(hint: Any) -> Kind:
    """A TrainConfig field's type as a param's kind: a table is JSON text, a list holds
    names, a key that also takes a callable or a table (``optimizer``, ``compression``)
    takes its name or spec."""
    origin = get_origin(hint)
    if origin is dict:
        return JSON
    if origin is list:
        return NAMES
    if origin in (Union, types.UnionType) and str in get_args(hint):
        return STR
    if hint in _SIMPLE:
        return _SIMPLE[hint]
    raise TypeError(f"no param kind for a TrainConfig field of type {hint!r}")


# ---------------------------------------------------------------------- checks
# A check gets the row and the value its kind converted, and returns the value to store.
Check = Callable[["Spec", Any], Any]


def one_of(allowed: Sequence[str]) -> Check:
    def check(spec: Spec, text: str) -> str:
        if text not in allowed:
            raise ValueError(
                f"{spec.name}={text!r} is not supported; allowed values: {', '.join(allowed)}"
            )
        return text

    return check


def at_least(low: int) -> Check:
    def check(spec: Spec, number: int) -> int:
        if number < low:
            raise ValueError(f"{spec.name}={number!r} must be an integer >= {low}")
        return number

    return check


def non_negative(note: str) -> Check:
    def check(spec: Spec, number: float) -> float:
        if not number >= 0:  # also refuses NaN
            raise ValueError(f"{spec.name}={number!r} must be a number >= 0 ({note})")
        return number

    return check


def column_table(check_entry: Callable[[str, Any], object]) -> Check:
    """A JSON object of column -> value, every value passed through
    ``check_entry(column, value)``."""

    def check(spec: Spec, text: str) -> str:
        for column, entry in json.loads(text).items():
            try:
                check_entry(column, entry)
            except ValueError as exc:
                raise ValueError(f"{spec.name}: {exc}") from exc
        return text

    return check


def _positive(spec: Spec, number: float) -> float:
    if not number > 0:
        raise ValueError(f"{spec.name}={number!r} must be a number > 0")
    return number


def _fraction(spec: Spec, number: float) -> float:
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{spec.name}={number!r} is out of range: use a value in [0, 1), e.g. 0.2")
    return number


def _factory(spec: Spec, text: str) -> str:
    """``"package.module:function"``; the import itself happens at fit/transform time."""
    text = text.strip()
    module, sep, attr = text.partition(":")
    if not sep or not module or not attr:
        raise ValueError(
            f"{spec.name}={text!r} must be an importable 'package.module:function' string, "
            "e.g. 'sparktrain.models:mlp'"
        )
    return text


def _hook(column: str, value: Any) -> None:
    """A ``decode``/``collate`` entry: ``"package.module:function"``."""
    module, sep, attr = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not module.strip() or not attr.strip():
        raise ValueError(
            f"[{column!r}] = {value!r}: give an importable 'package.module:function' string"
        )


def _registered_strategy(spec: Spec, text: str) -> str:
    if not registry.is_known(text):
        registry.get(text)  # raises, listing the registered strategies
    return text


def _compression_spec(spec: Spec, text: str) -> str:
    text = text.strip()
    if not text:
        raise ValueError(f"{spec.name} must be a compression spec such as 'none'")
    return text


def _port_range(spec: Spec, text: str) -> str:
    """``"LOW-HIGH"`` (or one port, or ``""``), checked as TrainConfig checks it."""
    try:
        parse_port_range(text)
    except ConfigError as exc:
        raise ValueError(str(exc).replace(spec.key, spec.name)) from exc
    return text


def _metric_names(spec: Spec, names: list[str]) -> list[str]:
    """Validation metric names, checked as TrainConfig checks them."""
    for name in names:
        try:
            check_metric_name(name)
        except ConfigError as exc:
            # TrainConfig's message offers callables too, which a param cannot hold.
            raise ValueError(
                f"{spec.name}: {name!r} is not a metric; use one of {', '.join(METRICS)} (e.g. "
                "'top_k:5'). A callable metric needs the Trainer (TrainConfig metrics): "
                "params hold names only"
            ) from exc
    return names


def _by_config(spec: Spec, value: Any) -> Any:
    """TrainConfig's own check of the key. Used where the rule is more than a range (a
    torch class name, a table's keys), so the param and the TOML key cannot drift apart;
    the message is TrainConfig's, with the param's name in place of the key's."""
    try:
        _DEFAULTS.replace(**{spec.key: spec.kind.to_config(value)})
    except ConfigError as exc:
        message = str(exc)
        if message.startswith(spec.key):
            message = spec.name + message.removeprefix(spec.key)
        else:
            message = f"{spec.name}: {message}"
        # an example's key too: "e.g. early_stopping={...}" reads "e.g. earlyStopping={...}"
        message = message.replace(f"{spec.key}=", f"{spec.name}=")
        raise ValueError(message) from exc
    return value


# ---------------------------------------------------------------------- the table
class _NoDefault:
    def __repr__(self) -> str:
        return "NO_DEFAULT"


NO_DEFAULT: Any = _NoDefault()
"""The default of a param that has none (``modelFn``, ``weightCol``): it must be set."""
_FROM_CONFIG: Any = object()


@dataclass(frozen=True)
class Spec:
    """One Param of the stages: a row of :data:`PARAMS`."""

    name: str
    """The Param's name (camelCase, as saved in MLlib metadata)."""
    key: str
    """The TrainConfig key it sets, or ``""`` for none."""
    kind: Kind
    default: Any
    """The stored default, or :data:`NO_DEFAULT`."""
    doc: str
    check: Check | None = None
    stage: str = "all"
    """The stages that have it: ``"all"``, ``"classifier"`` or ``"regressor"``."""
    mixin: type[Params] | None = None
    """pyspark's own mixin, for its params."""

    @property
    def title(self) -> str:
        return self.name[0].upper() + self.name[1:]

    @property
    def getter(self) -> str:
        return f"get{self.title}"

    @property
    def setter(self) -> str:
        return f"set{self.title}"

    @property
    def mixin_name(self) -> str:
        return self.mixin.__name__ if self.mixin else f"Has{self.title}"

    def converter(self) -> Convert:
        """The Param's type converter: the kind's conversion, then the row's check."""
        convert = self.kind.convert(self.name)
        check = self.check
        if check is None:
            return convert
        return lambda value: check(self, convert(value))


_HINTS = get_type_hints(TrainConfig)


def config(
    key: str,
    doc: str,
    check: Check | None = None,
    *,
    name: str = "",
    default: Any = _FROM_CONFIG,
    stage: str = "all",
    kind: Kind | None = None,
) -> Spec:
    """The row of a param that sets TrainConfig's ``key``: its kind is the field's, its
    default :data:`ML_DEFAULTS`'s and its name ``key`` in camelCase, unless given."""
    head, *rest = key.split("_")
    name = name or head + "".join(part.title() for part in rest)
    spec = Spec(name, key, kind or kind_of(_HINTS[key]), NO_DEFAULT, doc, check, stage)
    default = getattr(ML_DEFAULTS, key) if default is _FROM_CONFIG else default
    return replace(spec, default=spec.converter()(default))  # stored as if set


def own(
    name: str, kind: Kind, doc: str, *, check: Check | None = None, default: Any = NO_DEFAULT
) -> Spec:
    """The row of a param that sets no TrainConfig key."""
    spec = Spec(name, "", kind, NO_DEFAULT, doc, check)
    return spec if default is NO_DEFAULT else replace(spec, default=spec.converter()(default))


def shared(mixin: type[Params], *, key: str = "", stage: str = "all") -> Spec:
    """The row of one of pyspark's shared params: its Param, and its default unless it
    sets TrainConfig's ``key`` (then :data:`ML_DEFAULTS`'s)."""
    (param,) = (p for p in vars(mixin).values() if isinstance(p, Param))
    instance = mixin()
    default = instance.getOrDefault(param.name) if instance.hasDefault(param.name) else NO_DEFAULT
    default = getattr(ML_DEFAULTS, key) if key else default
    kind = _PYSPARK[param.typeConverter]
    return Spec(param.name, key, kind, default, param.doc, stage=stage, mixin=mixin)


# Every param, in the order of the estimators' keyword arguments.
PARAMS: tuple[Spec, ...] = (
    shared(HasFeaturesCol),
    shared(HasLabelCol),
    shared(HasPredictionCol),
    shared(HasProbabilityCol, stage="classifier"),
    shared(HasRawPredictionCol, stage="classifier"),
    shared(HasThresholds, stage="classifier"),
    shared(HasWeightCol),
    own(
        "modelFn",
        STR,
        "importable model factory 'package.module:function' returning a torch.nn.Module; "
        "it must be importable on the driver and the executors",
        check=_factory,
    ),
    own(
        "modelKwargs",
        JSON,
        "keyword arguments for modelFn as a JSON object (a dict is accepted and stored as JSON)",
        default={},
    ),
    config("loss", f"training loss, one of {', '.join(LOSSES)}", one_of(LOSSES)),
    config(
        "label_scaling",
        "standardise the label with the training rows' mean and standard deviation "
        "(computed on the driver) while training, and bring predictions back to label "
        "units (prediction = output * std + mean); loss='mse' only (TrainConfig "
        "label_scaling)",
        default=True,  # TrainConfig's "auto" is True for mse, which the regressor trains
        stage="regressor",
        kind=BOOL,  # TrainConfig also takes "auto"; a param is true or false, as saved
    ),
    config("optimizer", f"optimizer, one of {', '.join(OPTIMIZERS)}", one_of(OPTIMIZERS)),
    config(
        "optimizer_kwargs", "extra optimizer arguments as a JSON object, e.g. '{\"momentum\": 0.9}'"
    ),
    config("lr", "learning rate (> 0)", _positive, name="learningRate"),
    config("batch_size", "mini-batch size per worker (>= 1)", at_least(1)),
    config(
        "epochs", "number of passes over the training data (>= 1)", at_least(1), name="maxEpochs"
    ),
    config(
        "num_workers",
        "number of training workers (Spark tasks, one free slot each; >= 1)",
        at_least(1),
    ),
    config(
        "strategy",
        "aggregation strategy: a registered name (sparktrain.strategies.names(): "
        f"{', '.join(registry.names())}, or a plug-in)",
        _registered_strategy,
    ),
    config(
        "compression",
        "gradient compression spec (see TrainConfig.compression), 'none' for none",
        _compression_spec,
    ),
    config(
        "ps_mode",
        f"parameter server mode for strategy='ps', one of {', '.join(PS_MODES)}",
        one_of(PS_MODES),
    ),
    shared(HasSeed, key="seed"),
    config(
        "validation_fraction",
        "fraction of each partition held out to measure the per-epoch metric, in [0, 1)",
        _fraction,
    ),
    config(
        "data_memory_mb",
        "MiB a worker may hold its partition's rows in; a larger partition spills once to "
        "a memory-mapped file under spark.local.dir (0 spills every row)",
        name="dataMemoryInMB",
    ),
    own(
        "featuresCols",
        COLUMNS,
        "model input columns; when set and non-empty it overrides featuresCol. Column "
        "names ['a', 'b'] call model(a, b); 'argument=column' entries ['user=user_id', "
        "'item=item_id'] call model(user=..., item=...) (not mixed; a {argument: column} "
        "dict is accepted). Integer columns arrive as int64, floats as float32",
        default=[],
    ),
    config(
        "feature_shapes",
        "row shape per input column (by column name or model argument) as a JSON object, "
        "e.g. '{\"image\": [1, 28, 28]}'; [-1] is a variable-length array, padded per batch "
        "with a mask (TrainConfig feature_shapes)",
        column_table(check_shape),
    ),
    config(
        "feature_dtypes",
        'dtype per input column as a JSON object, e.g. \'{"x": "float64"}\': float32 '
        "(floats' default), float64, float16, bfloat16 or int64 (integers' default) "
        "(TrainConfig feature_dtypes)",
        column_table(check_dtype),
    ),
    config(
        "decode",
        "per binary input column, an importable 'package.module:function' turning one "
        "value (bytes) into an array, as a JSON object (TrainConfig decode)",
        column_table(_hook),
    ),
    config(
        "collate",
        "per variable-length or binary input column, an importable "
        "'package.module:function' batching its rows into a tensor or a (tensor, mask) "
        "pair, as a JSON object (TrainConfig collate)",
        column_table(_hook),
    ),
    config(
        "lr_schedule",
        "learning-rate schedule: a torch.optim.lr_scheduler class by name "
        "('CosineAnnealingLR', 'StepLR', 'OneCycleLR', 'ReduceLROnPlateau', ...) or 'none' "
        "for a constant rate (TrainConfig lr_schedule)",
        _by_config,
    ),
    config(
        "lr_schedule_kwargs",
        "keyword arguments of lrSchedule as a JSON object, e.g. '{\"T_max\": 1000}' "
        "(TrainConfig lr_schedule_kwargs)",
    ),
    config(
        "lr_schedule_interval",
        f"step the schedule after every optimizer step or every epoch, one of "
        f"{', '.join(SCHEDULE_INTERVALS)} (TrainConfig lr_schedule_interval)",
        one_of(SCHEDULE_INTERVALS),
    ),
    config(
        "warmup_steps",
        "optimizer steps over which the rate ramps linearly up to the schedule's (>= 0; "
        "0 = none) (TrainConfig warmup_steps)",
        at_least(0),
    ),
    config(
        "precision",
        f"training precision, one of {', '.join(PRECISIONS)}: bf16 and fp16 autocast the "
        "passes, parameters stay float32 (TrainConfig precision)",
        one_of(PRECISIONS),
    ),
    config(
        "fp16_skip_limit",
        "with precision='fp16', consecutive steps with a non-finite loss after which the "
        "run stops (>= 1) (TrainConfig fp16_skip_limit)",
        at_least(1),
    ),
    config(
        "accumulate_steps",
        "mini-batches whose gradients are summed before one exchange and optimizer step "
        "(>= 1) (TrainConfig accumulate_steps)",
        at_least(1),
    ),
    config(
        "clip_grad_norm",
        "clip the averaged gradients to this global L2 norm before each step (>= 0; "
        "0 = no clipping) (TrainConfig clip_grad_norm)",
        non_negative("0 = no clipping"),
    ),
    config(
        "early_stopping",
        "early stopping as a JSON object with keys metric (required), mode ('min' or "
        "'max'), patience (epochs), min_delta, restore_best, e.g. "
        '{"metric": "accuracy", "patience": 3}; {} = off (TrainConfig early_stopping)',
        _by_config,
    ),
    config(
        "metrics",
        f"extra validation metrics over the whole validation set, by name: "
        f"{', '.join(METRICS)} (e.g. 'top_k:5') (TrainConfig metrics)",
        _metric_names,
    ),
    config(
        "tensorboard_dir",
        "directory for per-epoch TensorBoard event files (extra sparktrain[tensorboard]); "
        "'' = off (TrainConfig tensorboard_dir)",
    ),
    config(
        "mlflow_tracking_uri",
        "MLflow tracking URI to log the run's parameters, per-epoch metrics and model to "
        "(extra sparktrain[mlflow]); '' = off (TrainConfig mlflow_tracking_uri)",
    ),
    config(
        "mlflow_experiment",
        "MLflow experiment name, used with mlflowTrackingUri (TrainConfig mlflow_experiment)",
    ),
    config(
        "device",
        f"where each task trains, one of {', '.join(DEVICES)}: 'cuda' is the first GPU "
        "Spark assigned the task, 'auto' that GPU when there is one and CUDA works, else "
        "the CPU (TrainConfig device)",
        one_of(DEVICES),
    ),
    config(
        "gpus_per_task",
        "GPUs the training stage asks for per task with a task-level resource profile "
        "(>= 0; 0 = none asked, the application's spark.task.resource.gpu.amount applies) "
        "(TrainConfig gpus_per_task)",
        at_least(0),
    ),
    config(
        "comm_backend",
        f"who averages ring/tree gradients, one of {', '.join(COMM_BACKENDS)}: sparktrain's "
        "own authenticated sockets, or torch.distributed (Gloo) started from them "
        "(TrainConfig comm_backend)",
        one_of(COMM_BACKENDS),
    ),
    config(
        "shard_optimizer",
        "shard the optimizer state over the ranks (ZeRO-1: reduce-scatter the gradients, "
        "step each rank's 1/N slice, all-gather the parameters); ring/tree without "
        "compression (TrainConfig shard_optimizer)",
    ),
    config(
        "driver_services_host",
        "an address of the driver's (under Spark Connect: the client's) host that the "
        "executors can reach, for the driver's services and, for large models under Spark "
        "Connect, transform's weights; '' = spark.driver.host or the client's address "
        "towards the Connect server (TrainConfig driver_services_host)",
    ),
    config(
        "driver_services_ports",
        "the port range 'LOW-HIGH' the driver's services take (to open in a firewall); "
        "'' = any free port (TrainConfig driver_services_ports)",
        _port_range,
    ),
)

BY_NAME = {spec.name: spec for spec in PARAMS}
if len(BY_NAME) != len(PARAMS):
    raise AssertionError("PARAMS names a param twice")


class Stage(NamedTuple):
    """A kind of stage: its estimator class, and its defaults that differ from the rows'."""

    estimator: str
    defaults: dict[str, Any]


STAGES = {
    "classifier": Stage("TorchClassifier", {"loss": "cross_entropy"}),
    "regressor": Stage("TorchRegressor", {"loss": "mse"}),
}


def stage_params(stage: str) -> list[Spec]:
    """The rows of the params a stage of this kind has, in keyword order."""
    return [spec for spec in PARAMS if spec.stage in ("all", stage)]


def stage_defaults(stage: str) -> dict[str, Any]:
    """A kind of stage's own defaults, stored as the params store them."""
    return {
        name: BY_NAME[name].converter()(value) for name, value in STAGES[stage].defaults.items()
    }


def converter(name: str) -> Convert:
    """The type converter of the param ``name`` (what ``shared_params.py`` gives its Params).

    A name that is no row (a stale ``shared_params.py``) gets a converter that refuses
    every value, so that the package still imports and the file can be regenerated."""
    spec = BY_NAME.get(name)
    if spec is not None:
        return spec.converter()

    def stale(value: Any) -> Any:
        raise RuntimeError(
            f"param {name!r} is no row of sparktrain.ml.paramgen.PARAMS: regenerate "
            f"sparktrain/ml/shared_params.py with {_COMMAND}"
        )

    return stale


# ---------------------------------------------------------------------- the generator
# The code is written on long lines and laid out by `ruff format`; only strings and
# docstrings, which it does not wrap, are wrapped here.
_HEADER = f'''# generated by `{_COMMAND}` from its PARAMS; do not edit
"""The ``Has<Name>`` mixins, setters and keyword arguments of the sparktrain.ml
stages, one per row of :data:`sparktrain.ml.paramgen.PARAMS` (see there).

Regenerate with ``{_COMMAND}``; ``--check`` (run by ``./dev test``) fails
when this file is stale."""

from __future__ import annotations

from typing import Any, Self

from pyspark import keyword_only
from pyspark.ml.base import _PredictorParams
from pyspark.ml.classification import _ProbabilisticClassifierParams
from pyspark.ml.param import Param, Params
from pyspark.ml.param.shared import {{shared}}

from sparktrain.ml.paramgen import converter

__all__ = [{{names}}]
'''

_MIXIN = """
class {cls}(Params):
    {doc}

    {name}: Param[{stored}] = Param(
        Params._dummy(), {name!r}, {literal}, typeConverter=converter({name!r})
    )
{init}
    def {getter}(self) -> {stored}:
        {getter_doc}
        {body}
"""

_INIT = """
    def __init__(self) -> None:
        super().__init__()
        self._setDefault({defaults})
"""

_SETTER = """
    def {setter}(self, value: {accepts}) -> Self:
        {doc}
        return self._set({name}=value)
"""

_KEYWORDS = '''
class _{estimator}Keywords(Params):
    {doc}

    _input_kwargs: dict[str, Any]

    @keyword_only
    def __init__(self, *, {keywords}) -> None:
        super().__init__()
        self._set(**self._input_kwargs)

    @keyword_only
    def setParams(self, *, {keywords}) -> Self:
        """Sets params for this {estimator} (only the ones passed)."""
        return self._set(**self._input_kwargs)
{setters}'''


def _literal(text: str) -> str:
    """``text`` as implicitly concatenated string literals short enough for a line, cut
    after spaces."""
    parts: list[str] = []
    for word in re.findall(r"\S+\s*", text) or [""]:
        if parts and len(repr(parts[-1] + word)) <= 88:
            parts[-1] += word
        else:
            parts.append(word)
    return " ".join(map(repr, parts))


def _docstring(text: str, indent: int) -> str:
    """A docstring of ``text``, wrapped to the line length at ``indent`` spaces."""
    if '"""' in text or "\\" in text or text.endswith('"'):
        raise ValueError(f"cannot put {text!r} in a docstring")
    lines = textwrap.wrap(text, 96 - indent, break_long_words=False, break_on_hyphens=False)
    return '"""' + ("\n" + " " * indent).join(lines) + '"""'


def _defaults(values: dict[str, Any]) -> str:
    return _INIT.format(defaults=", ".join(f"{k}={v!r}" for k, v in values.items()))


def _mixin(spec: Spec) -> str:
    named = not spec.key or f"(TrainConfig {spec.key})" in spec.doc
    what = "" if named else f" (TrainConfig ``{spec.key}``)"
    value = f"self.getOrDefault(self.{spec.name})"
    if spec.kind.stored.startswith("list"):
        body = f"value: {spec.kind.stored} | None = {value}\n        return list(value or [])"
    else:
        body = f"return {f'bool({value})' if spec.kind is BOOL else value}"
    if spec.default is NO_DEFAULT:
        init, got = "", f"Gets the value of {spec.name} (it has no default: set it)."
    else:
        init = _defaults({spec.name: spec.default})
        shown = f'"{spec.default}"' if isinstance(spec.default, str) else repr(spec.default)
        got = f"Gets the value of {spec.name} or its default ``{shown}``."
    return _MIXIN.format(
        cls=spec.mixin_name,
        doc=_docstring(f"Mixin for param {spec.name}{what}: {spec.doc}.", 4),
        name=spec.name,
        stored=spec.kind.stored,
        literal=_literal(spec.doc),
        init=init,
        getter=spec.getter,
        getter_doc=_docstring(got, 8),
        body=body,
    )


def _setters(specs: list[Spec]) -> str:
    return "".join(
        _SETTER.format(
            setter=spec.setter,
            accepts=spec.kind.accepts,
            doc=_docstring(f"Sets the value of :py:attr:`{spec.name}`{spec.kind.hint}.", 8),
            name=spec.name,
        )
        for spec in specs
    )


def _mixins(name: str, bases: list[str], doc: str, defaults: dict[str, Any]) -> str:
    init = _defaults(defaults) if defaults else ""
    return f"\n\nclass {name}({', '.join(bases)}):\n    {_docstring(doc, 4)}\n{init}"


def _keywords(stage: str) -> str:
    estimator = STAGES[stage].estimator
    keywords = []
    for spec in stage_params(stage):
        default = stage_defaults(stage).get(spec.name, spec.default)
        if default is NO_DEFAULT or isinstance(default, list):  # no mutable defaults
            keywords.append(f"{spec.name}: {spec.kind.accepts} | None = None")
        else:
            keywords.append(f"{spec.name}: {spec.kind.accepts} = {default!r}")
    doc = (
        f"{estimator}'s keyword arguments (pyspark's keyword_only needs them spelled out, "
        "with their defaults), and the setters of its own params."
    )
    return _KEYWORDS.format(
        estimator=estimator,
        doc=_docstring(doc, 4),
        keywords=", ".join(keywords),
        setters=_setters([spec for spec in PARAMS if spec.stage == stage]),
    )


# pyspark's predictor params in the order of their MLlib bases' MRO
# (_ProbabilisticClassifierParams, _ClassifierParams, _PredictorParams): the stages
# subclass those bases, so the generated mixins list them in that order first
_MLLIB_ORDER = (
    "HasProbabilityCol",
    "HasThresholds",
    "HasRawPredictionCol",
    "HasLabelCol",
    "HasFeaturesCol",
    "HasPredictionCol",
)


def _mllib_first(names: list[str]) -> list[str]:
    """``names`` with MLlib's predictor mixins first, in :data:`_MLLIB_ORDER`, after the
    private pyspark class that groups them (``_PredictorParams`` for the stages' common
    params, ``_ProbabilisticClassifierParams`` for the classifier's): a stage that is
    also a pyspark ``PredictionModel`` / ``ProbabilisticClassificationModel`` then has a
    method resolution order."""
    first = [n for n in _MLLIB_ORDER if n in names]
    group = "_PredictorParams" if "HasLabelCol" in first else "_ProbabilisticClassifierParams"
    return [group, *first] + [n for n in names if n not in first]


def render() -> str:
    """``shared_params.py`` as :func:`main` writes it, before ``ruff format``."""
    generated = [spec for spec in PARAMS if spec.mixin is None]
    pyspark = sorted(spec.mixin_name for spec in PARAMS if spec.mixin is not None)
    names = sorted(spec.mixin_name for spec in generated)
    out = [_HEADER.format(shared=", ".join(pyspark), names=", ".join(map(repr, names)))]
    out += [_mixin(spec) for spec in generated]
    out.append(
        _mixins(
            "_TorchParamsBase",
            _mllib_first([spec.mixin_name for spec in stage_params("all")]),
            "The params every sparktrain.ml stage has (TorchEstimator's and TorchModel's); "
            "pyspark's that set a TrainConfig key default to TrainConfig's.",
            {spec.name: spec.default for spec in PARAMS if spec.mixin and spec.key},
        )
    )
    for stage, (estimator, _) in STAGES.items():
        extra = [spec.mixin_name for spec in PARAMS if spec.stage == stage]
        doc = f"The params of {estimator} and its model, with their defaults."
        out.append(
            _mixins(
                f"_{estimator}ParamsBase",
                _mllib_first([*extra, "_TorchParamsBase"])
                if set(extra) <= set(_MLLIB_ORDER)
                else ["_TorchParamsBase", *extra],
                doc,
                stage_defaults(stage),
            )
        )
    out.append(
        "\n\nclass _TorchEstimatorSetters(Params):\n"
        '    """The setters of the estimators\' params (a fitted model sets few)."""\n'
        + _setters(stage_params("all"))
    )
    out += [_keywords(stage) for stage in STAGES]
    return "\n".join(out)


def formatted(source: str) -> str:
    """``source`` as ``ruff format`` leaves it, with the project's settings."""
    command = [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(TARGET), "-"]
    try:
        done = subprocess.run(command, input=source, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise SystemExit(f"{_COMMAND}: cannot run ruff ({exc})") from exc
    if done.returncode != 0:
        raise SystemExit(
            f"{_COMMAND}: ruff format failed (ruff comes with sparktrain[test]):\n"
            f"{done.stderr.strip()}"
        )
    return done.stdout


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=_COMMAND, description=__doc__)
    parser.add_argument("--out", type=Path, default=TARGET, help=f"default {TARGET}")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    mode.add_argument("--print", action="store_true", help="print the code, write nothing")
    args = parser.parse_args(argv)
    path: Path = args.out
    if path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())  # as the messages show it
    text = formatted(render())
    if args.print:
        sys.stdout.write(text)
        return 0
    if args.check:
        stale = not path.exists() or path.read_text() != text
        print(f"{path}: generated params are {'STALE' if stale else 'up to date'}")
        if stale:
            print(f"regenerate them with: {_COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    path.write_text(text)
    print(f"{path}: regenerated from sparktrain.ml.paramgen.PARAMS")
    return 0
