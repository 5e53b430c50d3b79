"""Bounded soak: one run loses a random training worker (a real ``os._exit`` of its
Python worker) three times, for ring, for the parameter server and for a two-stage
pipeline, with checkpoints on. Each run finishes by itself, within 1 pp of its
fault-free twin (the pipeline: bitwise its twin's weights), and the parameter server
applies every step exactly once."""

from __future__ import annotations

import random

import pytest
import torch

from sparktrain import Trainer
from sparktrain.task.faults import FaultPlan

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.soak, pytest.mark.timeout(600)]

EPOCHS = 4  # 22 steps per epoch on digits, two workers, batch 32
KILLS = 3
SEED = 14


def _kills(tmp_path, seed: int) -> FaultPlan:  # type: ignore[no-untyped-def]
    """Three kills of a random rank at random steps, one in each third of the run after
    the first checkpoint (half an epoch), so every restart has progress to keep."""
    rng = random.Random(seed)
    total = EPOCHS * 22
    bounds = [12 + (total - 14) * k // KILLS for k in range(KILLS + 1)]
    plans = [
        FaultPlan(
            rank=rng.randrange(2),
            step=rng.randrange(bounds[k], bounds[k + 1]),
            marker=str(tmp_path / f"kill-{k}"),
            kind="exit",
        )
        for k in range(KILLS)
    ]
    return FaultPlan.series(plans)


# A pipeline's two stages hold the deeper MLP's layers (P = 2, D = 1 on the two slots).
PIPELINE = {"strategy": "ring", "parallelism_pipeline": 2, "parallelism_data": 1}
DEEP_KWARGS = {"in_features": 64, "hidden": [128, 64], "out_features": 10}


@pytest.mark.parametrize("strategy", ["ring", "ps", "pipeline"])
def test_three_random_kills_in_one_run(spark, tmp_path, strategy):
    train, test = digits_frames(spark)
    common = {"epochs": EPOCHS, "strategy": strategy, "max_restarts": KILLS}
    model: dict = {"model_fn": DIGITS_MODEL}
    if strategy == "ps":
        common["ps_mode"] = "sync"
    if strategy == "pipeline":
        common |= PIPELINE
        model = {"model_fn": "sparktrain.models:mlp", "model_kwargs": DEEP_KWARGS}
    twin = Trainer(config=fast_config(**common), spark=spark, **model).fit(
        train, validation_data=test
    )
    plan = _kills(tmp_path, SEED)
    cfg = fast_config(**common, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0.5)
    result = Trainer(config=cfg, spark=spark, fault_plan=plan, **model).fit(
        train, validation_data=test
    )
    s = result.summary
    print(
        f"{strategy}: kills {[(p.rank, p.step) for p in (plan, *plan.also)]}, restarts "
        f"{s['restarts']}, steps redone {s['steps_redone']}, metric {s['metric_value']:.4f} "
        f"vs fault-free {twin.summary['metric_value']:.4f}"
    )
    assert all((tmp_path / f"kill-{k}").exists() for k in range(KILLS))  # all three fired
    assert s["restarts"] == KILLS
    assert [h["epoch"] for h in s["history"]] == list(range(EPOCHS))
    assert abs(s["metric_value"] - twin.summary["metric_value"]) <= 0.01
    if strategy == "ring":
        assert s["replicas_in_sync"]
        return
    if strategy == "pipeline":  # every stage resumed its layers, optimizer and RNG exactly
        for name, tensor in twin.model.state_dict().items():
            assert torch.equal(tensor, result.model.state_dict()[name]), name
        return
    total_steps = EPOCHS * s["steps_per_epoch"]
    assert s["ps"]["duplicates"] == 0
    # The parameter server's counters (keys from the ps checkpoint branch): its version
    # counts applied steps, each exactly once, however many workers died
    assert s["ps_version"] == total_steps
    assert s["ps_version"] == s["ps_applied_pushes"]
