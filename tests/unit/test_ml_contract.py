"""The MLlib class contract of sparktrain.ml without Spark: pyspark.ml's base classes,
``predict`` / ``predictRaw`` / ``predictProbability`` on one Vector, ``thresholds``, and
the output columns' metadata (issue 35). On a session: tests/integration/test_ml_contract.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from pyspark.ml.base import PredictionModel, Predictor
from pyspark.ml.classification import (
    ClassificationModel,
    Classifier,
    ProbabilisticClassificationModel,
    ProbabilisticClassifier,
)
from pyspark.ml.linalg import DenseVector, Vectors
from pyspark.ml.regression import RegressionModel, Regressor

from sparktrain.errors import ConfigError, DataError
from sparktrain.ml import (
    TorchClassificationModel,
    TorchClassifier,
    TorchRegressionModel,
    TorchRegressor,
)
from sparktrain.ml.model import InlineWeights, _InferencePlan
from sparktrain.models import mlp
from sparktrain.result import state_to_bytes


def classifier_model(out_features: int = 3, **params: object) -> TorchClassificationModel:
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"in_features": 4, "hidden": [8], "out_features": out_features}
    module = mlp(**kwargs)
    model = TorchClassificationModel()._set_state(
        state_to_bytes(module.state_dict()), num_features=4, num_outputs=out_features
    )
    return model._set(modelFn="sparktrain.models:mlp", modelKwargs=kwargs, **params)


def regression_model(stats: tuple[float, float] | None) -> TorchRegressionModel:
    torch.manual_seed(1)
    kwargs: dict[str, Any] = {"in_features": 4, "hidden": [8], "out_features": 1}
    module = mlp(**kwargs)
    model = TorchRegressionModel()._set_state(
        state_to_bytes(module.state_dict()), num_features=4, num_outputs=1, label_stats=stats
    )
    return model._set(modelFn="sparktrain.models:mlp", modelKwargs=kwargs)


def test_stages_are_mllib_predictors() -> None:
    for stage in (TorchClassifier(), TorchRegressor()):
        assert isinstance(stage, Predictor)
    assert isinstance(TorchClassifier(), Classifier)
    assert isinstance(TorchClassifier(), ProbabilisticClassifier)
    assert isinstance(TorchRegressor(), Regressor)
    assert not isinstance(TorchRegressor(), Classifier)
    for model in (TorchClassificationModel(), TorchRegressionModel()):
        assert isinstance(model, PredictionModel)
    assert isinstance(TorchClassificationModel(), ClassificationModel)
    assert isinstance(TorchClassificationModel(), ProbabilisticClassificationModel)
    assert isinstance(TorchRegressionModel(), RegressionModel)
    assert not isinstance(TorchRegressionModel(), ClassificationModel)


def test_thresholds_is_mllibs_param_and_reaches_the_model() -> None:
    clf = TorchClassifier(modelFn="sparktrain.models:mlp", thresholds=[0.2, 0.3, 0.5])
    assert clf.getThresholds() == [0.2, 0.3, 0.5]
    assert clf.getParam("thresholds").doc == ProbabilisticClassifier.thresholds.doc
    model = clf._copyValues(classifier_model())
    assert model._thresholds() == (0.2, 0.3, 0.5)
    assert classifier_model()._thresholds() is None


def test_predict_raw_and_probability_of_one_vector() -> None:
    model = classifier_model()
    x = np.array([0.5, -1.0, 2.0, 0.25])
    logits = model.getModule()(torch.tensor(x, dtype=torch.float32)[None]).detach().double()[0]
    raw = model.predictRaw(Vectors.dense(x))
    prob = model.predictProbability(Vectors.dense(x))
    assert isinstance(raw, DenseVector) and isinstance(prob, DenseVector)
    assert raw.size == prob.size == 3
    np.testing.assert_allclose(raw.toArray(), logits.numpy(), rtol=1e-12)
    np.testing.assert_allclose(prob.toArray(), torch.softmax(logits, 0).numpy(), rtol=1e-12)
    prediction = model.predict(Vectors.dense(x))
    assert isinstance(prediction, float) and prediction == float(np.argmax(prob.toArray()))
    # a sparse vector is the same row
    sparse = Vectors.sparse(4, {0: 0.5, 1: -1.0, 2: 2.0, 3: 0.25})
    assert model.predictRaw(sparse) == raw and model.predict(sparse) == prediction


def test_single_logit_binary_one_vector() -> None:
    model = classifier_model(out_features=1, loss="bce_with_logits")
    x = Vectors.dense([1.0, 2.0, -0.5, 0.0])
    z = float(
        model.getModule()(torch.tensor(x.toArray(), dtype=torch.float32)[None]).detach()[0, 0]
    )
    assert model.predictRaw(x).toArray() == pytest.approx([-z, z])
    p1 = 1 / (1 + np.exp(-z))
    assert model.predictProbability(x).toArray() == pytest.approx([1 - p1, p1])
    assert model.predict(x) == float(p1 > 0.5) and model.numClasses == 2


def test_regressor_predicts_in_label_units() -> None:
    x = Vectors.dense([0.1, 0.2, 0.3, 0.4])
    plain = regression_model(None)
    scaled = regression_model((100.0, 20.0))
    out = float(
        plain.getModule()(torch.tensor(x.toArray(), dtype=torch.float32)[None]).detach()[0, 0]
    )
    assert plain.predict(x) == pytest.approx(out, rel=1e-6)
    assert scaled.predict(x) == pytest.approx(out * 20.0 + 100.0, rel=1e-6)


def test_predict_checks_the_row_and_the_model() -> None:
    model = classifier_model()
    with pytest.raises(DataError, match="4 values"):
        model.predict(Vectors.dense([1.0, 2.0]))
    with pytest.raises(ConfigError, match="no weights"):
        TorchClassificationModel().predict(Vectors.dense([1.0] * 4))
    with pytest.raises(ConfigError, match="one value >= 0 per class"):
        classifier_model(thresholds=[0.5, 0.5]).predict(Vectors.dense([1.0] * 4))
    with pytest.raises(ConfigError, match="at most one of them 0"):
        classifier_model(thresholds=[0.0, 0.0, 1.0]).predict(Vectors.dense([1.0] * 4))


def test_module_is_built_once_for_many_rows() -> None:
    model = classifier_model()
    model.predict(Vectors.dense([1.0] * 4))
    first = model._scoring_module()
    model.predict(Vectors.dense([2.0] * 4))
    assert model._scoring_module() is first
    model._set(modelKwargs={"in_features": 4, "hidden": [8], "out_features": 3, "dropout": 0.0})
    assert model._scoring_module() is not first  # other modelKwargs: rebuilt


@pytest.mark.parametrize("fields", [("prediction",), ("probability", "prediction")])
def test_thresholds_pick_the_largest_probability_over_threshold(fields: tuple[str, ...]) -> None:
    """MLlib's rule: argmax of p / t, a 0 threshold meaning infinity; the same whether or
    not the probabilities are asked for."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.6, 0.4, 0.0]]))

    def predicted(thresholds: tuple[float, ...] | None) -> list[float]:
        plan = _InferencePlan(
            token="t",
            weights=InlineWeights(b""),
            model_fn="sparktrain.models:mlp",
            model_kwargs={},
            num_features=3,
            kind="classification",
            threads=1,
            fields=fields,
            thresholds=thresholds,
        )
        out: pa.StructArray = plan.outputs(logits)
        return list(out.field("prediction").to_pylist())

    assert predicted(None) == [0.0, 2.0, 0.0]
    # p / t: [2.5, 1.0, 0.4], [0.5, 0.33, 1.6], [3, 1.33, 0]
    assert predicted((0.2, 0.3, 0.5)) == [0.0, 2.0, 0.0]
    # [0.5, 1.5, 0.4], [0.1, 0.5, 1.6], [0.6, 2, 0]
    assert predicted((1.0, 0.2, 0.5)) == [1.0, 2.0, 1.0]
    assert predicted((1.0, 1.0, 0.0)) == [2.0, 2.0, 2.0]  # a zero threshold always wins


def test_output_metadata_is_mllibs() -> None:
    assert classifier_model()._output_metadata() == {
        "prediction": {"ml_attr": {"num_vals": 3, "type": "nominal"}},
        "rawPrediction": {"ml_attr": {"num_attrs": 3}},
        "probability": {"ml_attr": {"num_attrs": 3}},
    }
    binary = classifier_model(out_features=1, loss="bce_with_logits")
    assert binary._output_metadata()["prediction"]["ml_attr"]["num_vals"] == 2
    assert regression_model(None)._output_metadata() == {}
