"""End to end on local[2]: real Spark barrier stages, real sockets, real digits."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from sparktrain import Trainer
from sparktrain.cli import main as cli_main
from sparktrain.errors import DataError, ResourceError

from .fixtures import (
    DIGITS_MODEL,
    SUMMARY_KEYS,
    accuracy,
    digits,
    digits_frames,
    digits_rdd,
    fast_config,
)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.mark.parametrize(("strategy", "vector"), [("ring", False), ("tree", True)])
def test_digits_mlp_reaches_95_percent(spark, strategy, vector, tmp_path):
    train, test = digits_frames(spark, vector=vector)
    cols = {"features_col": "pixels"} if vector else {}
    jsonl = tmp_path / "epochs.jsonl"
    cfg = fast_config(strategy=strategy, metrics_jsonl=str(jsonl))
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test, **cols)
    s = result.summary
    assert set(s) >= SUMMARY_KEYS
    assert s["metric_name"] == "accuracy" and s["metric_value"] >= 0.95
    # the driver's model is the trained one, not a fresh copy
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) == pytest.approx(s["metric_value"])
    assert s["replicas_in_sync"]
    assert s["train_samples"] == len(split.y_train)
    assert s["bytes_sent"] > 0 and s["wire_bytes"] > s["bytes_sent"]
    assert len(result.history) == 20 and result.history[-1]["loss"] < result.history[0]["loss"]
    # rank 0's progress channel delivered every epoch to the driver
    epochs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == list(range(20))
    assert epochs[-1]["metric"] == pytest.approx(s["metric_value"])


def test_rdd_with_more_partitions_than_workers_is_repartitioned(spark, caplog):
    caplog.set_level(logging.INFO, logger="sparktrain")
    result = Trainer(DIGITS_MODEL, fast_config(epochs=8, validation_fraction=0.2), spark=spark).fit(
        digits_rdd(spark, partitions=5)
    )
    assert "repartitioning the data from 5 partitions to num_workers=2" in caplog.text
    assert result.summary["metric_value"] > 0.9
    assert 0.7 * len(digits().y_train) < result.summary["train_samples"] < len(digits().y_train)


def test_an_empty_partition_does_not_deadlock(spark):
    sc = spark.sparkContext
    split = digits()
    rows = [
        (x.tolist(), float(y))
        for x, y in zip(split.x_train[:300], split.y_train[:300], strict=True)
    ]
    # all rows in partition 0, none in partition 1 (and no union, which would be shuffled)
    rdd = sc.parallelize([0, 1], 2).flatMap(lambda i: rows if i == 0 else [])
    assert rdd.glom().map(len).collect() == [300, 0]
    result = Trainer(DIGITS_MODEL, fast_config(epochs=2), spark=spark).fit(rdd)
    assert result.summary["train_samples"] == 300
    assert sorted(result.summary["train_rows_per_worker"]) == [0, 300]
    assert result.summary["metric_name"] == "train_accuracy"
    assert result.summary["replicas_in_sync"]


def test_a_union_input_is_shuffled_for_the_barrier_stage(spark, caplog):
    caplog.set_level(logging.INFO, logger="sparktrain")
    split = digits()
    rows = [(x.tolist(), float(y)) for x, y in zip(split.x_train, split.y_train, strict=True)]
    sc = spark.sparkContext
    rdd = sc.parallelize(rows[:500], 1).union(sc.parallelize(rows[500:], 1))
    result = Trainer(DIGITS_MODEL, fast_config(epochs=2), spark=spark).fit(rdd)
    assert "shuffling it into 2 partitions" in caplog.text
    assert result.summary["train_samples"] == len(rows)


def test_regression_reports_rmse(spark):
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    rows = [
        (xi.astype(np.float32).tolist(), float(yi) / 100.0) for xi, yi in zip(x, y, strict=True)
    ]
    rdd = spark.sparkContext.parallelize(rows, 2)
    cfg = fast_config(
        loss="mse",
        optimizer="adam",
        optimizer_kwargs={},
        lr=0.01,
        epochs=30,
        validation_fraction=0.2,
    )
    result = Trainer(
        "sparktrain.models:mlp",
        cfg,
        model_kwargs={"in_features": 10, "hidden": [32], "out_features": 1},
        spark=spark,
    ).fit(rdd)
    s = result.summary
    assert s["metric_name"] == "rmse"
    baseline = float(np.std(y / 100.0))  # predicting the mean
    assert math.isfinite(s["metric_value"]) and s["metric_value"] < baseline


def test_cli_train_writes_the_summary(spark, tmp_path, capsys):
    out = tmp_path / "summary.json"
    code = cli_main(
        [
            "train",
            "conf/digits_mlp.toml",
            "--set",
            "epochs=3",
            "--set",
            "strategy=tree",
            "--set",
            "progress=false",
            "--summary-json",
            str(out),
        ]
    )
    assert code == 0
    summary = json.loads(out.read_text())
    assert set(summary) >= SUMMARY_KEYS and summary["strategy"] == "tree"
    printed = capsys.readouterr().out
    assert "test accuracy" in printed and "bytes sent" in printed


def test_cli_reports_bad_keys_without_a_traceback(spark, capsys):
    code = cli_main(["train", "conf/digits_mlp.toml", "--set", "stratgy=ring"])
    assert code == 2
    assert "unknown config key 'stratgy'" in capsys.readouterr().err


# ------------------------------------------------------------------ clear errors, no hangs
def test_missing_column(spark):
    train, _ = digits_frames(spark)
    with pytest.raises(DataError, match="has no column 'pixels'"):
        Trainer(DIGITS_MODEL, fast_config(), spark=spark).fit(train, features_col="pixels")


def test_wrong_feature_width(spark):
    train, _ = digits_frames(spark)
    with pytest.raises(DataError, match="does not accept features of width 64"):
        Trainer(
            "sparktrain.models:mlp", fast_config(), model_kwargs={"in_features": 32}, spark=spark
        ).fit(train)


def test_nan_features_fail_every_task_with_our_message(spark):
    split = digits()
    x = split.x_train[:200].copy()
    x[17, 3] = np.nan
    rows = [(xi.tolist(), float(yi)) for xi, yi in zip(x, split.y_train[:200], strict=True)]
    rdd = spark.sparkContext.parallelize(rows, 2)
    with pytest.raises(DataError, match="1 rows have NaN or infinite features"):
        Trainer(DIGITS_MODEL, fast_config(epochs=1), spark=spark).fit(rdd)


def test_more_workers_than_slots(spark):
    train, _ = digits_frames(spark)
    with pytest.raises(ResourceError, match="num_workers=3 needs 3 task slots.*offers 2"):
        Trainer(DIGITS_MODEL, fast_config(num_workers=3), spark=spark).fit(train)


def test_session_is_still_usable_after_failures(spark):
    assert spark.sparkContext.parallelize(range(10), 2).sum() == 45


def test_the_stage_meets_in_the_drivers_rendezvous_once(spark, monkeypatch):
    import sparktrain.driver.stage_runner as stage_module
    from sparktrain.driver.services.rendezvous import RendezvousServer

    servers: list[RendezvousServer] = []

    class Recorded(RendezvousServer):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            servers.append(self)

    monkeypatch.setattr(stage_module, "RendezvousServer", Recorded)
    train, test = digits_frames(spark)
    result = Trainer(DIGITS_MODEL, fast_config(epochs=2), spark=spark).fit(
        train, validation_data=test
    )
    assert result.summary["replicas_in_sync"]
    # one attempt, one all-gather through our server (none through Spark's polled one)
    assert [s.rounds_completed for s in servers] == [1]


def test_python_workers_fork_from_the_daemon_that_preloaded_torch(spark):
    def inspect(_rows):  # type: ignore[no-untyped-def]
        import os
        import sys

        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            parent = fh.read().replace(b"\0", b" ").decode()
        yield parent, "torch" in sys.modules, "torch._dynamo" in sys.modules

    seen = spark.sparkContext.parallelize(range(2), 2).mapPartitions(inspect).collect()
    assert all("sparktrain.driver.daemon" in parent for parent, _, _ in seen), seen
    assert all(torch and dynamo for _, torch, dynamo in seen), seen
