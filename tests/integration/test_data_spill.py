"""Partitions past ``data_memory_mb`` on a real Spark: Parquet in, spilled to the
executors' local dirs, the same weights as in memory, nothing left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sparktrain import Trainer
from sparktrain.data.spill import SPILL_DIR_NAME, local_root
from sparktrain.task.faults import FaultPlan

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def _local_dirs(spark) -> set[Path]:  # type: ignore[no-untyped-def]
    """Where the executors' Python workers put their spill folders."""

    def where(_: object) -> list[str]:
        assert os.environ.get("SPARK_LOCAL_DIRS"), "Spark gave the Python worker no local dirs"
        return [str(local_root())]

    found = spark.sparkContext.parallelize(range(2), 2).mapPartitions(where).collect()
    return {Path(d) for d in found}


def _spill_files(dirs: set[Path]) -> list[Path]:
    return [p for d in dirs for p in (d / SPILL_DIR_NAME).rglob("*") if p.is_file()]


@pytest.fixture(scope="module")
def digits_parquet(_sessions, tmp_path_factory):  # type: ignore[no-untyped-def]
    spark = _sessions.get("local[2]")
    train, test = digits_frames(spark)
    root = tmp_path_factory.mktemp("parquet")
    train.write.parquet(str(root / "train"))
    test.write.parquet(str(root / "test"))
    return (
        spark.read.parquet(str(root / "train")).repartition(2),
        spark.read.parquet(str(root / "test")).repartition(2),
    )


def test_a_spilled_parquet_partition_trains_to_the_weights_of_memory(spark, digits_parquet):
    train, test = digits_parquet
    dirs = _local_dirs(spark)
    assert dirs, "the Python workers were given no SPARK_LOCAL_DIRS"
    results = {}
    # 0.05 MiB: digits' ~720 rows x 64 floats per worker (~190 KB) spill early on
    for name, budget, prefetch in (("memory", 512, 2), ("spilled", 0.05, 2), ("inline", 0.05, 0)):
        cfg = fast_config(epochs=3, data_memory_mb=budget, prefetch_batches=prefetch)
        results[name] = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
        assert _spill_files(dirs) == []  # removed with the task
    memory, spilled, inline = (results[k].summary for k in ("memory", "spilled", "inline"))
    assert memory["data_path"] == "memory" and memory["data_spilled_bytes"] == 0
    assert spilled["data_path"] == inline["data_path"] == "spilled"
    # every training row's 64 float32s went to a file, plus Arrow's framing
    assert spilled["data_spilled_bytes"] >= spilled["train_samples"] * 64 * 4
    assert spilled["data_wait_s"] >= 0 and len(spilled["peak_anon_bytes_per_worker"]) == 2
    assert spilled["history"][-1]["loss"] == memory["history"][-1]["loss"]
    for a, b, c in zip(
        results["memory"].model.state_dict().values(),
        results["spilled"].model.state_dict().values(),
        results["inline"].model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_killed_worker_s_spill_file_is_swept_and_the_restart_spills_again(
    spark, digits_parquet, tmp_path
):
    train, test = digits_parquet
    dirs = _local_dirs(spark)
    cfg = fast_config(
        epochs=3, data_memory_mb=0.05, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1.0
    )
    plan = FaultPlan(rank=1, step=30, marker=str(tmp_path / "fault"), kind="exit")
    s = Trainer(DIGITS_MODEL, cfg, spark=spark, fault_plan=plan).fit(train, validation_data=test)
    s = s.summary
    assert (tmp_path / "fault").exists() and s["restarts"] == 1
    assert s["data_path"] == "spilled" and s["data_spilled_bytes"] > 0
    assert _spill_files(dirs) == []
