"""transform's output columns on local[2] (issue 36.4): the UDF emits the model's outputs
once, and prediction, rawPrediction and probability are Spark expressions over them, so
a query that selects the prediction alone builds no vector. Checked on the optimized
plans, and the values against the torch code the driver's ``predict`` runs
(``_InferencePlan.outputs``, what the UDF itself returned before)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from pyspark.ml.linalg import Vectors

from sparktrain.ml import TorchClassificationModel, TorchRegressionModel
from sparktrain.ml.model import InlineWeights, _InferencePlan
from sparktrain.models import mlp
from sparktrain.result import state_to_bytes

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

ALL = ("rawPrediction", "probability", "prediction")
ROWS = 200


def _model(
    cls: type[Any],
    out_features: int,
    *,
    bias: list[float] | None = None,
    label_stats: tuple[float, float] | None = None,
) -> Any:
    """A 4-input linear ``sparktrain.models:mlp`` (``bias``: zero weights and this bias,
    for outputs chosen by hand)."""
    torch.manual_seed(out_features)
    kwargs: dict[str, Any] = {"in_features": 4, "hidden": [], "out_features": out_features}
    module = mlp(**kwargs)
    if bias is not None:
        linear = module[0]
        assert isinstance(linear, torch.nn.Linear)
        with torch.no_grad():
            linear.weight.zero_()
            linear.bias.copy_(torch.tensor(bias))
    model = cls()._set_state(
        state_to_bytes(module.state_dict()),
        num_features=4,
        num_outputs=out_features,
        label_stats=label_stats,
    )
    return model._set(modelFn="sparktrain.models:mlp", modelKwargs=kwargs)


@pytest.fixture(scope="module")
def frame(_sessions):  # type: ignore[no-untyped-def]
    spark = _sessions.get("local[2]")
    rng = np.random.default_rng(0)
    rows = [(i, Vectors.dense(rng.normal(0, 3, size=4).tolist())) for i in range(ROWS)]
    return spark.createDataFrame(rows, ["id", "features"]).repartition(2)


def _plan(query: Any) -> str:
    """The optimized plan without expression ids (two plans of one shape compare equal)."""
    text = str(query._jdf.queryExecution().optimizedPlan().toString())
    return re.sub(r"#\d+L?|pythonUDF\d+", "", text)


def test_selecting_the_prediction_builds_no_vector_and_runs_the_udf_once(frame):  # type: ignore[no-untyped-def]
    model = _model(TorchClassificationModel, 3)
    lean = model.copy().setProbabilityCol("").setRawPredictionCol("")
    pruned = _plan(model.transform(frame).select("id", "prediction"))
    # the default columns, unselected, cost what switched-off ones do: nothing
    assert pruned == _plan(lean.transform(frame).select("id", "prediction"))
    assert pruned.count("ArrowEvalPython") == 1
    # no softmax (its exponentials) and one Scala UDF: vector_to_array of the features;
    # array_to_vector, which builds the output vectors, is one too
    assert "EXP(" not in pruned and pruned.count("UDF(") == 1
    everything = _plan(model.transform(frame))
    assert everything.count("ArrowEvalPython") == 1  # three columns, one forward pass
    assert "EXP(" in everything and everything.count("UDF(") == 3
    # three classes: the softmax is plain expressions, which Spark compiles; no
    # higher-order function, which it would interpret element by element
    assert "lambdafunction" not in everything
    # the thresholded prediction reads the probabilities; alone, it still builds no vector
    ruled = model.copy().setThresholds([0.5, 0.2, 0.3])
    thresholded = _plan(ruled.transform(frame).select("prediction"))
    assert thresholded.count("ArrowEvalPython") == 1 and "EXP(" in thresholded
    assert thresholded.count("UDF(") == 1 and "lambdafunction" not in thresholded
    assert (
        _plan(ruled.transform(frame).select("prediction", "probability")).count("ArrowEvalPython")
        == 1
    )


def _torch_columns(model: Any, rows: list[Any]) -> pa.StructArray:
    """The columns of ``rows``' features as the UDF computed them before they were
    Spark expressions: one forward pass, :meth:`_InferencePlan.outputs` in torch."""
    plan = _InferencePlan(
        token=model._token,
        weights=InlineWeights(b""),
        model_fn=model.getModelFn(),
        model_kwargs=model.getModelKwargsDict(),
        num_features=4,
        kind=model._kind,
        threads=1,
        fields=ALL if model._kind == "classification" else ("prediction",),
        label_stats=model._label_stats,
        thresholds=model._thresholds(),
    )
    x = np.array([r.features.toArray() for r in rows], np.float32)
    with torch.inference_mode():
        return plan.outputs(model._scoring_module()(torch.from_numpy(x)))


@pytest.mark.parametrize(
    ("out_features", "params"),
    [
        (3, {}),
        (3, {"thresholds": [0.5, 0.2, 0.3]}),
        (3, {"thresholds": [1.0, 0.0, 1.0]}),
        (1, {"loss": "bce_with_logits"}),
        (1, {"loss": "bce_with_logits", "thresholds": [0.3, 0.7]}),
    ],
)
def test_columns_equal_the_torch_computation(frame, out_features, params):  # type: ignore[no-untyped-def]
    model = _model(TorchClassificationModel, out_features)._set(**params)
    rows = model.transform(frame).orderBy("id").collect()
    want = _torch_columns(model, rows)
    raw = np.array([r.rawPrediction.toArray() for r in rows])
    np.testing.assert_array_equal(raw, np.array(want.field("rawPrediction").to_pylist()))
    probability = np.array([r.probability.toArray() for r in rows])
    # torch's and the JVM's exp may round the last bit apart
    np.testing.assert_allclose(
        probability, np.array(want.field("probability").to_pylist()), rtol=1e-14, atol=1e-300
    )
    assert [r.prediction for r in rows] == want.field("prediction").to_pylist()
    # the prediction alone is the same column
    alone = model.transform(frame).orderBy("id").select("prediction").collect()
    assert [r.prediction for r in alone] == want.field("prediction").to_pylist()


@pytest.mark.parametrize(
    ("bias", "classes"),
    [
        ([1.0, 3.0, 3.0], 1.0),  # a tie: the first, as torch's argmax
        ([0.0, 0.0, 0.0], 0.0),
        ([-800.0, -799.0, -801.0], 1.0),  # exp underflows without the max subtracted
    ],
)
def test_ties_and_extremes_predict_as_torch(frame, bias, classes):  # type: ignore[no-untyped-def]
    model = _model(TorchClassificationModel, 3, bias=bias)
    rows = model.transform(frame).select("probability", "prediction").collect()
    assert {r.prediction for r in rows} == {classes}
    want = torch.softmax(torch.tensor(bias, dtype=torch.float64), 0).numpy()
    np.testing.assert_allclose(rows[0].probability.toArray(), want, rtol=1e-14)


@pytest.mark.parametrize(("z", "classes"), [(-2.0, 0.0), (1e-30, 0.0), (3.0, 1.0)])
def test_a_single_logit_predicts_as_its_probabilities(frame, z, classes):  # type: ignore[no-untyped-def]
    """sigmoid(1e-30) is 0.5 in float64: a tie, the first class, as the probabilities'
    argmax (not z > 0)."""
    model = _model(TorchClassificationModel, 1, bias=[z])._set(loss="bce_with_logits")
    row = model.transform(frame).select("rawPrediction", "probability", "prediction").first()
    assert row.prediction == classes
    z = float(np.float32(z))  # the model's float32 output
    assert row.rawPrediction.toArray().tolist() == [-z, z]
    p1 = torch.sigmoid(torch.tensor(z, dtype=torch.float64)).item()
    np.testing.assert_allclose(row.probability.toArray(), [1 - p1, p1], rtol=1e-15)


@pytest.mark.parametrize("stats", [None, (152.0, 77.5)])
def test_regression_prediction_equals_the_torch_computation(frame, stats):  # type: ignore[no-untyped-def]
    model = _model(TorchRegressionModel, 1, label_stats=stats)
    query = model.transform(frame)
    assert _plan(query).count("ArrowEvalPython") == 1
    assert not query.schema["prediction"].nullable
    rows = query.orderBy("id").collect()
    # float64 product and sum on both sides: bit for bit
    assert [r.prediction for r in rows] == _torch_columns(model, rows).field(
        "prediction"
    ).to_pylist()
