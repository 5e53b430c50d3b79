"""sparktrain.ml params without Spark: defaults, converters, copy semantics, config mapping,
the weights format; featuresCols and the per-column options (forms, precedence, errors),
metadata saved before them, and the typed transform's batches; labelScaling (mapping,
un-scaled predictions, metadata saved before it); the training loop's params (schedule,
precision, accumulation, clipping, early stopping, metrics, loggers: defaults, mapping,
errors, metadata saved before them)."""

from __future__ import annotations

import io
import json
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from pyspark.ml.tuning import ParamGridBuilder
from pyspark.ml.util import DefaultParamsReader
from torch import nn

from sparktrain.builders import LabelScaled
from sparktrain.config import TrainConfig
from sparktrain.data.columns import BINARY, DENSE, RAGGED, Column, Layout
from sparktrain.errors import ConfigError, DataError
from sparktrain.ml import (
    TorchClassificationModel,
    TorchClassifier,
    TorchRegressionModel,
    TorchRegressor,
)
from sparktrain.ml.model import _InferencePlan, layout_width, trained_module
from sparktrain.ml.params import ML_DEFAULTS
from sparktrain.ml.persistence import _names_no_label_scaling, saved_label_stats, saved_layout
from sparktrain.result import state_from_bytes, state_to_bytes

OWN_PARAMS = {
    "modelFn",
    "modelKwargs",
    "loss",
    "optimizer",
    "optimizerKwargs",
    "learningRate",
    "batchSize",
    "maxEpochs",
    "numWorkers",
    "strategy",
    "compression",
    "psMode",
    "seed",
    "validationFraction",
    "dataMemoryInMB",
    "featuresCols",
    "featureShapes",
    "featureDtypes",
    "decode",
    "collate",
}
# the training loop's params and the TrainConfig key each one sets
LOOP_PARAMS = {
    "lrSchedule": "lr_schedule",
    "lrScheduleKwargs": "lr_schedule_kwargs",
    "lrScheduleInterval": "lr_schedule_interval",
    "warmupSteps": "warmup_steps",
    "precision": "precision",
    "fp16SkipLimit": "fp16_skip_limit",
    "accumulateSteps": "accumulate_steps",
    "clipGradNorm": "clip_grad_norm",
    "earlyStopping": "early_stopping",
    "metrics": "metrics",
    "tensorboardDir": "tensorboard_dir",
    "mlflowTrackingUri": "mlflow_tracking_uri",
    "mlflowExperiment": "mlflow_experiment",
}
OWN_PARAMS |= set(LOOP_PARAMS)
# issue 19's placement params (tests/unit/test_ml_placement_params.py)
OWN_PARAMS |= {"device", "gpusPerTask", "commBackend", "driverServicesHost", "driverServicesPorts"}
# issue 20's sharded optimizer state (tests/unit/test_ml_placement_params.py)
OWN_PARAMS |= {"shardOptimizer"}
# the params added with typed inputs: metadata saved before them lacks them
TYPED_PARAMS = ("featuresCols", "featureShapes", "featureDtypes", "decode", "collate")
STANDARD = {"featuresCol", "labelCol", "predictionCol", "weightCol"}


def test_param_names_follow_mllib() -> None:
    clf_names = {p.name for p in TorchClassifier().params}
    reg_names = {p.name for p in TorchRegressor().params}
    assert clf_names == OWN_PARAMS | STANDARD | {"probabilityCol", "rawPredictionCol", "thresholds"}
    assert reg_names == OWN_PARAMS | STANDARD | {"labelScaling"}
    assert {p.name for p in TorchClassificationModel().params} == clf_names
    assert {p.name for p in TorchRegressionModel().params} == reg_names
    assert "learningRate" in TorchClassifier().explainParams()


def test_defaults_train_tabular_data_and_the_rest_come_from_train_config() -> None:
    cfg = TrainConfig()
    clf = TorchClassifier(modelFn="sparktrain.models:digits_mlp")
    reg = TorchRegressor(modelFn="sparktrain.models:mlp")
    # the estimators' own defaults (docs/ml.md: the table and why)
    for estimator in (clf, reg):
        assert estimator.getOptimizer() == ML_DEFAULTS.optimizer == "adam"
        assert estimator.getLearningRate() == ML_DEFAULTS.lr == 0.001
        assert estimator.getMaxEpochs() == ML_DEFAULTS.epochs == 50
        assert estimator.getBatchSize() == ML_DEFAULTS.batch_size == 32
        trained = estimator._train_config()
        assert (trained.optimizer, trained.lr, trained.epochs, trained.batch_size) == (
            "adam",
            0.001,
            50,
            32,
        )
    assert reg.getLabelScaling() is True and reg._train_config().label_scaling is True
    assert clf._train_config().label_scaling is False and not clf.hasParam("labelScaling")
    # every other knob is TrainConfig's
    assert clf.getNumWorkers() == cfg.num_workers
    assert clf.getStrategy() == cfg.strategy
    assert clf.getCompression() == cfg.compression
    assert clf.getPsMode() == cfg.ps_mode
    assert clf.getSeed() == cfg.seed == 0  # not pyspark's per-process hash of the class name
    assert clf.getValidationFraction() == cfg.validation_fraction
    assert clf.getDataMemoryInMB() == cfg.data_memory_mb == 512
    assert clf.getModelKwargs() == "{}" and clf.getOptimizerKwargs() == "{}"
    assert clf.getLoss() == "cross_entropy" and TorchRegressor().getLoss() == "mse"
    assert clf.getFeaturesCol() == "features" and clf.getLabelCol() == "label"
    assert clf.getProbabilityCol() == "probability"
    assert clf.getRawPredictionCol() == "rawPrediction"
    assert not clf.isDefined(clf.weightCol)
    bare = TorchClassifier()
    assert not bare.isDefined(bare.modelFn)


def test_params_map_onto_train_config() -> None:
    clf = TorchClassifier(
        modelFn="sparktrain.models:mlp",
        optimizer="sgd",
        optimizerKwargs={"momentum": 0.9},
        learningRate=0.5,
        batchSize=7,
        maxEpochs=3,
        numWorkers=1,
        strategy="tree",
        psMode="ssp",
        seed=11,
        validationFraction=0.2,
        dataMemoryInMB=64,
    )
    cfg = clf._train_config()
    assert cfg.data_memory_mb == 64.0
    assert (cfg.lr, cfg.batch_size, cfg.epochs, cfg.num_workers) == (0.5, 7, 3, 1)
    assert (cfg.strategy, cfg.ps_mode, cfg.seed, cfg.validation_fraction) == (
        "tree",
        "ssp",
        11,
        0.2,
    )
    assert cfg.optimizer_kwargs == {"momentum": 0.9} and cfg.loss == "cross_entropy"
    assert TorchRegressor()._train_config().loss == "mse"


def test_converters_coerce_and_refuse() -> None:
    clf = TorchClassifier(learningRate=1, batchSize=64.0)
    assert clf.getLearningRate() == 1.0 and isinstance(clf.getLearningRate(), float)
    assert clf.getBatchSize() == 64 and isinstance(clf.getBatchSize(), int)
    kwargs = TorchClassifier(modelKwargs={"out_features": 10, "hidden": [32]}).getModelKwargs()
    assert kwargs == json.dumps({"hidden": [32], "out_features": 10}, sort_keys=True)
    assert TorchClassifier(modelKwargs=kwargs).getModelKwargsDict() == {
        "hidden": [32],
        "out_features": 10,
    }
    with pytest.raises(ValueError, match="learningRate"):
        TorchClassifier(learningRate=0)
    with pytest.raises(TypeError, match="batchSize"):
        TorchClassifier(batchSize=2.5)
    with pytest.raises(ValueError, match="maxEpochs"):
        TorchClassifier().setMaxEpochs(0)
    with pytest.raises(ValueError, match="strategy='bogus'.*ring"):
        TorchClassifier(strategy="bogus")
    with pytest.raises(ValueError, match="psMode"):
        TorchClassifier(psMode="eventually")
    with pytest.raises(ValueError, match="loss"):
        TorchClassifier(loss="hinge")
    with pytest.raises(ValueError, match="package.module:function"):
        TorchClassifier(modelFn="sparktrain.models.mlp")
    with pytest.raises(ValueError, match="JSON object"):
        TorchClassifier(modelKwargs="[1, 2]")
    with pytest.raises(ValueError, match="not valid JSON"):
        TorchClassifier(optimizerKwargs="{momentum: 0.9}")
    with pytest.raises(ValueError, match="validationFraction"):
        TorchClassifier(validationFraction=1.0)
    with pytest.raises(TypeError):
        TorchClassifier(modelFn="x:y", bogus=1)  # type: ignore[call-arg]


def test_set_params_only_sets_what_is_passed() -> None:
    clf = TorchClassifier(modelFn="sparktrain.models:mlp", maxEpochs=4)
    clf.setParams(learningRate=0.2)
    assert clf.getMaxEpochs() == 4 and clf.getLearningRate() == 0.2
    assert not clf.isSet(clf.batchSize)
    assert clf.setStrategy("tree").setCompression("none") is clf


def test_copy_with_extra_params_leaves_the_original_alone() -> None:
    clf = TorchClassifier(modelFn="sparktrain.models:mlp", learningRate=0.1, maxEpochs=10)
    other = clf.copy({clf.learningRate: 0.5, clf.strategy: "tree"})
    assert other.uid == clf.uid and other is not clf
    assert other.getLearningRate() == 0.5 and other.getStrategy() == "tree"
    assert clf.getLearningRate() == 0.1 and clf.getStrategy() == "ring"
    other.setMaxEpochs(2)
    assert clf.getMaxEpochs() == 10


def test_param_grid_values_go_through_converters() -> None:
    clf = TorchClassifier(modelFn="sparktrain.models:mlp")
    grid = (
        ParamGridBuilder()
        .addGrid(clf.learningRate, [1, 0.01])
        .addGrid(clf.strategy, ["ring", "tree"])
        .addGrid(clf.compression, ["none"])
        .build()
    )
    assert len(grid) == 4
    copies = [clf.copy(m) for m in grid]
    assert Counter((c.getLearningRate(), c.getStrategy()) for c in copies) == Counter(
        {(1.0, "ring"): 1, (1.0, "tree"): 1, (0.01, "ring"): 1, (0.01, "tree"): 1}
    )
    assert all(isinstance(c.getLearningRate(), float) for c in copies)


def test_model_copy_shares_weights_and_keeps_params_apart() -> None:
    model = TorchClassificationModel()._set_state(b"weights", num_features=64, num_outputs=10)
    model._set(modelFn="sparktrain.models:digits_mlp")
    other = model.copy({model.predictionCol: "pred"})
    assert other._state_bytes == b"weights" and other.numFeatures == 64 and other.numClasses == 10
    assert other.getPredictionCol() == "pred" and model.getPredictionCol() == "prediction"
    assert not model.hasSummary
    with pytest.raises(RuntimeError, match="summary"):
        _ = model.summary


def test_fit_refuses_unsupported_settings_before_spark() -> None:
    with pytest.raises(ConfigError, match="set modelFn"):
        TorchClassifier()._resolve()
    with pytest.raises(
        ConfigError, match="TorchRegressor does not train with loss='cross_entropy'"
    ):
        TorchRegressor(modelFn="sparktrain.models:mlp", loss="cross_entropy")._resolve()
    with pytest.raises(ConfigError, match="TorchClassifier does not train with loss='mse'"):
        TorchClassifier(modelFn="sparktrain.models:mlp", loss="mse")._resolve()


def test_weight_col_is_accepted_and_copied_to_the_model() -> None:
    clf = TorchClassifier(modelFn="sparktrain.models:mlp", weightCol="w")
    clf._resolve()  # sample weights are supported: no ConfigError
    assert clf.getWeightCol() == "w"
    assert clf.copy().getWeightCol() == "w"
    assert TorchRegressor(modelFn="sparktrain.models:mlp").setWeightCol("v").getWeightCol() == "v"


def test_weights_round_trip_and_refuse_arbitrary_pickles() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    state = state_from_bytes(state_to_bytes(module.state_dict()))
    assert state.keys() == module.state_dict().keys()
    for name, tensor in module.state_dict().items():
        assert torch.equal(state[name], tensor) and state[name].dtype == tensor.dtype
    buffer = io.BytesIO()
    torch.save({"weights": Counter(a=1)}, buffer)  # a pickled non-tensor object
    with pytest.raises(DataError, match="not a readable torch weights file|state_dict"):
        state_from_bytes(buffer.getvalue())


# ---------------------------------------------------------------------- typed inputs
def test_features_cols_forms_and_precedence_over_features_col() -> None:
    clf = TorchClassifier(modelFn="sparktrain.models:mlp", featuresCol="x")
    assert clf.getFeaturesCols() == [] and clf._features_spec() == ("x", "featuresCol")
    assert clf._is_plain_fit()
    # column names: model(a, b), in order
    assert clf.setFeaturesCols(["a", "b"]) is clf
    assert clf._features_spec() == (["a", "b"], "featuresCols") and not clf._is_plain_fit()
    # 'argument=column' entries, or a dict: model(user=..., item=...)
    clf.setFeaturesCols(["user = user_id", "item=item_id"])
    assert clf.getFeaturesCols() == ["user = user_id", "item=item_id"]
    assert clf._features_spec() == ({"user": "user_id", "item": "item_id"}, "featuresCols")
    keyword = TorchClassifier(featuresCols={"user": "user_id", "item": "item_id"})
    assert keyword.getFeaturesCols() == ["user=user_id", "item=item_id"]  # JSON-able metadata
    assert keyword._features_spec()[0] == {"user": "user_id", "item": "item_id"}
    # set empty, featuresCol is back
    assert clf.setFeaturesCols([])._features_spec() == ("x", "featuresCol")
    assert TorchRegressor(featuresCols=None)._features_spec() == ("features", "featuresCol")
    # the model has it too, and copies keep it apart
    model = TorchClassificationModel().setFeaturesCols({"user": "u"})
    assert model.copy({model.featuresCols: ["a"]}).getFeaturesCols() == ["a"]
    assert model.getFeaturesCols() == ["user=u"]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (["user=user_id", "item_id"], ValueError, "mixes plain column names"),
        (["a", "a"], ValueError, "names a column twice"),
        (["user=a", "user=b"], ValueError, "argument 'user' twice"),
        (["1st=a"], ValueError, "'1st' is not a Python identifier"),
        (["user="], ValueError, "names no column"),
        (["a", ""], ValueError, "empty column name"),
        ("a,b", TypeError, "featuresCols"),
        ({"user": 3}, TypeError, "featuresCols"),
    ],
)
def test_features_cols_refuses_malformed_values(value, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        TorchClassifier(featuresCols=value)


def test_column_options_map_onto_train_config() -> None:
    clf = TorchClassifier(
        modelFn="sparktrain.models:mlp",
        featureShapes={"image": [1, 8, 8], "tokens": [-1]},
        featureDtypes='{"x": "float64"}',
        decode={"image": "mypkg.io:decode_png"},
    ).setCollate({"tokens": "mypkg.io:pack"})
    assert clf.getFeatureShapes() == json.dumps(
        {"image": [1, 8, 8], "tokens": [-1]}, sort_keys=True
    )
    cfg = clf._train_config()
    assert cfg.feature_shapes == {"image": [1, 8, 8], "tokens": [-1]}
    assert cfg.feature_dtypes == {"x": "float64"}
    assert cfg.decode == {"image": "mypkg.io:decode_png"}
    assert cfg.collate == {"tokens": "mypkg.io:pack"}
    assert not clf._is_plain_fit()  # an option alone makes featuresCol a typed input
    plain = TorchClassifier(modelFn="sparktrain.models:mlp")
    assert plain._is_plain_fit()
    cfg = plain._train_config()
    assert (cfg.feature_shapes, cfg.feature_dtypes, cfg.decode, cfg.collate) == ({}, {}, {}, {})
    assert TorchRegressor(featureDtypes={"ids": "int64"})._train_config().feature_dtypes == {
        "ids": "int64"
    }


@pytest.mark.parametrize(
    ("param", "value", "match"),
    [
        ("featureShapes", {"image": [1, 0, 8]}, "featureShapes: .*positive integers"),
        ("featureShapes", {"tokens": [2, -1]}, "featureShapes: .*one-dimensional"),
        ("featureShapes", {"image": 784}, "featureShapes: .*list of sizes"),
        ("featureShapes", "[1, 28, 28]", "featureShapes must be a JSON object"),
        ("featureDtypes", {"x": "int32"}, "featureDtypes: .*not supported"),
        ("decode", {"image": "decode_png"}, "decode: .*'package.module:function'"),
        ("collate", {"tokens": 3}, "collate: .*'package.module:function'"),
        ("collate", "{tokens: x}", "collate is not valid JSON"),
    ],
)
def test_column_options_refuse_bad_entries(param: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TorchClassifier(**{param: value})


def _old_metadata(instance: TorchClassifier | TorchClassificationModel) -> dict[str, object]:
    """Metadata as a save from before typed inputs wrote it: no featuresCols, no column
    options, no ``inputs``."""
    params = {p.name: v for p, v in instance._paramMap.items() if p.name not in TYPED_PARAMS}
    defaults = {
        p.name: v for p, v in instance._defaultParamMap.items() if p.name not in TYPED_PARAMS
    }
    return {
        "class": f"{type(instance).__module__}.{type(instance).__name__}",
        "timestamp": 0,
        "sparkVersion": "4.1.0",
        "uid": instance.uid,
        "paramMap": params,
        "defaultParamMap": defaults,
        "numFeatures": 64,
        "numClasses": 10,
    }


def test_metadata_saved_before_typed_inputs_loads_with_their_defaults() -> None:
    saved = TorchClassificationModel()._set(
        modelFn="sparktrain.models:digits_mlp", featuresCol="scaled", learningRate=0.1
    )
    metadata = json.loads(json.dumps(_old_metadata(saved)))  # as read back from the file
    assert not set(TYPED_PARAMS) & (set(metadata["paramMap"]) | set(metadata["defaultParamMap"]))
    loaded = TorchClassificationModel()
    DefaultParamsReader.getAndSetParams(loaded, metadata)
    assert loaded.getFeaturesCol() == "scaled" and loaded.getLearningRate() == 0.1
    assert loaded.getFeaturesCols() == [] and loaded.getFeatureShapes() == "{}"
    assert loaded.getFeatureDtypes() == loaded.getDecode() == loaded.getCollate() == "{}"
    assert loaded._is_plain_fit() and loaded._features_spec() == ("scaled", "featuresCol")
    # no layout in the metadata: the plain layout of numFeatures
    assert saved_layout(metadata, "/m") is None
    loaded._set_state(b"w", num_features=64, num_outputs=10, layout=saved_layout(metadata, "/m"))
    assert loaded.layout == Layout.plain(64) and loaded.layout.is_plain
    assert loaded._input_sources(loaded.layout) == ["scaled"]
    # an estimator too
    estimator = TorchClassifier(modelFn="sparktrain.models:mlp", maxEpochs=3)
    again = TorchClassifier()
    DefaultParamsReader.getAndSetParams(again, json.loads(json.dumps(_old_metadata(estimator))))
    assert again.getMaxEpochs() == 3 and again.getFeaturesCols() == []
    assert again._train_config().feature_shapes == {}


KEYWORD = Layout(
    (
        Column("user", "user_id", "features_0", DENSE, "int64", ()),
        Column("context", "ctx", "features_1", DENSE, "float32", (2,)),
        Column("tokens", "tok", "features_2", RAGGED, "int64", (-1,)),
        Column(
            "image", "img", "features_3", BINARY, "binary", (), "tests.unit.test_ml_params:floats"
        ),
    ),
    "keyword",
)


def floats(value: bytes) -> np.ndarray:
    """A decode: bytes -> float32 values."""
    return np.frombuffer(value, np.float32)


def test_a_layout_survives_the_metadata_and_gives_num_features() -> None:
    metadata = json.loads(json.dumps({"numFeatures": -1, "inputs": KEYWORD.to_dict()}))
    assert saved_layout(metadata, "/m") == KEYWORD
    with pytest.raises(DataError, match="'inputs'.*cannot be read"):
        saved_layout({"inputs": {"columns": [{"key": "x"}]}}, "/m")
    assert layout_width(KEYWORD) == -1 and layout_width(Layout.plain(64)) == 64
    two = Layout((KEYWORD.columns[0], KEYWORD.columns[1]), "keyword")
    assert layout_width(two) == 3  # one id + two context values a row
    model = TorchClassificationModel()._set_state(
        b"w", num_features=-1, num_outputs=2, layout=KEYWORD
    )
    assert model.layout is KEYWORD and model.copy().layout is KEYWORD


def test_transform_reads_the_trained_inputs_or_renamed_columns_of_the_same_form() -> None:
    model = TorchClassificationModel()._set_state(
        b"w", num_features=-1, num_outputs=2, layout=KEYWORD
    )
    with pytest.raises(ConfigError, match="featuresCol='features' does not name.*user=user_id"):
        model._input_sources(KEYWORD)
    model.setFeaturesCols({"image": "img", "user": "uid", "tokens": "tok", "context": "ctx"})
    assert model._input_sources(KEYWORD) == ["uid", "ctx", "tok", "img"]  # the layout's order
    with pytest.raises(ConfigError, match="does not name this model's inputs"):
        model.setFeaturesCols(["uid", "ctx", "tok", "img"])._input_sources(KEYWORD)
    with pytest.raises(ConfigError, match="does not name this model's inputs"):
        model.setFeaturesCols({"user": "uid"})._input_sources(KEYWORD)
    positional = Layout(KEYWORD.columns[:2], "positional")
    assert model.setFeaturesCols(["a", "b"])._input_sources(positional) == ["a", "b"]
    plain = Layout.plain(4)
    assert model.setFeaturesCols([])._input_sources(plain) == ["features"]
    assert model.setFeaturesCols(["pixels"])._input_sources(plain) == ["pixels"]


class _Mixed(nn.Module):
    """forward(user, context, tokens, image, tokens_mask): every kind of input column."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(50, 3)
        self.head = nn.Linear(3 + 2 + 3 + 4, 3)

    def forward(self, user, context, tokens, image, tokens_mask):  # type: ignore[no-untyped-def]
        weights = tokens_mask.unsqueeze(-1).float()
        bag = (self.embedding(tokens) * weights).sum(1)
        parts = [self.embedding(user % 50), context, bag, image.reshape(len(user), -1)]
        return self.head(torch.cat(parts, dim=1))


def _struct(rows: int, offset: int = 0) -> pa.StructArray:
    """The input struct as Spark's Arrow batches carry it (types of input_columns)."""
    rng = np.random.default_rng(1)
    ids = ((1 << 40) + np.arange(rows)).astype(np.int64)
    context = rng.normal(size=(rows, 2)).astype(np.float32)
    tokens = [rng.integers(0, 50, rng.integers(1, 6)).tolist() for _ in range(rows)]
    images = [rng.normal(size=4).astype(np.float32).tobytes() for _ in range(rows)]
    struct = pa.StructArray.from_arrays(
        [
            pa.array(ids),
            pa.array(context.tolist(), pa.list_(pa.float32())),
            pa.array(tokens, pa.list_(pa.int64())),
            pa.array(images, pa.binary()),
        ],
        names=[c.wire for c in KEYWORD.columns],
    )
    return struct.slice(offset)


def _plan(layout: Layout | None, kind: str = "classification") -> _InferencePlan:
    fields = ("rawPrediction", "probability", "prediction")
    if kind == "regression":
        fields = ("prediction",)
    return _InferencePlan("t", None, "x:y", {}, -1, kind, 1, fields, layout)


def test_typed_transform_batches_rows_as_training_does() -> None:
    from sparktrain.data.batch import Collator

    torch.manual_seed(0)
    module = _Mixed().eval()
    struct = _struct(7, offset=2)  # a slice: children keep the struct's offset
    plan = _plan(KEYWORD)
    with torch.no_grad():
        out = plan.predict_typed(module, Collator(KEYWORD), struct)
    assert out.type.names == ["rawPrediction", "probability", "prediction"] and len(out) == 5
    # the same rows by hand: ids stay int64 above 2**24, tokens padded with their mask
    user = torch.tensor(struct.field("features_0").to_pylist())
    context = torch.tensor(struct.field("features_1").to_pylist())
    tokens = struct.field("features_2").to_pylist()
    longest = max(len(t) for t in tokens)
    padded = torch.tensor([t + [0] * (longest - len(t)) for t in tokens])
    mask = torch.tensor([[i < len(t) for i in range(longest)] for t in tokens])
    image = torch.tensor(np.stack([floats(b) for b in struct.field("features_3").to_pylist()]))
    with torch.no_grad():
        want = module(user=user, context=context, tokens=padded, image=image, tokens_mask=mask)
    raw = np.array(out.field("rawPrediction").to_pylist())
    np.testing.assert_allclose(raw, want.double().numpy(), rtol=1e-6)
    assert out.field("prediction").to_pylist() == want.argmax(1).double().tolist()
    probability = np.array(out.field("probability").to_pylist())
    np.testing.assert_allclose(probability.sum(1), 1.0)
    # an empty Arrow batch gives an empty output of the same type
    empty = plan.predict_typed(module, Collator(KEYWORD), struct.slice(0, 0))
    assert len(empty) == 0 and empty.type == out.type


def test_typed_transform_names_the_column_of_a_bad_row() -> None:
    from sparktrain.data.batch import Collator

    module = _Mixed().eval()
    plan = _plan(KEYWORD)
    struct = _struct(3)
    children = struct.flatten()
    nulls = pa.StructArray.from_arrays(
        [pa.array([1, None, 3], pa.int64()), *children[1:]], names=struct.type.names
    )
    with pytest.raises(DataError, match="1 rows have a null column 'user_id'"):
        plan.predict_typed(module, Collator(KEYWORD), nulls)
    short = pa.array([[0.5, 1.0], [1.0], [2.0, 3.0]], pa.list_(pa.float32()))
    wrong = pa.StructArray.from_arrays([children[0], short, *children[2:]], names=struct.type.names)
    with pytest.raises(DataError, match="a row of column 'ctx' has 1 values.*trained on 2"):
        plan.predict_typed(module, Collator(KEYWORD), wrong)
    # a regressor's single output: prediction only
    scalar = Layout((Column("x", "x", "features", DENSE, "float32", ()),), "single")
    linear = nn.Linear(1, 1)
    with torch.no_grad():
        out = _plan(scalar, "regression").predict_typed(
            lambda x: linear(x.unsqueeze(1)),  # type: ignore[arg-type]
            Collator(scalar),
            pa.StructArray.from_arrays([pa.array([1.0, 2.0])], names=["features"]),
        )
        want = linear(torch.tensor([[1.0], [2.0]]))[:, 0].double().tolist()
    assert out.field("prediction").to_pylist() == pytest.approx(want)


# ---------------------------------------------------------------------- labelScaling
def test_label_scaling_maps_onto_train_config_for_mse_only() -> None:
    reg = TorchRegressor(modelFn="sparktrain.models:mlp")
    assert reg._train_config().label_scaling is True
    assert reg.setLabelScaling(False)._train_config().label_scaling is False
    assert TorchRegressor(labelScaling=False).getLabelScaling() is False
    assert reg.setParams(labelScaling=True).getLabelScaling() is True
    # the model carries the param (persisted with it) and copies keep it apart
    model = TorchRegressionModel()
    assert model.getLabelScaling() is True
    assert model.copy({model.labelScaling: False}).getLabelScaling() is False
    # another loss: TrainConfig refuses label_scaling with it, so it is not passed on
    other = TorchRegressor(loss="mse")
    other._set(loss="cross_entropy")
    assert other._train_config().label_scaling is False
    with pytest.raises(TypeError, match="labelScaling"):
        TorchRegressor(labelScaling="yes")  # type: ignore[arg-type]


def test_trained_module_unwraps_label_scaled_results() -> None:
    inner = nn.Linear(3, 1)
    module, stats = trained_module(LabelScaled(inner, 150.0, 75.0))
    assert module is inner and stats == (150.0, 75.0)
    assert trained_module(inner) == (inner, None)
    # the summary's float64 figures win over the float32 buffers
    mean = 151.9214501510574
    _, exact = trained_module(
        LabelScaled(inner, mean, 75.0), {"label_scaling": {"mean": mean, "std": 75.0}}
    )
    assert exact == (mean, 75.0)


def test_regression_outputs_are_brought_back_to_label_units() -> None:
    plan = _plan(None, "regression")
    out = torch.tensor([[-1.0], [0.0], [2.5]])
    assert plan.outputs(out).field("prediction").to_pylist() == [-1.0, 0.0, 2.5]
    plan.label_stats = (152.0, 77.5)
    got = plan.outputs(out).field("prediction").to_pylist()
    assert got == pytest.approx([152.0 - 77.5, 152.0, 152.0 + 2.5 * 77.5], rel=1e-12)
    # the plain path: features in, label units out
    linear = nn.Linear(2, 1)
    features = pa.array([[1.0, 2.0], [3.0, -1.0]], pa.list_(pa.float32()))
    plan.num_features = 2
    with torch.no_grad():
        want = linear(torch.tensor([[1.0, 2.0], [3.0, -1.0]]))[:, 0].double() * 77.5 + 152.0
        got = plan.predict(linear, features).field("prediction").to_pylist()
    assert got == pytest.approx(want.tolist(), rel=1e-9)
    # a classifier's outputs are never shifted
    clf = _plan(None)
    clf.label_stats = (152.0, 77.5)
    logits = torch.tensor([[0.0, 1.0]])
    assert clf.outputs(logits).field("rawPrediction").to_pylist() == [[0.0, 1.0]]


def test_a_fitted_regressor_keeps_the_figures_and_its_module_predicts_in_label_units() -> None:
    from sparktrain.models import mlp

    torch.manual_seed(0)
    inner = mlp(2, [], 1)
    model = TorchRegressionModel()._set_state(
        state_to_bytes(inner.state_dict()), num_features=2, num_outputs=1, label_stats=(10, 2)
    )
    model._set(
        modelFn="sparktrain.models:mlp",
        modelKwargs={"in_features": 2, "hidden": [], "out_features": 1},
    )
    assert model.labelStats == (10.0, 2.0)
    assert model._label_stats_meta() == {"mean": 10.0, "std": 2.0}
    module = model.getModule()
    assert isinstance(module, LabelScaled) and isinstance(module.inner, nn.Sequential)
    x = torch.tensor([[1.0, -2.0]])
    with torch.no_grad():
        assert module(x).item() == pytest.approx(inner(x).item() * 2 + 10, rel=1e-6)
    copied = model.copy()
    assert copied.labelStats == (10.0, 2.0)
    plain = TorchRegressionModel()._set_state(b"w", num_features=2, num_outputs=1)
    assert plain.labelStats is None and plain._label_stats_meta() is None
    with pytest.raises(DataError, match="std > 0"):
        TorchRegressionModel()._set_state(b"w", num_features=2, num_outputs=1, label_stats=(1, 0))


def test_saved_label_figures_are_read_back_or_refused() -> None:
    assert saved_label_stats({"labelScaling": {"mean": 1.5, "std": 2}}, "/m") == (1.5, 2.0)
    assert saved_label_stats({"labelScaling": None}, "/m") is None
    assert saved_label_stats({}, "/m") is None  # saved before label scaling
    with pytest.raises(DataError, match="'labelScaling' figures cannot be read"):
        saved_label_stats({"labelScaling": {"mean": 1.0}}, "/m")
    with pytest.raises(DataError, match="finite std > 0"):
        saved_label_stats({"labelScaling": {"mean": 1.0, "std": float("nan")}}, "/m")


def _before_label_scaling(instance: TorchRegressor | TorchRegressionModel) -> dict[str, object]:
    """Metadata as a save from before labelScaling and today's defaults wrote it: no
    labelScaling param, and the old defaults (sgd, 0.01, 10 epochs) in defaultParamMap."""
    params = {p.name: v for p, v in instance._paramMap.items() if p.name != "labelScaling"}
    defaults = {p.name: v for p, v in instance._defaultParamMap.items() if p.name != "labelScaling"}
    defaults.update(optimizer="sgd", learningRate=0.01, maxEpochs=10, batchSize=32)
    metadata = {
        "class": f"{type(instance).__module__}.{type(instance).__name__}",
        "timestamp": 0,
        "sparkVersion": "4.1.0",
        "uid": instance.uid,
        "paramMap": params,
        "defaultParamMap": defaults,
    }
    return json.loads(json.dumps(metadata))  # as read back from the file


def test_saves_from_before_label_scaling_and_the_new_defaults_load() -> None:
    # an estimator: the class default labelScaling=True; the defaults it was saved with
    estimator = TorchRegressor(modelFn="sparktrain.models:mlp", maxEpochs=3)
    metadata = _before_label_scaling(estimator)
    loaded = TorchRegressor()
    DefaultParamsReader.getAndSetParams(loaded, metadata)
    assert not _names_no_label_scaling(TorchClassifier(), metadata)  # not a regressor param
    assert loaded.getMaxEpochs() == 3 and loaded.getLabelScaling() is True
    assert (loaded.getOptimizer(), loaded.getLearningRate()) == ("sgd", 0.01)
    assert loaded._train_config().label_scaling is True
    # a model: trained without label scaling, so its param says so; outputs unscaled
    model = TorchRegressionModel()._set(modelFn="sparktrain.models:mlp")
    metadata = {**_before_label_scaling(model), "numFeatures": 4, "numClasses": None}
    old = TorchRegressionModel()
    DefaultParamsReader.getAndSetParams(old, metadata)
    assert _names_no_label_scaling(old, metadata)
    old._setDefault(labelScaling=False)  # what TorchModelReader does
    old._set_state(
        b"w", num_features=4, num_outputs=None, label_stats=saved_label_stats(metadata, "/m")
    )
    assert old.getLabelScaling() is False and old.labelStats is None
    # today's metadata names the param (defaultParamMap), so it is left as saved
    today = {"paramMap": {}, "defaultParamMap": {"labelScaling": True}}
    assert not _names_no_label_scaling(TorchRegressionModel(), today)


# ---------------------------------------------------------------------- training loop
def _getter(instance: object, param: str) -> object:
    return getattr(instance, f"get{param[0].upper()}{param[1:]}")()


def test_loop_params_default_to_train_config() -> None:
    cfg = TrainConfig()
    stages = (TorchClassifier(), TorchRegressor(), TorchClassificationModel())
    for stage in stages:
        trained = stage._train_config()
        for param, key in LOOP_PARAMS.items():
            # the ml side documents no defaults of its own for these
            assert getattr(trained, key) == getattr(cfg, key) == getattr(ML_DEFAULTS, key), param
    clf = TorchClassifier()
    assert (clf.getLrSchedule(), clf.getLrScheduleKwargs(), clf.getLrScheduleInterval()) == (
        "none",
        "{}",
        "step",
    )
    assert (clf.getWarmupSteps(), clf.getPrecision(), clf.getFp16SkipLimit()) == (0, "fp32", 10)
    assert (clf.getAccumulateSteps(), clf.getClipGradNorm()) == (1, 0.0)
    assert (clf.getEarlyStopping(), clf.getMetrics()) == ("{}", [])
    assert (clf.getTensorboardDir(), clf.getMlflowTrackingUri()) == ("", "")
    assert clf.getMlflowExperiment() == cfg.mlflow_experiment == "sparktrain"
    # defaults are not "set": a saved estimator records them as defaults only
    assert not any(clf.isSet(clf.getParam(p)) for p in LOOP_PARAMS)


LOOP_VALUES: dict[str, Any] = {
    "lrSchedule": "CosineAnnealingLR",
    "lrScheduleKwargs": {"T_max": 100},
    "lrScheduleInterval": "epoch",
    "warmupSteps": 50,
    "precision": "bf16",
    "fp16SkipLimit": 5,
    "accumulateSteps": 4,
    "clipGradNorm": 1,
    "earlyStopping": {"metric": "accuracy", "patience": 3, "restore_best": True},
    "metrics": ["macro_f1", "top_k:3"],
    "tensorboardDir": "/tmp/tb",
    "mlflowTrackingUri": "file:///tmp/mlruns",
    "mlflowExperiment": "digits",
}
# what TrainConfig receives for LOOP_VALUES (JSON params parsed, int -> float)
LOOP_CONFIG = {
    "lr_schedule": "CosineAnnealingLR",
    "lr_schedule_kwargs": {"T_max": 100},
    "lr_schedule_interval": "epoch",
    "warmup_steps": 50,
    "precision": "bf16",
    "fp16_skip_limit": 5,
    "accumulate_steps": 4,
    "clip_grad_norm": 1.0,
    "early_stopping": {"metric": "accuracy", "patience": 3, "restore_best": True},
    "metrics": ["macro_f1", "top_k:3"],
    "tensorboard_dir": "/tmp/tb",
    "mlflow_tracking_uri": "file:///tmp/mlruns",
    "mlflow_experiment": "digits",
}


def _loop_config(stage: TorchClassifier | TorchRegressor) -> dict[str, object]:
    cfg = stage._train_config()
    return {key: getattr(cfg, key) for key in LOOP_PARAMS.values()}


def test_loop_params_are_set_and_map_onto_train_config() -> None:
    assert set(LOOP_VALUES) == set(LOOP_PARAMS)
    # keyword arguments, of both estimators
    clf = TorchClassifier(modelFn="sparktrain.models:mlp", **LOOP_VALUES)
    reg = TorchRegressor(modelFn="sparktrain.models:mlp", **LOOP_VALUES)
    for stage in (clf, reg):
        assert _loop_config(stage) == LOOP_CONFIG
        assert stage.getClipGradNorm() == 1.0 and isinstance(stage.getClipGradNorm(), float)
        assert stage.getLrScheduleKwargs() == '{"T_max": 100}'  # canonical JSON text
        assert json.loads(stage.getEarlyStopping()) == LOOP_VALUES["earlyStopping"]
        assert stage.getMetrics() == ["macro_f1", "top_k:3"]
    assert clf._resolve()[0].precision == "bf16"  # what fit trains with
    # setters (chained), and setParams
    other = TorchClassifier(modelFn="sparktrain.models:mlp")
    for param, value in LOOP_VALUES.items():
        setter = getattr(other, f"set{param[0].upper()}{param[1:]}")
        assert setter(value) is other
    assert _loop_config(other) == LOOP_CONFIG
    third = TorchRegressor(modelFn="sparktrain.models:mlp").setParams(**LOOP_VALUES)
    assert _loop_config(third) == LOOP_CONFIG
    # JSON text is accepted as well as a dict; getMetrics hands out a copy
    other.setEarlyStopping('{"metric": "loss"}').setLrScheduleKwargs('{"step_size": 2}')
    assert other._train_config().early_stopping == {"metric": "loss"}
    assert other._train_config().lr_schedule_kwargs == {"step_size": 2}
    other.getMetrics().append("auc")
    assert other.getMetrics() == ["macro_f1", "top_k:3"]
    assert other.setMetrics(["auc"]).getMetrics() == ["auc"]


def test_the_fitted_model_carries_the_loop_params_it_was_trained_with() -> None:
    clf = TorchClassifier(modelFn="sparktrain.models:mlp", **LOOP_VALUES)
    model = clf._copyValues(TorchClassificationModel())  # what fit does
    assert all(_getter(model, p) == _getter(clf, p) for p in LOOP_PARAMS)
    # read-only there: the params describe the training, not the transform
    assert not any(hasattr(model, f"set{p[0].upper()}{p[1:]}") for p in LOOP_PARAMS)
    regression = TorchRegressor(precision="bf16")._copyValues(TorchRegressionModel())
    assert regression.getPrecision() == "bf16"


def test_loop_params_in_a_param_grid_go_through_converters() -> None:
    clf = TorchClassifier(modelFn="sparktrain.models:mlp")
    grid = (
        ParamGridBuilder()
        .addGrid(clf.precision, ["fp32", "bf16"])
        .addGrid(clf.clipGradNorm, [0, 1])
        .addGrid(clf.earlyStopping, [{}, {"patience": 2, "metric": "loss"}])
        .build()
    )
    copies = [clf.copy(m) for m in grid]
    assert len(copies) == 8
    assert all(isinstance(c.getClipGradNorm(), float) for c in copies)
    stops = Counter(c.getEarlyStopping() for c in copies)
    assert stops == Counter({"{}": 4, '{"metric": "loss", "patience": 2}': 4})  # sorted keys
    assert {c._train_config().precision for c in copies} == {"fp32", "bf16"}


@pytest.mark.parametrize(
    ("param", "value", "error", "match"),
    [
        (
            "lrSchedule",
            "Cosine",
            ValueError,
            r"lrSchedule='Cosine' is not a torch.optim.lr_scheduler class; use 'none' or one "
            r"of .*CosineAnnealingLR.*StepLR",
        ),
        ("lrSchedule", "SequentialLR", ValueError, "lrSchedule='SequentialLR' is not a torch"),
        ("lrSchedule", 3, TypeError, 'param "lrSchedule"'),
        ("lrScheduleKwargs", "[100]", ValueError, "lrScheduleKwargs must be a JSON object"),
        ("lrScheduleKwargs", "{T_max: 100}", ValueError, "lrScheduleKwargs is not valid JSON"),
        ("lrScheduleInterval", "batch", ValueError, "lrScheduleInterval='batch'.*step, epoch"),
        ("warmupSteps", -1, ValueError, "warmupSteps=-1 must be an integer >= 0"),
        ("warmupSteps", 2.5, TypeError, 'param "warmupSteps"'),
        ("precision", "fp8", ValueError, "precision='fp8' is not supported.*fp32, bf16, fp16"),
        ("fp16SkipLimit", 0, ValueError, "fp16SkipLimit=0 must be an integer >= 1"),
        ("accumulateSteps", 0, ValueError, "accumulateSteps=0 must be an integer >= 1"),
        ("clipGradNorm", -1, ValueError, r"clipGradNorm=-1.0 must be a number >= 0 \(0 = no"),
        ("clipGradNorm", float("nan"), ValueError, "clipGradNorm=nan must be a number >= 0"),
        ("clipGradNorm", "1", TypeError, 'param "clipGradNorm"'),
        (
            "earlyStopping",
            {"metric": "loss", "patiance": 3},
            ValueError,
            r"earlyStopping: unknown key\(s\) patiance; allowed: metric, mode, patience",
        ),
        ("earlyStopping", {"patience": 3}, ValueError, "earlyStopping needs the metric"),
        (
            "earlyStopping",
            '{"metric": "loss", "patience": 0}',
            ValueError,
            "earlyStopping.patience=0 must be an integer >= 1",
        ),
        (
            "earlyStopping",
            {"metric": "loss", "mode": "up"},
            ValueError,
            "earlyStopping.mode='up' must be 'min' or 'max'",
        ),
        ("earlyStopping", '["loss"]', ValueError, "earlyStopping must be a JSON object"),
        ("earlyStopping", "{metric: loss}", ValueError, "earlyStopping is not valid JSON"),
        ("earlyStopping", 3, TypeError, "earlyStopping must be a dict or a JSON object"),
        (
            "metrics",
            ["macro_f1", "f1"],
            ValueError,
            r"metrics: 'f1' is not a metric; use one of accuracy, top_k:K, macro_f1.*names only",
        ),
        ("metrics", ["top_k:0"], ValueError, "metrics: 'top_k:0' is not a metric"),
        ("metrics", "macro_f1", TypeError, 'param "metrics"'),  # a list, not one string
        ("metrics", [len], TypeError, 'param "metrics"'),  # callables go through the Trainer
        ("tensorboardDir", 3, TypeError, 'param "tensorboardDir"'),
        ("mlflowTrackingUri", ["x"], TypeError, 'param "mlflowTrackingUri"'),
        ("mlflowExperiment", 1.0, TypeError, 'param "mlflowExperiment"'),
    ],
)
def test_loop_params_refuse_bad_values_naming_the_param(
    param: str, value: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TorchClassifier(**{param: value})
    setter = getattr(TorchRegressor(), f"set{param[0].upper()}{param[1:]}")
    with pytest.raises(error, match=match):
        setter(value)


def _before_loop_params(instance: Any, **extra: object) -> dict[str, Any]:
    """Metadata as a save from before the loop params wrote it: none of them, in either
    section."""
    params = {p.name: v for p, v in instance._paramMap.items() if p.name not in LOOP_PARAMS}
    defaults = {
        p.name: v for p, v in instance._defaultParamMap.items() if p.name not in LOOP_PARAMS
    }
    metadata = {
        "class": f"{type(instance).__module__}.{type(instance).__name__}",
        "timestamp": 0,
        "sparkVersion": "4.1.0",
        "uid": instance.uid,
        "paramMap": params,
        "defaultParamMap": defaults,
        **extra,
    }
    return json.loads(json.dumps(metadata))  # as read back from the file


def test_saves_from_before_the_loop_params_load_with_their_defaults() -> None:
    cfg = TrainConfig()
    loop_defaults = {key: getattr(cfg, key) for key in LOOP_PARAMS.values()}
    estimators = (
        TorchClassifier(modelFn="sparktrain.models:mlp", maxEpochs=3),
        TorchRegressor(modelFn="sparktrain.models:mlp", maxEpochs=3),
    )
    for estimator in estimators:
        metadata = _before_loop_params(estimator)
        saved = set(metadata["paramMap"]) | set(metadata["defaultParamMap"])
        assert not set(LOOP_PARAMS) & saved
        loaded = type(estimator)()
        DefaultParamsReader.getAndSetParams(loaded, metadata)
        assert loaded.getMaxEpochs() == 3 and loaded.getModelFn() == "sparktrain.models:mlp"
        assert _loop_config(loaded) == loop_defaults
    # models: the same, and they still say what they were trained with (the defaults)
    models = (
        TorchClassificationModel()._set(modelFn="sparktrain.models:digits_mlp", learningRate=0.1),
        TorchRegressionModel()._set(modelFn="sparktrain.models:mlp"),
    )
    for model in models:
        metadata = _before_loop_params(model, numFeatures=64, numClasses=None)
        old = type(model)()
        DefaultParamsReader.getAndSetParams(old, metadata)
        assert all(_getter(old, p) == _getter(type(model)(), p) for p in LOOP_PARAMS)
        assert {key: getattr(old._train_config(), key) for key in LOOP_PARAMS.values()} == (
            loop_defaults
        )
    # and a save with them reads back the values it was saved with
    clf = TorchClassifier(modelFn="sparktrain.models:mlp", **LOOP_VALUES)
    metadata = json.loads(
        json.dumps(
            {
                "class": "x",
                "sparkVersion": "4.1.0",
                "paramMap": {p.name: v for p, v in clf._paramMap.items()},
                "defaultParamMap": {p.name: v for p, v in clf._defaultParamMap.items()},
            }
        )
    )
    again = TorchClassifier()
    DefaultParamsReader.getAndSetParams(again, metadata)
    assert _loop_config(again) == LOOP_CONFIG
