"""The built-in loop's schedule, precision, accumulation, clipping, early stopping and
extra metrics, with ranks as threads."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from sparktrain.config import TrainConfig
from sparktrain.driver.job import check_job
from sparktrain.errors import ConfigError
from sparktrain.task.run_task import run_partition
from tests.unit.fixtures import (
    assert_close_params,
    loop_spec,
    random_parts,
    run_ranks,
    spec_with,
    train_and_assemble,
    worker_context,
)


def separable_parts(sizes: list[int], seed: int = 0) -> list:  # type: ignore[type-arg]
    """Labels a linear function of the features decides: the model can learn them."""
    parts = random_parts(sizes, seed=seed)
    w = np.random.default_rng(seed + 1).standard_normal((4, 3))
    for part in parts:
        part.y[:] = np.argmax(part.x @ w, axis=1)
    return parts


def test_accumulated_steps_equal_the_larger_batch() -> None:
    parts = random_parts([64, 64], seed=2)
    small = train_and_assemble(loop_spec(batch_size=8, accumulate_steps=2, epochs=2), parts)
    large = train_and_assemble(loop_spec(batch_size=16, epochs=2), parts)
    assert_close_params(small.model, large.model, 1e-5)  # float32 sums in another order


@pytest.mark.parametrize("overlap", [True, False])
def test_accumulation_over_uneven_partitions_keeps_the_replicas_equal(overlap: bool) -> None:
    # 5 micro-batches of 8 against 2: in each step the ranks hold sums of different
    # numbers of micro-batch means; every rank must still receive the same average
    parts = random_parts([40, 12], seed=3)
    spec = loop_spec(batch_size=8, accumulate_steps=4, epochs=2, overlap=overlap)
    result = train_and_assemble(spec, parts)
    assert result.summary["replicas_in_sync"]


def test_a_step_schedule_with_warmup_shows_its_rates_in_the_history() -> None:
    spec = loop_spec(
        batch_size=16,
        epochs=4,
        lr_schedule="StepLR",
        lr_schedule_kwargs={"step_size": 1, "gamma": 0.5},
        lr_schedule_interval="epoch",
    )
    result = train_and_assemble(spec, random_parts([32, 32]))
    assert [h["lr"] for h in result.history] == pytest.approx(
        [0.5, 0.25, 0.125, 0.0625]
    )  # the rate each epoch ran at


def test_clipping_bounds_every_step_after_averaging() -> None:
    parts = random_parts([16, 16])
    base = loop_spec(batch_size=16, epochs=1, lr=1.0)
    torch.manual_seed(0)
    start = base.model_fn()
    clipped = train_and_assemble(
        spec_with(base, config=base.config.replace(clip_grad_norm=0.01)), parts
    )
    moved = torch.sqrt(
        sum(
            ((a - b) ** 2).sum()
            for a, b in zip(clipped.model.parameters(), start.parameters(), strict=True)
        )
    )
    assert float(moved) <= 0.01 * 1.0 + 1e-6  # one step of lr 1 on a gradient of norm <= 0.01


def test_bf16_trains_and_the_summary_says_so() -> None:
    spec = loop_spec(batch_size=16, epochs=15, lr=0.3, precision="bf16")
    result = train_and_assemble(spec, separable_parts([128, 128]))
    assert result.summary["precision"] == "bf16"
    assert result.history[-1]["metric"] > 0.85


def test_early_stopping_stops_every_rank_and_can_return_the_best_model() -> None:
    # a large rate makes the loss bounce: the best epoch is not the last one
    spec = loop_spec(
        batch_size=8,
        epochs=40,
        lr=2.0,
        early_stopping={"metric": "loss", "patience": 2, "restore_best": True},
    )
    parts = separable_parts([64, 64], seed=4)
    result = train_and_assemble(spec, parts)
    stop = result.summary["early_stopping"]
    assert result.summary["epochs_run"] == len(result.history) < 40
    assert result.history[-1]["early_stop"] is True
    assert stop["stopped_at"] == len(result.history) - 1
    assert stop["best_epoch"] == stop["stopped_at"] - 2 and stop["restored_best"]
    assert min(h["loss"] for h in result.history) == stop["best"]


def test_extra_metrics_are_reported_every_epoch() -> None:
    # no validation rows: every figure is named as measured on the training rows
    spec = loop_spec(batch_size=16, epochs=3, metrics=["macro_f1", "top_k:2", "log_loss"])
    result = train_and_assemble(spec, separable_parts([40, 24]))
    for record in result.history:
        assert 0.0 <= record["train_macro_f1"] <= 1.0
        assert record["train_top_k:2"] >= record["train_accuracy"]  # top-2 >= top-1
        assert record["train_log_loss"] > 0
        assert "macro_f1" not in record


def test_knobs_a_strategy_cannot_run_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="clip_grad_norm"):
        check_job(TrainConfig(strategy="ps", clip_grad_norm=1.0))
    with pytest.raises(ConfigError, match="early_stopping"):
        check_job(TrainConfig(strategy="tree_aggregate", early_stopping={"metric": "loss"}))


def test_the_best_epoch_is_kept_as_a_checkpoint_pruning_never_removes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sparktrain.checkpoint import CheckpointStore

    spec = loop_spec(
        batch_size=8,
        epochs=40,
        lr=2.0,
        checkpoint_dir=str(tmp_path),
        keep_checkpoints=1,
        checkpoint_every=3.0,
        early_stopping={"metric": "loss", "patience": 2},
    )
    result = train_and_assemble(spec, separable_parts([64, 64], seed=4))
    best = CheckpointStore(str(tmp_path)).load_best()
    assert best is not None
    stop = result.summary["early_stopping"]
    assert best.history[-1]["epoch"] == stop["best_epoch"]
    assert best.history[-1]["loss"] == stop["best"]


@pytest.mark.parametrize(
    ("knobs", "key"),
    [
        ({"early_stopping": {"metric": "accuracy", "patience": 1}}, "early_stopping.metric"),
        (
            {
                "lr_schedule": "ReduceLROnPlateau",
                "lr_schedule_kwargs": {"monitor": "accuracy"},
                "lr_schedule_interval": "epoch",
            },
            "lr_schedule_kwargs.monitor",
        ),
    ],
)
def test_watching_a_figure_no_epoch_reports_is_refused_by_every_rank(
    knobs: dict[str, Any], key: str
) -> None:
    # without validation data the loop reports train_accuracy, not accuracy
    spec = loop_spec(epochs=3, **knobs)
    parts = random_parts([16, 16])

    def rank_fn(rank: int, coll) -> BaseException | None:  # type: ignore[no-untyped-def]
        try:
            run_partition(worker_context(rank, 2, coll, spec), parts[rank])
        except ConfigError as exc:
            return exc
        return None

    errors = run_ranks(2, rank_fn)
    assert all(isinstance(e, ConfigError) for e in errors)  # the same error, no lost peer
    assert str(errors[0]).startswith(f"{key}='accuracy' is not a figure")
    assert "reports 'train_accuracy' on the training rows" in str(errors[0])
    assert "validationFraction" in str(errors[0])
