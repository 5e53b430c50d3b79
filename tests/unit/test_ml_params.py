"""sparktrain.ml params without Spark: defaults, converters, copy semantics, config mapping,
and the weights format."""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest
import torch
from pyspark.ml.tuning import ParamGridBuilder

from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError, DataError
from sparktrain.ml import (
    TorchClassificationModel,
    TorchClassifier,
    TorchRegressionModel,
    TorchRegressor,
)
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
}
STANDARD = {"featuresCol", "labelCol", "predictionCol", "weightCol"}


def test_param_names_follow_mllib() -> None:
    clf_names = {p.name for p in TorchClassifier().params}
    reg_names = {p.name for p in TorchRegressor().params}
    assert clf_names == OWN_PARAMS | STANDARD | {"probabilityCol", "rawPredictionCol"}
    assert reg_names == OWN_PARAMS | STANDARD
    assert {p.name for p in TorchClassificationModel().params} == clf_names
    assert {p.name for p in TorchRegressionModel().params} == reg_names
    assert "learningRate" in TorchClassifier().explainParams()


def test_defaults_come_from_train_config() -> None:
    cfg = TrainConfig()
    clf = TorchClassifier(modelFn="sparktrain.models:digits_mlp")
    assert clf.getLearningRate() == cfg.lr
    assert clf.getBatchSize() == cfg.batch_size
    assert clf.getMaxEpochs() == cfg.epochs
    assert clf.getNumWorkers() == cfg.num_workers
    assert clf.getStrategy() == cfg.strategy
    assert clf.getCompression() == cfg.compression
    assert clf.getPsMode() == cfg.ps_mode
    assert clf.getSeed() == cfg.seed == 0  # not pyspark's per-process hash of the class name
    assert clf.getValidationFraction() == cfg.validation_fraction
    assert clf.getDataMemoryInMB() == cfg.data_memory_mb == 512
    assert clf.getOptimizer() == cfg.optimizer
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
    clf = TorchClassifier(modelFn="sparktrain.models:mlp", learningRate=0.1)
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
