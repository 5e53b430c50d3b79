"""Defaults that train under ``Trainer.fit``: a newcomer's fit (model, data, workers; the
loss for regression) on raw scikit-learn tables, against MLlib's own defaults on the same
split in the same session. The features are standardised (``feature_scaling="auto"``, as
MLlib's ``standardization``), a regression's label too (``label_scaling="auto"``), and the
returned model takes raw features and predicts in label units. The fit says once which
changed defaults it runs on.

The figures: ``pytest -s tests/integration/test_trainer_defaults.py`` prints them."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from pyspark.ml.linalg import Vectors
from pyspark.ml.regression import LinearRegression

from sparktrain import DefaultsChangedWarning, TrainConfig, Trainer
from sparktrain.builders import FeatureScaled, LabelScaled
from sparktrain.driver import job
from sparktrain.errors import DataError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def _frames(spark, loader, stratify: bool):  # type: ignore[no-untyped-def]
    """(train as arrays, train as ml Vectors, test features, test labels): 75/25."""
    from sklearn.model_selection import train_test_split

    x, y = loader(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(
        x, y, test_size=0.25, random_state=0, stratify=y if stratify else None
    )
    rows = list(zip(xtr.tolist(), ytr.astype(float).tolist(), strict=True))
    arrays = spark.createDataFrame(rows, ["features", "label"]).repartition(2)
    vectors = spark.createDataFrame(
        [(Vectors.dense(f), label) for f, label in rows], ["features", "label"]
    )
    return arrays, vectors, xte, yte


def _outputs(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor(x, dtype=torch.float32)).numpy()


def _mllib(model, x: np.ndarray) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.array([model.predict(Vectors.dense(row)) for row in x])


def test_digits_with_only_model_data_and_workers_rivals_logistic_regression(  # type: ignore[no-untyped-def]
    spark, monkeypatch
):
    from sklearn.datasets import load_digits

    monkeypatch.setattr(job, "_ANNOUNCED", set())
    arrays, _, xte, yte = _frames(spark, load_digits, stratify=True)
    # MLlib's LogisticRegression with its defaults on this split: 0.9556 (the same run's
    # figure in the defaults benchmark, docs/results.md; its L-BFGS fit takes 30 s here)
    baseline = 0.9556
    with pytest.warns(DefaultsChangedWarning, match="optimizer 'sgd' -> 'adam'"):
        result = Trainer("sparktrain.models:digits_mlp", TrainConfig(num_workers=2)).fit(arrays)
    accuracy = float((_outputs(result.model, xte).argmax(1) == yte).mean())
    print(f"\ndigits accuracy: Trainer defaults {accuracy:.4f} (LogisticRegression {baseline})")
    assert accuracy >= baseline - 0.01, (accuracy, baseline)
    assert isinstance(result.model, FeatureScaled)  # takes the raw 0..16 pixels
    assert result.summary["feature_scaling"] == {"features": 64}
    assert "label_scaling" not in result.summary  # class labels stay as they are
    with warnings.catch_warnings():
        warnings.simplefilter("error", DefaultsChangedWarning)  # said once a process
        plain = TrainConfig(num_workers=2, epochs=1, feature_scaling=False)
        again = Trainer("sparktrain.models:digits_mlp", plain).fit(arrays)
    assert not isinstance(again.model, FeatureScaled) and "feature_scaling" not in again.summary


def test_diabetes_regression_rivals_linear_regression_in_label_units(spark):  # type: ignore[no-untyped-def]
    from sklearn.datasets import load_diabetes

    arrays, vectors, xte, yte = _frames(spark, load_diabetes, stratify=False)

    def r2(predictions: np.ndarray) -> float:
        return float(1 - ((predictions - yte) ** 2).sum() / ((yte - yte.mean()) ** 2).sum())

    baseline = r2(_mllib(LinearRegression().fit(vectors), xte))
    cfg = TrainConfig(num_workers=2, loss="mse")
    model_kwargs = {"in_features": 10, "hidden": [32], "out_features": 1}
    result = Trainer("sparktrain.models:mlp", cfg, model_kwargs=model_kwargs).fit(arrays)
    score = r2(_outputs(result.model, xte)[:, 0])
    print(f"\ndiabetes R2: Trainer defaults {score:.4f}, LinearRegression {baseline:.4f}")
    assert score >= baseline - 0.05, (score, baseline)
    assert isinstance(result.model, LabelScaled) and isinstance(result.model.inner, FeatureScaled)
    assert set(result.summary) >= {"label_scaling", "feature_scaling"}


def test_feature_scaling_asked_for_where_it_cannot_apply_says_what_to_do(spark):  # type: ignore[no-untyped-def]
    frame = spark.createDataFrame([(1.0, 2.0, 0.0), (3.0, 4.0, 1.0)], ["a", "b", "label"])
    cfg = TrainConfig(num_workers=1, epochs=1, feature_scaling=True)
    trainer = Trainer("sparktrain.models:mlp", cfg, model_kwargs={"in_features": 2})
    with pytest.raises(DataError, match="several or typed columns.*StandardScaler"):
        trainer.fit(frame, features_col=["a", "b"])
