"""The built-in loop's newer knobs end to end on local[2] with the digits data: a schedule
with warm-up, bf16, accumulation and clipping (ring), bf16 against fp32, early stopping
that returns the best model, the TensorBoard and MLflow loggers and a callback on a real
fit, the ml estimator's ``earlyStopping`` and ``metrics`` in a Pipeline, and what the
parameter server takes of them.

bf16 against fp32 (the target: within 1 pp on digits) is printed and recorded as a
property; to see the figures::

    pytest tests/integration/test_loop_features.py -k bf16_within -s
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain import Callback, Trainer
from sparktrain.builders import FeatureScaled
from sparktrain.driver.job import check_job
from sparktrain.errors import ConfigError
from sparktrain.models import digits_mlp

from .fixtures import DIGITS_MODEL, accuracy, digits, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

# The knobs of (a) and (b): 11 optimizer steps an epoch (22 batches of 32, two a step),
# a cosine decay over the whole run after 20 warm-up steps, gradients clipped to norm 1.
STEPPED = {
    "lr": 0.2,
    "lr_schedule": "CosineAnnealingLR",
    "warmup_steps": 20,
    "accumulate_steps": 2,
    "clip_grad_norm": 1.0,
}


@pytest.fixture(scope="module")
def bf16_and_fp32(_sessions) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The digits MLP trained twice with the same settings, bf16 and fp32, in one run."""
    spark = _sessions.get("local[2]")
    train, test = digits_frames(spark)
    return {
        precision: Trainer(
            DIGITS_MODEL, fast_config(precision=precision, **STEPPED), spark=spark
        ).fit(train, validation_data=test)
        for precision in ("bf16", "fp32")
    }


def test_bf16_with_schedule_accumulation_and_clipping_reaches_95_percent(spark, bf16_and_fp32):
    result = bf16_and_fp32["bf16"]
    s = result.summary
    assert s["precision"] == "bf16" and s["strategy"] == "ring"
    assert s["metric_name"] == "accuracy" and s["metric_value"] >= 0.95
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) == pytest.approx(s["metric_value"])
    assert s["replicas_in_sync"]
    # 22 batches an epoch, two to an optimizer step
    assert s["steps_per_epoch"] == 22
    rates = [h["lr"] for h in result.history]
    # the rate after each epoch: still warming up after the first (11 of 20 steps), then
    # decayed by the cosine towards 0 at the run's end
    assert rates[0] < rates[1] <= STEPPED["lr"]
    assert all(a > b for a, b in itertools.pairwise(rates[1:]))
    assert rates[-1] < 1e-3 < rates[len(rates) // 2]


def test_bf16_within_one_point_of_fp32(spark, bf16_and_fp32, record_property):
    bf16, fp32 = (bf16_and_fp32[p].summary["metric_value"] for p in ("bf16", "fp32"))
    print(f"\ndigits MLP test accuracy, ring, world 2: bf16 {bf16:.4f}  fp32 {fp32:.4f}")
    record_property("bf16_accuracy", bf16)
    record_property("fp32_accuracy", fp32)
    assert bf16_and_fp32["fp32"].summary["precision"] == "fp32"
    assert abs(bf16 - fp32) <= 0.01


def test_early_stopping_returns_the_best_epochs_model(spark):
    train, test = digits_frames(spark)
    cfg = fast_config(
        epochs=30,
        early_stopping={"metric": "accuracy", "patience": 2, "restore_best": True},
        feature_scaling=False,  # the figures below are the raw pixels' run
    )
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    s, history = result.summary, result.history
    stop = s["early_stopping"]
    scores = [h["accuracy"] for h in history]
    assert s["epochs_run"] == len(history) < 30
    assert history[-1]["early_stop"] is True
    assert not any(h.get("early_stop") for h in history[:-1])
    assert stop["metric"] == "accuracy" and stop["mode"] == "max" and stop["restored_best"]
    assert stop["stopped_at"] == len(history) - 1
    # the best is the first epoch at the maximum (a tie is no improvement), and the run
    # stopped `patience` epochs later
    assert stop["best"] == max(scores) and stop["best_epoch"] == scores.index(max(scores))
    assert stop["stopped_at"] - stop["best_epoch"] == 2
    # this run ends below its best (0.953 after 0.962 at epoch 7), so the model returned
    # is not the last one: the same evaluation gives the best epoch's figure
    assert scores[-1] < stop["best"]
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) == pytest.approx(
        stop["best"], abs=1e-6
    )
    print(f"\nearly stopping: accuracies {scores}, best epoch {stop['best_epoch']}")


def test_tensorboard_mlflow_and_a_callback_on_a_real_fit(spark, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    train, test = digits_frames(spark)
    tb_dir, uri = tmp_path / "tb", f"file:{tmp_path}/mlruns"
    epochs = 4
    cfg = fast_config(
        epochs=epochs,
        metrics=["macro_f1"],
        tensorboard_dir=str(tb_dir),
        mlflow_tracking_uri=uri,
        mlflow_experiment="loop-features",
    )

    class Seen(Callback):
        def __init__(self) -> None:
            self.records: list[dict[str, Any]] = []
            self.began = self.ended = 0

        def on_train_begin(self, info: dict[str, Any]) -> None:
            self.began += 1

        def on_epoch_end(self, record: dict[str, Any], history: list[dict[str, Any]]) -> None:
            assert history[-1] == record
            # slower than an epoch: the last records are still on their way when the
            # stage ends, and must reach the callbacks all the same
            time.sleep(0.4)
            self.records.append(record)

        def on_train_end(self, summary: dict[str, Any], model: Any) -> None:
            self.ended += 1

    seen, plain = Seen(), []
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(
        train,
        validation_data=test,
        callbacks=[seen, lambda record, history: plain.append(record["epoch"])],
    )
    history = result.history
    assert len(history) == epochs

    # the callbacks: every epoch record, in order, once; begin and end once
    assert [r["epoch"] for r in seen.records] == list(range(epochs)) == plain
    assert seen.began == seen.ended == 1
    for record, h in zip(seen.records, history, strict=True):
        assert record["accuracy"] == h["accuracy"] and record["macro_f1"] == h["macro_f1"]

    # TensorBoard: one scalar per figure per epoch, at step = epoch
    events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "accuracy", "macro_f1", "lr", "seconds"} <= tags
    for tag in ("loss", "accuracy", "macro_f1"):
        scalars = events.Scalars(tag)
        assert [e.step for e in scalars] == list(range(epochs))
        assert [e.value for e in scalars] == pytest.approx([h[tag] for h in history], rel=1e-6)

    # MLflow: the config as params, per-epoch metric histories, the weights as an artifact
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("loop-features")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["epochs"] == str(epochs) and params["strategy"] == "ring"
    assert json.loads(params["metrics"]) == ["macro_f1"]
    for key in ("loss", "accuracy", "macro_f1"):
        metric = client.get_metric_history(run.info.run_id, key)
        by_step = {m.step: m.value for m in metric}
        assert sorted(by_step) == list(range(epochs))
        assert [by_step[e] for e in range(epochs)] == pytest.approx([h[key] for h in history])
    assert run.data.metrics["summary.metric_value"] == pytest.approx(result.summary["metric_value"])
    local = Path(client.download_artifacts(run.info.run_id, "model/state_dict.pt", str(tmp_path)))
    state = torch.load(local, weights_only=True)
    # feature_scaling="auto" returns FeatureScaled(module, mean, std): the module's keys
    # gain "inner.", beside the two figures
    model = FeatureScaled(digits_mlp(), torch.zeros(64), torch.ones(64))
    model.load_state_dict(state)
    assert torch.equal(model.get_buffer("feature_std"), result.model.get_buffer("feature_std"))
    trained = result.model.state_dict()
    assert set(state) == set(trained)
    assert all(torch.equal(state[k], trained[k]) for k in trained)
    summary = json.loads(
        Path(client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))).read_text()
    )
    assert summary["metric_value"] == pytest.approx(result.summary["metric_value"])


PIXELS = [f"p{i}" for i in range(64)]


def test_estimator_with_early_stopping_and_metrics_in_a_pipeline(spark):
    import pandas as pd
    from pyspark.ml import Pipeline
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    from sparktrain.ml import TorchClassificationModel, TorchClassifier

    split = digits()

    def frame(x: np.ndarray, y: np.ndarray):  # type: ignore[no-untyped-def]
        pdf = pd.DataFrame(x.astype(np.float64), columns=PIXELS)
        pdf["label"] = y.astype(np.float64)
        return spark.createDataFrame(pdf).repartition(2)

    train, test = frame(split.x_train, split.y_train), frame(split.x_test, split.y_test)
    features: list[Any] = [
        VectorAssembler(inputCols=PIXELS, outputCol="raw"),
        StandardScaler(inputCol="raw", outputCol="scaled"),
    ]
    watch = '{"metric": "accuracy", "patience": 2}'
    # an estimator has no validation data unless validationFraction holds some back:
    # its epochs report train_accuracy, and the workers say so before training
    scaled = Pipeline(stages=features).fit(train).transform(train)
    bare = TorchClassifier(
        modelFn=DIGITS_MODEL, featuresCol="scaled", earlyStopping=watch, metrics=["macro_f1"]
    )
    with pytest.raises(ConfigError, match="validationFraction"):
        bare.fit(scaled)

    clf = TorchClassifier(
        modelFn=DIGITS_MODEL,
        featuresCol="scaled",
        optimizer="adam",
        learningRate=0.003,
        maxEpochs=40,
        validationFraction=0.2,
        earlyStopping=watch,
        metrics=["macro_f1"],
    )
    model = Pipeline(stages=[*features, clf]).fit(train)
    torch_model = model.stages[-1]
    assert isinstance(torch_model, TorchClassificationModel)
    s = torch_model.summary
    history = s["history"]
    stop = s["early_stopping"]
    assert s["metric_name"] == "accuracy" and s["config"]["metrics"] == ["macro_f1"]
    assert s["epochs_run"] == len(history) < 40
    assert stop["stopped_at"] == len(history) - 1 and history[-1]["early_stop"] is True
    assert stop["metric"] == "accuracy" and not stop["restored_best"]
    assert stop["best"] == max(h["accuracy"] for h in history)
    assert all(0.0 <= h["macro_f1"] <= 1.0 for h in history)
    assert history[stop["best_epoch"]]["macro_f1"] > 0.9
    out = model.transform(test)
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(out) >= 0.93
    print(f"\nestimator: stopped at epoch {stop['stopped_at']}, best {stop['best_epoch']}")


def test_parameter_server_with_accumulation_and_bf16(spark):
    train, test = digits_frames(spark)
    cfg = fast_config(strategy="ps", ps_mode="sync", accumulate_steps=2, precision="bf16")
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    s = result.summary
    assert s["strategy"] == "ps" and s["precision"] == "bf16"
    assert s["metric_value"] >= 0.9
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) >= 0.9
    # one push per rank, shard and optimizer step: 22 batches an epoch, two a step
    assert s["ps"]["pushes"] == 11 * cfg.epochs * 2 * 2


def test_parameter_server_refuses_clipping_before_any_spark_job(spark):
    from sparktrain.ml import TorchClassifier

    train, _ = digits_frames(spark)
    sc = spark.sparkContext
    tracker = sc.statusTracker()
    group = "loop-features-ps-clip"
    sc.setJobGroup(group, "must stay empty")
    try:
        before = set(tracker.getJobIdsForGroup(None))
        with pytest.raises(ConfigError, match="clip_grad_norm"):
            check_job(fast_config(strategy="ps", clip_grad_norm=1.0))
        cfg = fast_config(strategy="ps")
        cfg.clip_grad_norm = 1.0  # set after the config was made: the Trainer checks the job
        with pytest.raises(ConfigError, match="clip_grad_norm"):
            Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train)
        clf = TorchClassifier(modelFn=DIGITS_MODEL, strategy="ps", clipGradNorm=1.0)
        with pytest.raises(ConfigError, match="clip_grad_norm"):
            clf.fit(train)
        assert tracker.getJobIdsForGroup(group) == []
        assert set(tracker.getJobIdsForGroup(None)) == before
    finally:
        for key in ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel"):
            sc.setLocalProperty(key, None)  # None: unset
