"""Exact resume with compression on local[2]: error-feedback residuals and PowerSGD's
warm-start Q are per rank, so every rank saves them in its checkpoint shard. A run
whose Python worker is killed mid-run resumes to the same weights as its uninterrupted
twin, bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch

from sparktrain import Trainer
from sparktrain.task.faults import FaultPlan

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

EPOCHS = 1
FAULT_STEP = 16  # 22 steps per epoch; checkpoints every 11 steps


@pytest.mark.parametrize("compression", ["int8+ef", "powersgd:2+ef"])
def test_a_killed_compressed_run_resumes_to_the_uninterrupted_weights(
    spark, tmp_path, compression, caplog
):
    caplog.set_level(logging.INFO, logger="sparktrain")
    train, test = digits_frames(spark)

    def fit(name: str, plan: FaultPlan | None):  # type: ignore[no-untyped-def]
        cfg = fast_config(
            epochs=EPOCHS,
            compression=compression,
            checkpoint_dir=str(tmp_path / name),
            checkpoint_every=0.5,
        )
        return Trainer(DIGITS_MODEL, cfg, spark=spark, fault_plan=plan).fit(
            train, validation_data=test
        )

    twin = fit("twin", None)
    plan = FaultPlan(rank=1, step=FAULT_STEP, marker=str(tmp_path / "fault"), kind="exit")
    resumed = fit("killed", plan)
    assert (tmp_path / "fault").exists()  # the worker did die
    assert resumed.summary["restarts"] == 1
    assert "from the checkpoint of step 11" in caplog.text
    assert list((tmp_path / "killed").glob("ckpt-*.rank-00001-of-00002.pt"))  # rank 1's own
    want, got = twin.model.state_dict(), resumed.model.state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name  # bitwise
    # the validation metric is measured on those weights (the epoch's training loss
    # after a mid-epoch resume covers only the steps run after it)
    assert resumed.summary["metric_value"] == twin.summary["metric_value"]
