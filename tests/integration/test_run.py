"""``sparktrain.run`` through a real Spark (local[2]): the digits train_fn with bf16,
a cosine schedule with warm-up, accumulation and clipping; a transformer that needs
token order (where a bag of tokens cannot learn); early stopping on a reported val_auc;
a run whose task is killed resumes from ctx.checkpoint and finishes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import sparktrain
from sparktrain import TrainConfig, Trainer, datasets
from sparktrain.models import mlp
from sparktrain.task.faults import FaultPlan
from tests.integration.fixtures import accuracy, digits, digits_frames


def run_config(**overrides):  # type: ignore[no-untyped-def]
    base = {"epochs": 20, "batch_size": 32, "lr": 0.003, "progress": False, "comm_timeout": 30.0}
    return TrainConfig(**{**base, **overrides})


def order_frames(spark, n: int, seed: int):  # type: ignore[no-untyped-def]
    sequences, labels = datasets.order_task(n, seed=seed)
    table = pa.table({"tokens": pa.array(sequences, pa.list_(pa.int64())), "label": labels})
    return spark.createDataFrame(table).repartition(2)


def test_digits_train_fn_with_bf16_cosine_warmup_accumulation_and_clipping(spark, tmp_path):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    cfg = run_config(
        precision="bf16",
        lr_schedule="CosineAnnealingLR",
        warmup_steps=20,
        accumulate_steps=2,
        clip_grad_norm=1.0,
        metrics_jsonl=str(tmp_path / "metrics.jsonl"),
    )
    seen = []
    result = sparktrain.run(
        "sparktrain.recipes:digits_train_fn",
        train,
        validation_data=test,
        num_workers=2,
        config=cfg,
        callbacks=[lambda record, history: seen.append(record["epoch"])],
    )
    model = mlp(64, (128,), 10)
    model.load_state_dict(result.value["model"])
    split = digits()
    assert accuracy(model, split.x_test, split.y_test) >= 0.95
    assert result.history[-1]["accuracy"] >= 0.95  # exact over both ranks' rows
    assert result.summary["precision"] == "bf16"
    assert seen == list(range(20))
    assert result.summary["epochs_run"] == 20  # the epochs the function reported
    lines = [json.loads(line) for line in Path(cfg.metrics_jsonl).read_text().splitlines()]
    assert [line["epoch"] for line in lines] == list(range(20))


@pytest.mark.parametrize("strategy", ["ring", "ps"])
def test_a_transformer_learns_token_order_where_a_bag_of_tokens_cannot(spark, strategy):  # type: ignore[no-untyped-def]
    train, val = order_frames(spark, 2400, seed=1), order_frames(spark, 600, seed=2)
    cfg = run_config(epochs=12, lr=0.003, feature_shapes={"tokens": [-1]}, strategy=strategy)
    result = sparktrain.run(
        "sparktrain.recipes:transformer_train_fn",
        train,
        columns={"tokens": "tokens"},
        validation_data=val,
        config=cfg,
    )
    assert result.history[-1]["accuracy"] >= 0.9, result.history
    if strategy == "ps":
        assert result.summary["ps"]["mode"] == "sync"
        return
    bag = Trainer(
        "sparktrain.models:token_bag",
        run_config(epochs=8, lr=0.01, optimizer="adam", feature_shapes={"tokens": [-1]}),
        model_kwargs={"vocab": 16},
    ).fit(train, features_col={"tokens": "tokens"}, validation_data=val)
    assert bag.summary["metric_value"] < 0.6


def val_auc_train_fn(ctx):  # type: ignore[no-untyped-def]
    """Reports a validation AUC every epoch; stops when early stopping says so."""
    torch.manual_seed(0)
    model = mlp(64, (16,), 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = ctx.distributed(model, optimizer)
    for epoch in range(ctx.config.epochs):
        for batch in ctx.batches(epoch):
            # a binary task: is the digit odd?
            ctx.backward(
                torch.nn.functional.cross_entropy(model(batch.x)[:, :2], batch.y.long() % 2)
            )
            optimizer.step()
            optimizer.zero_grad()
        ctx.report(val_auc=ctx.evaluate(_TwoLogits(model), ["auc"])["auc"])
        if ctx.should_stop:
            break
    return len(ctx.history)


class _TwoLogits(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)[:, :2]


def test_a_train_fn_reporting_val_auc_stops_early(spark):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    odd = lambda df: df.withColumn("label", (df["label"] % 2).cast("double"))  # noqa: E731
    cfg = run_config(
        epochs=60, early_stopping={"metric": "val_auc", "patience": 2, "min_delta": 0.01}
    )
    result = sparktrain.run(val_auc_train_fn, odd(train), validation_data=odd(test), config=cfg)
    stop = result.summary["early_stopping"]
    assert result.value < 60 and result.value == len(result.history)
    assert result.history[-1].get("early_stop") is True
    assert stop["stopped_at"] == result.value - 1
    assert stop["best_epoch"] == result.value - 1 - 2


def test_a_killed_run_resumes_from_its_checkpoint_and_finishes(spark, tmp_path):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    cfg = run_config(epochs=6, lr=0.01, checkpoint_dir=str(tmp_path / "ckpt"), max_restarts=1)
    steps = (1347 // 2 + 31) // 32  # rows per rank, batches of 32
    fault = FaultPlan(rank=1, step=3 * steps + 2, marker=str(tmp_path / "fired"))
    result = sparktrain.run(
        "sparktrain.recipes:digits_train_fn",
        train,
        validation_data=test,
        config=cfg,
        fault_plan=fault,
    )
    assert (tmp_path / "fired").exists()
    assert result.summary["restarts"] == 1
    assert [h["epoch"] for h in result.history] == list(range(6))
    assert result.history[-1]["accuracy"] > 0.9
    assert np.isfinite(result.history[-1]["loss"])


def rank_sum_train_fn(ctx):  # type: ignore[no-untyped-def]
    """No data: the ranks only talk."""
    total = ctx.allreduce(torch.tensor([float(ctx.rank + 1)]))
    return {"world": ctx.world_size, "sum": float(total[0]), "rows": ctx.train_rows}


def test_a_train_fn_without_data_runs_one_task_per_worker(spark):  # type: ignore[no-untyped-def]
    result = sparktrain.run(rank_sum_train_fn, num_workers=2, config=run_config())
    assert result.value == {"world": 2, "sum": 3.0, "rows": 0}
