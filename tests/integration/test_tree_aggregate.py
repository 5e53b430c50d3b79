"""strategy="tree_aggregate" end to end: one ordinary Spark job per round, treeAggregate,
driver-side optimizer. Each round is a Spark job (~0.1-0.3 s here), so the settings keep
the round counts small (a few hundred rounds in the whole module)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sparktrain import Trainer
from sparktrain.builders import build_model, resolve_model_fn
from sparktrain.cli import main as cli_main
from sparktrain.driver.prepare import prepare
from sparktrain.errors import DataError
from sparktrain.result import state_to_bytes
from sparktrain.strategies.tree_aggregate.driver import run_rounds
from sparktrain.strategies.tree_aggregate.driver_round import (
    ClassicBackend,
    RoundRunner,
    cache_blocks,
)
from sparktrain.strategies.tree_aggregate.driver_volume import SparkVolume
from sparktrain.strategies.tree_aggregate.task import RoundSpec
from sparktrain.task.faults import FaultPlan

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

TREE_AGGREGATE_KEYS = SUMMARY_KEYS | {
    "rounds",
    "rounds_per_epoch",
    "rounds_per_s",
    "spark_shuffle_bytes",
    "spark_result_bytes",
    "broadcast_bytes",
}


def ta_config(**overrides: Any) -> Any:
    return fast_config(strategy="tree_aggregate", **overrides)


def _cli(tmp_path: Path, *sets: str) -> dict[str, Any]:
    out = tmp_path / "summary.json"
    args = ["train", "conf/digits_mlp.toml", "--set", "strategy=tree_aggregate"]
    for s in ("progress=false", *sets):
        args += ["--set", s]
    assert cli_main([*args, "--summary-json", str(out)]) == 0
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


# ------------------------------------------------------------------ acceptance (issue 4)
def test_digits_local_sgd_8_steps_reaches_95_percent_with_the_conf_defaults(spark, tmp_path):
    # conf/digits_mlp.toml as is (20 epochs, batch 32, lr 0.1, momentum 0.9): 3 rounds/epoch
    s = _cli(tmp_path, "local_steps=8")
    assert set(s) >= TREE_AGGREGATE_KEYS
    assert s["metric_name"] == "accuracy" and s["metric_value"] >= 0.95
    assert s["rounds_per_epoch"] == math.ceil(max(s["train_rows_per_worker"]) / (32 * 8))
    assert s["rounds"] == 20 * s["rounds_per_epoch"] + 1  # + the last epoch's evaluation
    assert s["train_samples"] == len(digits().y_train)
    assert s["bytes_sent"] == s["wire_bytes"] > 0 and s["compression_ratio"] == 1.0
    # Spark's own count of the payloads (the uploads; bytes_sent adds the weight downloads)
    assert s["spark_result_bytes"] >= s["upload_bytes"]
    assert s["bytes_sent"] == s["upload_bytes"] + s["download_bytes"]
    assert s["spark_shuffle_bytes"] == 0  # 2 partitions: treeAggregate needs no extra level
    assert s["rounds_per_s"] > 0


def test_digits_synchronous_sgd_reaches_95_percent(spark, tmp_path):
    # local_steps=1 at the conf's batch 32 is 22 rounds/epoch (~440 Spark jobs, 1.5-2.5 min
    # here; it reaches 0.97); a 4x larger batch with a 2x learning rate keeps this short:
    # 8 epochs reach 0.964-0.967 on seeds 0, 1 and 2
    s = _cli(tmp_path, "local_steps=1", "batch_size=128", "lr=0.2", "epochs=8")
    assert s["metric_value"] >= 0.95
    assert s["rounds_per_epoch"] == math.ceil(max(s["train_rows_per_worker"]) / 128)
    assert len(s["history"]) == 8 and s["history"][-1]["loss"] < s["history"][0]["loss"]


# ------------------------------------------------------------------ semantics
def test_one_epoch_of_synchronous_rounds_matches_the_ring(spark):
    """local_steps=1 is the ring's step: same init, same per-partition batches, the
    gradient of the mean loss over the global mini-batch, the same optimizer."""
    rdd = digits_rdd(spark, partitions=2)
    cfg = dict(epochs=1, batch_size=64, validation_fraction=0.2)
    ring = Trainer(DIGITS_MODEL, fast_config(strategy="ring", **cfg), spark=spark).fit(rdd)
    ours = Trainer(DIGITS_MODEL, ta_config(**cfg), spark=spark).fit(rdd)
    for a, b in zip(ring.model.parameters(), ours.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert ours.summary["steps_per_epoch"] == ring.summary["steps_per_epoch"]
    assert ours.summary["train_rows_per_worker"] == ring.summary["train_rows_per_worker"]
    assert ours.summary["metric_value"] == pytest.approx(ring.summary["metric_value"], abs=1e-3)


def test_more_partitions_than_slots_and_a_real_tree(spark):
    """9 partitions on local[2] (a barrier stage could not start); depth 2 puts one shuffle
    level into treeAggregate, and Spark's stage metrics see its bytes."""
    rdd = digits_rdd(spark, partitions=9)
    cfg = ta_config(num_workers=9, epochs=2, batch_size=16, local_steps=4, validation_fraction=0.2)
    s = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(rdd).summary
    assert s["world_size"] == 9 and len(s["train_rows_per_worker"]) == 9
    assert s["metric_name"] == "accuracy" and s["metric_value"] > 0.5
    assert s["spark_shuffle_bytes"] > 0 and s["spark_shuffle_read_bytes"] > 0
    flat = Trainer(DIGITS_MODEL, cfg.replace(aggregation_depth=1, epochs=1), spark=spark).fit(rdd)
    assert flat.summary["spark_shuffle_bytes"] == 0


def test_progress_and_metrics_jsonl(spark, tmp_path):
    train, test = digits_frames(spark)
    path = tmp_path / "metrics.jsonl"
    cfg = ta_config(epochs=2, batch_size=256, local_steps=2, metrics_jsonl=str(path))
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["epoch"] for line in lines] == [0, 1]
    assert {"type", "loss", "metric_name", "metric", "seconds"} <= set(lines[0])
    assert lines[-1]["metric"] == result.summary["metric_value"]
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) == pytest.approx(
        result.summary["metric_value"]
    )


def test_without_validation_rows_the_train_metric_is_reported(spark):
    train, _ = digits_frames(spark)
    s = Trainer(DIGITS_MODEL, ta_config(epochs=1, batch_size=256), spark=spark).fit(train).summary
    assert s["metric_name"] == "train_accuracy"


def test_nan_features_fail_with_our_message(spark):
    split = digits()
    x = split.x_train[:200].copy()
    x[17, 3] = np.nan
    rows = [(xi.tolist(), float(yi)) for xi, yi in zip(x, split.y_train[:200], strict=True)]
    rdd = spark.sparkContext.parallelize(rows, 2)
    with pytest.raises(DataError, match="1 rows have NaN or infinite features"):
        Trainer(DIGITS_MODEL, ta_config(epochs=1), spark=spark).fit(rdd)


# ------------------------------------------------------------------ task retries
def _fail_once(marker: str, partition: int = 1, round_index: int = 3) -> Any:
    """A task hook that makes one partition's task raise once, on one round."""

    def hook(p: int, r: int) -> None:
        import os

        if p == partition and r == round_index and not os.path.exists(marker):
            with open(marker, "w") as fh:
                fh.write("failed once\n")
            raise RuntimeError("injected task failure")

    return hook


def _prepared_digits(spark):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    return prepare(train, test, "features", "label", 2)


def _seeded_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(resolve_model_fn(DIGITS_MODEL))


def test_a_failed_task_is_retried_and_the_round_is_unchanged(spark_retry, tmp_path):
    sc = spark_retry.sparkContext
    cfg = ta_config(batch_size=64)
    prepared = _prepared_digits(spark_retry)
    blocks = cache_blocks(prepared, cfg, num_outputs=10)
    model = _seeded_model()
    handle = sc.broadcast(state_to_bytes(model.state_dict()))
    weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    marker = tmp_path / "failed"
    sc.setJobGroup("tree-aggregate-retry-test", "retry test")
    volume = SparkVolume(sc, "tree-aggregate-retry-test")
    try:
        results = []
        for hook in (None, _fail_once(str(marker))):
            spec = RoundSpec("retry-test", cfg, handle, rounds_per_epoch=11,
                             evaluate_on_validation=True, task_hook=hook,
                             model_fn=DIGITS_MODEL)  # fmt: skip
            runner = RoundRunner(ClassicBackend(sc, blocks), spec)
            results.append(runner.run(weights, 3, evaluate=True))
        volume.poll(final=True)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        blocks.unpersist()
        handle.destroy()
    assert marker.exists()  # the failure did happen
    assert volume.failed_tasks == 1
    (clean_vec, clean_stats), (retried_vec, retried_stats) = results
    assert clean_vec is not None and retried_vec is not None
    np.testing.assert_allclose(retried_vec, clean_vec, rtol=0, atol=1e-6)
    np.testing.assert_allclose(retried_stats[:4], clean_stats[:4], rtol=0, atol=1e-6)


def test_training_through_a_task_failure_gives_the_fault_free_model(spark_retry, tmp_path):
    cfg = ta_config(epochs=1, batch_size=128, local_steps=2)
    prepared = _prepared_digits(spark_retry)
    runs = []
    for hook in (None, _fail_once(str(tmp_path / "failed"), partition=0, round_index=2)):
        runs.append(
            run_rounds(
                prepared,
                _seeded_model(),
                cfg,
                model_fn=DIGITS_MODEL,
                num_outputs=10,
                started=0.0,
                task_hook=hook,
            )
        )
    clean, retried = runs
    assert (tmp_path / "failed").exists()
    assert clean.summary["spark_failed_tasks"] == 0 and retried.summary["spark_failed_tasks"] == 1
    for a, b in zip(clean.model.parameters(), retried.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for a, b in zip(clean.history, retried.history, strict=True):
        assert (b["loss"], b["metric"]) == pytest.approx((a["loss"], a["metric"]), abs=1e-6)


# a task that raises or whose process exits, through Trainer.fit: Spark retries it
FAULTS = {"epochs": 4, "local_steps": 8}


@pytest.fixture(scope="module")
def tree_aggregate_fault_free(_sessions):
    """The fault-free fit on local[2,4], once for both kinds of task failure."""
    spark = _sessions.get("local[2,4]")
    train, test = digits_frames(spark)
    cfg = ta_config(**FAULTS)
    return Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test).summary


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_tree_aggregate_task_failures_are_retried_by_spark(
    spark_retry, tmp_path, kind, tree_aggregate_fault_free
):
    train, test = digits_frames(spark_retry)
    cfg = ta_config(**FAULTS)
    clean = tree_aggregate_fault_free
    plan = FaultPlan(rank=1, step=5, marker=str(tmp_path / "fault"), kind=kind)
    s = (
        Trainer(DIGITS_MODEL, cfg, spark=spark_retry, fault_plan=plan)
        .fit(train, validation_data=test)
        .summary
    )
    assert (tmp_path / "fault").exists() and s["spark_failed_tasks"] >= 1
    assert s["metric_value"] == pytest.approx(clean["metric_value"], abs=1e-9)
    assert s["final_loss"] == pytest.approx(clean["final_loss"], rel=1e-6)
