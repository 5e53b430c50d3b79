"""label_scaling on Spark: on diabetes (targets 25..346) a model that cannot learn the raw
targets learns the standardised ones, the metric comes back in label units, and the model
predicts in label units, on every path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparktrain import Trainer
from sparktrain.builders import LabelScaled
from tests.integration.fixtures import fast_config


def _diabetes(spark):  # type: ignore[no-untyped-def]
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    x, y = load_diabetes(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0)

    def frame(xs, ys):  # type: ignore[no-untyped-def]
        rows = [(r.tolist(), float(t)) for r, t in zip(xs, ys, strict=True)]
        return spark.createDataFrame(rows, "features array<double>, label double").repartition(2)

    return frame(xtr, ytr), frame(xte, yte), xte.astype(np.float32), ytr, yte


def _rmse(model, x, y):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).reshape(-1).numpy()
    return float(np.sqrt(np.mean((predicted - y) ** 2)))


def test_scaled_labels_learn_where_raw_ones_do_not(spark):  # type: ignore[no-untyped-def]
    train, test, x_test, y_train, y_test = _diabetes(spark)
    kwargs = {"in_features": 10, "hidden": [32], "out_features": 1}
    # scikit-learn's diabetes features come scaled to ~0.05: standardising them too
    # would take the raw labels' run from stuck to diverged at this rate
    cfg = fast_config(loss="mse", lr=0.02, epochs=10, batch_size=16, feature_scaling=False)
    baseline = float(np.sqrt(np.mean((y_test - y_train.mean()) ** 2)))  # predict the mean
    # label_scaling="auto" scales an mse fit's label: False is the raw labels' run
    raw = Trainer(
        "sparktrain.models:mlp", cfg.replace(label_scaling=False), model_kwargs=kwargs
    ).fit(train)
    assert _rmse(raw.model, x_test, y_test) > 0.95 * baseline  # targets ~150: stuck
    result = Trainer(
        "sparktrain.models:mlp", cfg.replace(label_scaling=True), model_kwargs=kwargs
    ).fit(train, validation_data=test)
    assert isinstance(result.model, LabelScaled)
    stats = result.summary["label_scaling"]
    assert stats["mean"] == pytest.approx(y_train.mean())
    assert stats["std"] == pytest.approx(y_train.std())
    rmse = _rmse(result.model, x_test, y_test)
    assert rmse < 0.9 * baseline, (rmse, baseline)
    # the reported metric is the test RMSE in label units (float32 on the workers)
    assert result.summary["metric_name"] == "rmse"
    assert result.summary["metric_value"] == pytest.approx(rmse, rel=1e-3)


@pytest.mark.parametrize("strategy", ["tree_aggregate", "tree"])
def test_every_path_reports_rmse_in_label_units(spark, strategy):  # type: ignore[no-untyped-def]
    train, test, x_test, _, y_test = _diabetes(spark)
    kwargs = {"in_features": 10, "out_features": 1}
    cfg = fast_config(loss="mse", lr=0.02, epochs=2, label_scaling=True, strategy=strategy)
    result = Trainer("sparktrain.models:mlp", cfg, model_kwargs=kwargs).fit(
        train, validation_data=test
    )
    assert result.summary["metric_value"] == pytest.approx(
        _rmse(result.model, x_test, y_test), rel=1e-3
    )
