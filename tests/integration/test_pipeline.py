"""Pipeline parallelism end to end on local[2]: P = 2 stages, D = 1 (the two slots)."""

from __future__ import annotations

import pytest
import torch

from sparktrain import TrainConfig, Trainer
from sparktrain.errors import ConfigError
from sparktrain.models import mlp

from .fixtures import SUMMARY_KEYS, accuracy, digits, digits_frames, digits_rdd, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

DEEP_MLP = "sparktrain.models:mlp"
DEEP_KWARGS = {"in_features": 64, "hidden": [128, 64], "out_features": 10}


def _pipeline_config(**overrides) -> TrainConfig:  # type: ignore[no-untyped-def]
    return fast_config(parallelism_pipeline=2, parallelism_data=1, **overrides)


def test_deeper_mlp_with_two_stages_reaches_95_percent(spark):
    train, test = digits_frames(spark)
    result = Trainer(
        DEEP_MLP, _pipeline_config(epochs=15), model_kwargs=DEEP_KWARGS, spark=spark
    ).fit(train, validation_data=test)
    s = result.summary
    assert s.keys() >= SUMMARY_KEYS | {"steps_redone"}
    assert s["metric_name"] == "accuracy" and s["metric_value"] >= 0.95
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) == pytest.approx(s["metric_value"])
    assert s["pipeline_stages"] == 2 and s["world_size"] == 2
    assert s["stage_bytes_per_step"] > 0 and 0.0 <= s["bubble_fraction"] <= 1.0
    assert s["train_samples"] == len(split.y_train)
    assert len(s["stage_bounds"]) == 3


def test_rdd_input_and_the_driver_model_is_reassembled(spark):
    rdd = digits_rdd(spark)
    result = Trainer("sparktrain.models:digits_mlp", _pipeline_config(epochs=2), spark=spark).fit(
        rdd
    )
    assert result.summary["metric_name"] == "train_accuracy"
    torch.manual_seed(0)
    fresh = mlp(64, (128,), 10)
    assert result.model.state_dict().keys() == fresh.state_dict().keys()
    assert not torch.equal(result.model[0].weight, fresh[0].weight)


def test_a_model_over_the_parameter_cap_trains_with_two_stages(spark):
    """The deeper MLP holds ~0.07 MiB of parameters; a 0.05 MiB cap refuses it whole
    but each of two stages fits."""
    cfg = _pipeline_config(epochs=2, max_param_mb=0.05)
    train, _ = digits_frames(spark)
    result = Trainer(DEEP_MLP, cfg, model_kwargs=DEEP_KWARGS, spark=spark).fit(train)
    assert max(result.summary["stage_param_mb"]) <= 0.05
    assert result.summary["num_parameters"] * 4 / (1 << 20) > 0.05


def test_data_parallel_refuses_a_model_over_the_cap(spark):
    train, _ = digits_frames(spark)
    cfg = fast_config(epochs=1, max_param_mb=0.05)
    with pytest.raises(ConfigError, match="max_param_mb"):
        Trainer(DEEP_MLP, cfg, model_kwargs=DEEP_KWARGS, spark=spark).fit(train)


def test_layout_must_match_num_workers(spark):
    train, _ = digits_frames(spark)
    cfg = fast_config(parallelism_pipeline=2, parallelism_data=2)
    with pytest.raises(ConfigError, match="num_workers"):
        Trainer("sparktrain.models:digits_mlp", cfg, spark=spark).fit(train)


def test_a_killed_pipeline_stage_resubmits_and_resumes_from_its_checkpoint(spark, tmp_path, caplog):
    import logging

    from sparktrain.task.faults import FaultPlan

    caplog.set_level(logging.INFO, logger="sparktrain")
    train, test = digits_frames(spark)
    twin = Trainer(DEEP_MLP, _pipeline_config(epochs=3), model_kwargs=DEEP_KWARGS, spark=spark).fit(
        train, validation_data=test
    )
    cfg = _pipeline_config(epochs=3, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0.5)
    plan = FaultPlan(rank=1, step=60, marker=str(tmp_path / "fault"), kind="exit")
    result = Trainer(DEEP_MLP, cfg, model_kwargs=DEEP_KWARGS, spark=spark, fault_plan=plan).fit(
        train, validation_data=test
    )
    s = result.summary
    assert (tmp_path / "fault").exists()  # the last stage's task really died
    assert s["restarts"] == 1
    assert "resubmitting it (restart 1 of 2) from the checkpoint of step" in caplog.text
    assert [h["epoch"] for h in s["history"]] == [0, 1, 2]
    # every stage restored its layers, optimizer and RNG: the run it finished is the same run
    for name, tensor in twin.model.state_dict().items():
        assert torch.equal(tensor, result.model.state_dict()[name]), name
