"""Defaults that train: the ml estimators with only the model set, in the Pipeline a new
user writes (VectorAssembler, StandardScaler, estimator), against MLlib's linear models on
the same split of scikit-learn's bundled tables. The regressor learns standardised labels
(labelScaling, on by default) and predicts in label units, also after save/load.

The figures: ``pytest -s tests/integration/test_ml_defaults.py`` prints them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.classification import LogisticRegression
from pyspark.ml.evaluation import MulticlassClassificationEvaluator, RegressionEvaluator
from pyspark.ml.feature import StandardScaler, VectorAssembler
from pyspark.ml.regression import LinearRegression

from sparktrain.builders import LabelScaled
from sparktrain.ml import (
    TorchClassificationModel,
    TorchClassifier,
    TorchRegressionModel,
    TorchRegressor,
)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def _split(spark, loader, stratify: bool):  # type: ignore[no-untyped-def]
    """(feature columns, train, test, train labels, test labels): 75/25, random_state=0."""
    import pandas as pd
    from sklearn.model_selection import train_test_split

    x, y = loader(return_X_y=True)
    columns = [f"x{i}" for i in range(x.shape[1])]
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y if stratify else None
    )

    def frame(xs: np.ndarray, ys: np.ndarray, offset: int):  # type: ignore[no-untyped-def]
        pdf = pd.DataFrame(xs.astype(np.float64), columns=columns)
        pdf.insert(0, "id", np.arange(offset, offset + len(ys)))
        pdf["label"] = ys.astype(np.float64)
        return spark.createDataFrame(pdf).repartition(2)

    return columns, frame(xtr, ytr, 0), frame(xte, yte, 10**6), ytr, yte


def _pipeline(columns: list[str], estimator):  # type: ignore[no-untyped-def]
    """What a new user writes: assemble, standardise (StandardScaler's defaults), fit."""
    return Pipeline(
        stages=[
            VectorAssembler(inputCols=columns, outputCol="raw"),
            StandardScaler(inputCol="raw", outputCol="features"),
            estimator,
        ]
    )


def test_the_regressor_with_defaults_rivals_linear_regression_on_diabetes(  # type: ignore[no-untyped-def]
    spark, tmp_path
):
    from sklearn.datasets import load_diabetes

    columns, train, test, ytr, yte = _split(spark, load_diabetes, stratify=False)
    evaluator = RegressionEvaluator(metricName="r2")
    linear = _pipeline(columns, LinearRegression()).fit(train)
    baseline = evaluator.evaluate(linear.transform(test))

    regressor = TorchRegressor(
        modelFn="sparktrain.models:mlp",
        modelKwargs={"in_features": len(columns), "hidden": [32], "out_features": 1},
    )
    model = _pipeline(columns, regressor).fit(train)
    out = model.transform(test)
    r2 = evaluator.evaluate(out)
    print(f"\ndiabetes R2: TorchRegressor {r2:.4f}, MLlib LinearRegression {baseline:.4f}")
    assert r2 >= baseline - 0.05, (r2, baseline)

    # finite predictions in label units (targets 25..346), not standardised ones
    rows = out.select("id", "prediction").orderBy("id").collect()
    predictions = np.array([r.prediction for r in rows])
    assert len(predictions) == len(yte) and np.isfinite(predictions).all()
    assert abs(predictions.mean() - ytr.mean()) < 0.25 * ytr.std(), predictions.mean()
    assert 0.3 * ytr.std() < predictions.std() < 1.5 * ytr.std(), predictions.std()
    torch_model = model.stages[-1]
    assert isinstance(torch_model, TorchRegressionModel) and torch_model.getLabelScaling()
    assert torch_model.labelStats is not None
    mean, std = torch_model.labelStats
    assert mean == pytest.approx(ytr.mean(), rel=1e-6) and std == pytest.approx(ytr.std(), rel=1e-6)
    assert torch_model.summary["label_scaling"] == {"mean": mean, "std": std}

    # saved and loaded, the model still un-scales: identical predictions
    model.write().overwrite().save(str(tmp_path / "pipeline_model"))
    meta_file = next((tmp_path / "pipeline_model" / "stages").glob("2_*/metadata/part-*"))
    meta = json.loads(meta_file.read_text())
    assert meta["labelScaling"] == {"mean": mean, "std": std}
    import torch

    weights = next((tmp_path / "pipeline_model" / "stages").glob("2_*/data/weights.pt"))
    state = torch.load(weights, weights_only=True)  # the module modelFn builds, as before
    module = torch_model.getModule()
    assert isinstance(module, LabelScaled) and set(state) == set(module.inner.state_dict())
    loaded = PipelineModel.load(str(tmp_path / "pipeline_model"))
    loaded_stage = loaded.stages[-1]
    assert isinstance(loaded_stage, TorchRegressionModel)
    assert loaded_stage.labelStats == (mean, std)
    again = loaded.transform(test).select("id", "prediction").orderBy("id").collect()
    assert [r.prediction for r in again] == [r.prediction for r in rows]

    # saved before label scaling (no figures, no param): the output is the prediction
    for section in ("paramMap", "defaultParamMap"):
        meta[section].pop("labelScaling", None)
    del meta["labelScaling"]
    meta_file.write_text(json.dumps(meta) + "\n")
    meta_file.with_name(f".{meta_file.name}.crc").unlink(missing_ok=True)  # Hadoop's checksum
    old = TorchRegressionModel.load(str(meta_file.parent.parent))
    assert old.labelStats is None and old.getLabelScaling() is False
    scaled = model.stages[1].transform(model.stages[0].transform(test))
    outputs = old.transform(scaled).select("id", "prediction").orderBy("id").collect()
    want = [(r.prediction - mean) / std for r in rows]
    assert [r.prediction for r in outputs] == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_the_classifier_with_defaults_rivals_logistic_regression_on_breast_cancer(  # type: ignore[no-untyped-def]
    spark,
):
    from sklearn.datasets import load_breast_cancer

    columns, train, test, _, _ = _split(spark, load_breast_cancer, stratify=True)
    evaluator = MulticlassClassificationEvaluator(metricName="accuracy")
    logistic = _pipeline(columns, LogisticRegression()).fit(train)
    baseline = evaluator.evaluate(logistic.transform(test))

    classifier = TorchClassifier(
        modelFn="sparktrain.models:mlp",
        modelKwargs={"in_features": len(columns), "out_features": 2},
    )
    model = _pipeline(columns, classifier).fit(train)
    accuracy = evaluator.evaluate(model.transform(test))
    print(
        f"\nbreast_cancer accuracy: TorchClassifier {accuracy:.4f}, "
        f"MLlib LogisticRegression {baseline:.4f}"
    )
    assert accuracy >= baseline - 0.05, (accuracy, baseline)
    torch_model = model.stages[-1]
    assert isinstance(torch_model, TorchClassificationModel) and torch_model.labelStats is None
    assert torch_model.getOptimizer() == "adam" and torch_model.getMaxEpochs() == 50
