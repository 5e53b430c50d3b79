"""A run that diverges stops at once on every rank with an error that says where and what
to try, and is not resubmitted (a restart would diverge again); the ml regressor that
used to return NaN predictions silently now says why it stopped."""

from __future__ import annotations

import pytest

from sparktrain import Trainer
from sparktrain.driver import stage_runner as stage
from sparktrain.errors import DivergedError
from tests.integration.fixtures import fast_config


def _diabetes_frames(spark, standardised: bool = False):  # type: ignore[no-untyped-def]
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)  # targets 25..346: an MSE in the tens of thousands
    if standardised:  # what a StandardScaler stage makes of the features
        x = (x - x.mean(axis=0)) / x.std(axis=0)
    rows = [(r.tolist(), float(t)) for r, t in zip(x, y, strict=True)]
    return spark.createDataFrame(rows, "features array<double>, label double").repartition(2)


@pytest.mark.parametrize("strategy", ["ring", "tree_aggregate"])
def test_a_diverging_fit_stops_with_the_step_and_is_not_resubmitted(  # type: ignore[no-untyped-def]
    spark, strategy, monkeypatch, caplog
):
    attempts = []  # the barrier stages launched (tree_aggregate's rounds are plain jobs)
    attempt = stage._attempt

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        attempts.append(1)
        return attempt(*args, **kwargs)

    monkeypatch.setattr(stage, "_attempt", counted)
    df = _diabetes_frames(spark)
    cfg = fast_config(loss="mse", lr=10.0, max_restarts=2, strategy=strategy)
    with pytest.raises(
        DivergedError, match=r"epoch \d+, step \d+ of \d+: the training loss is"
    ) as err:
        Trainer(
            "sparktrain.models:mlp", cfg, model_kwargs={"in_features": 10, "out_features": 1}
        ).fit(df)
    assert "lower lr (now 10)" in str(err.value)
    # one attempt, not three (max_restarts=2)
    assert "resubmitting" not in caplog.text
    assert len(attempts) == (1 if strategy == "ring" else 0)


def test_the_ml_regressor_says_why_instead_of_returning_nan(spark):  # type: ignore[no-untyped-def]
    from sparktrain.ml import TorchRegressor

    # the estimator's defaults before labelScaling (SGD at 0.01, 10 epochs), on scaled
    # features and raw targets: the run that used to end in NaN predictions
    reg = TorchRegressor(
        modelFn="sparktrain.models:mlp",
        modelKwargs={"in_features": 10, "hidden": [32], "out_features": 1},
        optimizer="sgd",
        learningRate=0.01,
        maxEpochs=10,
        labelScaling=False,
    )
    with pytest.raises(DivergedError, match="StandardScaler"):
        reg.fit(_diabetes_frames(spark, standardised=True))
