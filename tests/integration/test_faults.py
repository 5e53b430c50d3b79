"""Barrier-stage failures on local[2]: the driver resubmits and workers resume from the
newest checkpoint; the result matches the fault-free run with the same seed."""

from __future__ import annotations

import logging

import pytest

from sparktrain import Trainer
from sparktrain.errors import CommError, WorkerError
from sparktrain.task.faults import FaultPlan

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

EPOCHS = 8
FAULT_STEP = 60  # in epoch 3 of 8 (22 steps per epoch)


@pytest.fixture(scope="module")
def fault_free(_sessions):
    spark = _sessions.get("local[2]")
    train, test = digits_frames(spark)
    return (
        Trainer(DIGITS_MODEL, fast_config(epochs=EPOCHS), spark=spark)
        .fit(train, validation_data=test)
        .summary
    )


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_a_failed_stage_resumes_from_the_checkpoint(spark, tmp_path, kind, fault_free, caplog):
    caplog.set_level(logging.INFO, logger="sparktrain")
    train, test = digits_frames(spark)
    cfg = fast_config(epochs=EPOCHS, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0.5)
    plan = FaultPlan(rank=1, step=FAULT_STEP, marker=str(tmp_path / "fault"), kind=kind)
    s = (
        Trainer(DIGITS_MODEL, cfg, spark=spark, fault_plan=plan)
        .fit(train, validation_data=test)
        .summary
    )
    assert (tmp_path / "fault").exists()  # the fault did fire
    assert s["restarts"] == 1
    assert "resubmitting it (restart 1 of 2) from the checkpoint of step 55" in caplog.text
    assert 0 <= s["steps_redone"] <= FAULT_STEP - 55
    assert abs(s["metric_value"] - fault_free["metric_value"]) <= 0.01
    assert s["replicas_in_sync"]


def test_without_checkpoints_a_restart_begins_from_scratch(spark, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="sparktrain")
    train, test = digits_frames(spark)
    plan = FaultPlan(rank=0, step=10, marker=str(tmp_path / "fault"))
    s = (
        Trainer(DIGITS_MODEL, fast_config(epochs=3), spark=spark, fault_plan=plan)
        .fit(train, validation_data=test)
        .summary
    )
    assert s["restarts"] == 1
    assert "from scratch: no checkpoint to resume from (set checkpoint_dir" in caplog.text


def test_no_restarts_left_surfaces_the_task_error(spark, tmp_path):
    train, _ = digits_frames(spark)
    plan = FaultPlan(rank=1, step=3, marker=str(tmp_path / "fault"))
    # Spark reports whichever task failed first: the injected fault, or its peer losing it
    with pytest.raises(
        (WorkerError, CommError),
        match="InjectedFaultError: injected fault on rank 1 at step 3|lost contact with rank 1",
    ):
        Trainer(
            DIGITS_MODEL, fast_config(epochs=2, max_restarts=0), spark=spark, fault_plan=plan
        ).fit(train)


def test_ps_sync_resumes_at_the_servers_step_and_applies_no_step_twice(
    spark, tmp_path, fault_free, caplog
):
    caplog.set_level(logging.INFO, logger="sparktrain")
    train, test = digits_frames(spark)
    cfg = fast_config(epochs=EPOCHS, strategy="ps", ps_mode="sync")
    plan = FaultPlan(rank=1, step=FAULT_STEP, marker=str(tmp_path / "fault"))
    s = (
        Trainer(DIGITS_MODEL, cfg, spark=spark, fault_plan=plan)
        .fit(train, validation_data=test)
        .summary
    )
    assert s["restarts"] == 1 and (tmp_path / "fault").exists()
    versions = [shard["version"] for shard in s["ps"]["per_shard"]]
    total_steps = EPOCHS * s["steps_per_epoch"]
    # every step applied once (a failure between two shards' replies may leave one extra)
    assert min(versions) == total_steps and max(versions) <= total_steps + 1
    assert s["ps"]["duplicates"] == 0
    assert f"from the parameter server's model at step {FAULT_STEP}" in caplog.text
    assert [h["epoch"] for h in s["history"]] == list(range(EPOCHS))
    assert abs(s["metric_value"] - fault_free["metric_value"]) <= 0.01


def test_resume_true_continues_from_the_newest_checkpoint(spark, tmp_path):
    train, test = digits_frames(spark)
    ckpt = str(tmp_path / "ckpt")
    first = Trainer(DIGITS_MODEL, fast_config(epochs=2, checkpoint_dir=ckpt), spark=spark).fit(
        train, validation_data=test
    )
    more = fast_config(epochs=4, checkpoint_dir=ckpt, resume=True)
    second = Trainer(DIGITS_MODEL, more, spark=spark).fit(train, validation_data=test)
    assert [h["epoch"] for h in second.history] == [0, 1, 2, 3]
    assert [h["loss"] for h in second.history[:2]] == [h["loss"] for h in first.history]
    assert second.history[3]["loss"] < first.history[1]["loss"]


def test_tree_aggregate_resumes_from_its_driver_checkpoint(spark, tmp_path):
    train, test = digits_frames(spark)
    common = {"strategy": "tree_aggregate", "local_steps": 8, "checkpoint_dir": str(tmp_path)}
    full = Trainer(DIGITS_MODEL, fast_config(epochs=4, **common), spark=spark).fit(
        train, validation_data=test
    )
    first = Trainer(
        DIGITS_MODEL,
        fast_config(epochs=2, **common | {"checkpoint_dir": str(tmp_path / "b")}),
        spark=spark,
    ).fit(train, validation_data=test)
    resumed = Trainer(
        DIGITS_MODEL,
        fast_config(epochs=4, resume=True, **common | {"checkpoint_dir": str(tmp_path / "b")}),
        spark=spark,
    ).fit(train, validation_data=test)
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2, 3]
    assert [h["loss"] for h in resumed.history[:2]] == [h["loss"] for h in first.history]
    for got, want in zip(resumed.history, full.history, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["metric"] == pytest.approx(want["metric"], abs=1e-9)
