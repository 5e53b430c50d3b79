"""label_scaling on Spark: diabetes (targets 25..346) trains with a learning rate that
diverges on the raw targets, the metric comes back in label units, and the returned model
predicts in label units, for a barrier strategy and for tree_aggregate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparktrain import Trainer
from sparktrain.builders import LabelScaled
from sparktrain.errors import DivergedError
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


@pytest.mark.parametrize("strategy", ["ring", "tree_aggregate"])
def test_scaled_labels_train_where_raw_ones_diverge(spark, strategy):  # type: ignore[no-untyped-def]
    train, test, x_test, y_train, y_test = _diabetes(spark)
    kwargs = {"in_features": 10, "hidden": [32], "out_features": 1}
    cfg = fast_config(loss="mse", lr=0.05, epochs=30, strategy=strategy)
    with pytest.raises(DivergedError):
        Trainer("sparktrain.models:mlp", cfg, model_kwargs=kwargs).fit(train)
    result = Trainer(
        "sparktrain.models:mlp", cfg.replace(label_scaling=True), model_kwargs=kwargs
    ).fit(train, validation_data=test)
    assert isinstance(result.model, LabelScaled)
    stats = result.summary["label_scaling"]
    assert stats["mean"] == pytest.approx(y_train.mean())
    assert stats["std"] == pytest.approx(y_train.std())
    with torch.no_grad():
        predicted = result.model(torch.from_numpy(x_test)).reshape(-1).numpy()
    rmse = float(np.sqrt(np.mean((predicted - y_test) ** 2)))
    baseline = float(np.sqrt(np.mean((y_test - y_train.mean()) ** 2)))
    assert rmse < 0.85 * baseline, (rmse, baseline)
    # the reported metric is the test RMSE in label units (float32 on the workers)
    assert result.summary["metric_name"] == "rmse"
    assert result.summary["metric_value"] == pytest.approx(rmse, rel=1e-3)
