"""The MLlib class contract of sparktrain.ml on local[2] (issue 35): pyspark.ml's base
classes, ``predict(vector)`` against ``transform``, and the prediction column as MLlib's
(NOT NULL, nominal metadata that ``IndexToString`` and other stages read). One small fit
shared by the module; the checks without Spark: tests/unit/test_ml_contract.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.classification import (
    ClassificationModel,
    LogisticRegression,
    ProbabilisticClassificationModel,
)
from pyspark.ml.feature import IndexToString, StringIndexer, VectorAssembler
from pyspark.ml.linalg import Vectors
from pyspark.ml.regression import RegressionModel

from sparktrain.ml import TorchClassificationModel, TorchClassifier, TorchRegressionModel
from sparktrain.models import mlp
from sparktrain.result import state_to_bytes

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

SPECIES = ("setosa", "versicolor", "virginica")


@pytest.fixture(scope="module")
def fitted(_sessions):  # type: ignore[no-untyped-def]
    """StringIndexer -> VectorAssembler -> TorchClassifier on 90 rows of three string
    classes, fitted once (a few epochs: the contract, not the accuracy, is tested)."""
    spark = _sessions.get("local[2]")
    rng = np.random.default_rng(0)
    rows = [
        (SPECIES[i % 3], *(float(v) for v in rng.normal(i % 3, 0.5, size=4))) for i in range(90)
    ]
    frame = spark.createDataFrame(rows, ["species", "a", "b", "c", "d"])
    pipeline = Pipeline(
        stages=[
            StringIndexer(inputCol="species", outputCol="label"),
            VectorAssembler(inputCols=["a", "b", "c", "d"], outputCol="features"),
            TorchClassifier(
                modelFn="sparktrain.models:mlp",
                modelKwargs={"in_features": 4, "hidden": [8], "out_features": 3},
                maxEpochs=3,
                numWorkers=1,
            ),
        ]
    )
    model = pipeline.fit(frame)
    return model, frame


def test_fitted_stage_is_an_mllib_classification_model(fitted):  # type: ignore[no-untyped-def]
    model, _ = fitted
    stage = model.stages[-1]
    assert isinstance(stage, TorchClassificationModel)
    assert isinstance(stage, ClassificationModel)
    assert isinstance(stage, ProbabilisticClassificationModel)
    assert stage.numClasses == 3 and stage.numFeatures == 4


def test_predict_of_one_vector_is_transforms_row(fitted):  # type: ignore[no-untyped-def]
    model, frame = fitted
    stage = model.stages[-1]
    rows = (
        model.transform(frame)
        .select("features", "rawPrediction", "probability", "prediction")
        .limit(20)
        .collect()
    )
    for row in rows:
        assert stage.predict(row.features) == row.prediction
        raw, prob = stage.predictRaw(row.features), stage.predictProbability(row.features)
        assert raw.size == prob.size == 3
        # the same float32 features and code; a batch of one row may take another
        # matmul kernel than transform's batches, so the last float32 bits may differ
        np.testing.assert_allclose(raw.toArray(), row.rawPrediction.toArray(), rtol=1e-5)
        np.testing.assert_allclose(prob.toArray(), row.probability.toArray(), rtol=1e-5)


def test_prediction_column_is_mllibs(fitted):  # type: ignore[no-untyped-def]
    """NOT NULL, with the nominal attribute MLlib's LogisticRegressionModel writes."""
    model, frame = fitted
    ours = model.transform(frame).schema
    reference = Pipeline(stages=[*model.stages[:-1], LogisticRegression(maxIter=3)])
    theirs = reference.fit(frame).transform(frame).schema
    for name in ("prediction", "rawPrediction", "probability"):
        assert ours[name].metadata == theirs[name].metadata, name
        assert ours[name].nullable == theirs[name].nullable, name
    assert ours["prediction"].metadata == {"ml_attr": {"num_vals": 3, "type": "nominal"}}
    assert not ours["prediction"].nullable


def test_index_to_string_reads_our_predictions(fitted):  # type: ignore[no-untyped-def]
    model, frame = fitted
    labels = model.stages[0].labels
    out = IndexToString(inputCol="prediction", outputCol="predictedSpecies", labels=labels)
    rows = out.transform(model.transform(frame)).select("prediction", "predictedSpecies")
    for row in rows.collect():
        assert row.predictedSpecies == labels[int(row.prediction)]
    # and the label index back to the string it came from
    back = IndexToString(inputCol="label", outputCol="species2").transform(model.transform(frame))
    assert back.filter("species != species2").count() == 0


def test_saved_model_keeps_the_contract(fitted, tmp_path):  # type: ignore[no-untyped-def]
    model, frame = fitted
    model.write().overwrite().save(str(tmp_path / "m"))
    loaded = PipelineModel.load(str(tmp_path / "m"))
    stage = loaded.stages[-1]
    assert isinstance(stage, ProbabilisticClassificationModel)
    x = Vectors.dense([0.0, 1.0, 2.0, 1.0])
    assert stage.predictProbability(x) == model.stages[-1].predictProbability(x)
    assert not loaded.transform(frame).schema["prediction"].nullable


def test_regression_prediction_is_not_null_and_predict_matches(spark):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"in_features": 2, "hidden": [4], "out_features": 1}
    model = TorchRegressionModel()._set_state(
        state_to_bytes(mlp(**kwargs).state_dict()),
        num_features=2,
        num_outputs=1,
        label_stats=(10.0, 3.0),
    )
    model._set(modelFn="sparktrain.models:mlp", modelKwargs=kwargs)
    assert isinstance(model, RegressionModel)
    frame = spark.createDataFrame([(Vectors.dense([float(i), -float(i)]),) for i in range(5)])
    out = model.transform(frame.toDF("features"))
    assert not out.schema["prediction"].nullable
    for row in out.collect():
        assert model.predict(row.features) == pytest.approx(row.prediction, rel=1e-6)
