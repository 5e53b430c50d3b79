"""``Trainer.fit`` and ``sparktrain.run`` from a Spark Connect session (the shared server
on loopback): the digits job through ring and the parameter server reaches the local
tests' accuracy; the driver services run in this client process."""

from __future__ import annotations

import json
import logging

import pytest

import sparktrain
from sparktrain import Trainer
from sparktrain.checkpoint import CheckpointStore
from sparktrain.errors import CommError, DataError, WorkerError
from sparktrain.models import mlp
from sparktrain.task.faults import FaultPlan

from .fixtures import DIGITS_MODEL, SUMMARY_KEYS, accuracy, digits, digits_frames, fast_config

pytestmark = [pytest.mark.connect, pytest.mark.timeout(300)]


@pytest.mark.parametrize(("strategy", "extra"), [("ring", {}), ("ps", {"ps_shards": 2})])
def test_digits_through_connect_reaches_95_percent(  # type: ignore[no-untyped-def]
    connect_spark, strategy, extra, caplog, tmp_path
):
    caplog.set_level(logging.INFO, logger="sparktrain")
    train, test = digits_frames(connect_spark)
    jsonl = tmp_path / "epochs.jsonl"
    cfg = fast_config(
        strategy=strategy,
        metrics_jsonl=str(jsonl),
        checkpoint_dir=str(tmp_path / "checkpoints"),
        checkpoint_every=5.0,
        **extra,
    )
    result = Trainer(DIGITS_MODEL, cfg).fit(train, validation_data=test)  # the data's session
    s = result.summary
    assert set(s) >= SUMMARY_KEYS
    assert s["strategy"] == strategy and s["metric_value"] >= 0.95
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) == pytest.approx(s["metric_value"])
    assert s["train_samples"] == len(split.y_train) and len(result.history) == cfg.epochs
    assert "Spark Connect: the driver services" in caplog.text
    # progress reached this client (the metrics channel), and checkpoints were written
    epochs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == list(range(cfg.epochs))
    store = tmp_path / "checkpoints" / ("ps" if strategy == "ps" else "")  # the server's own
    newest = CheckpointStore(str(store)).newest_intact()  # the PS checkpoints on its own clock
    assert newest is not None and 0 < newest <= s["steps_per_epoch"] * cfg.epochs


def test_a_failed_stage_resumes_from_its_checkpoint(connect_spark, tmp_path, caplog):  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="sparktrain")
    train, test = digits_frames(connect_spark)
    cfg = fast_config(epochs=4, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0.5)
    plan = FaultPlan(rank=1, step=30, marker=str(tmp_path / "fault"))
    s = Trainer(DIGITS_MODEL, cfg, fault_plan=plan).fit(train, validation_data=test).summary
    assert (tmp_path / "fault").exists() and s["restarts"] == 1  # the fault did fire
    assert "resubmitting it (restart 1 of 2) from the checkpoint of step 22" in caplog.text
    assert s["replicas_in_sync"] and s["metric_value"] >= 0.9


def test_a_task_error_reaches_the_client_with_its_cause(connect_spark, tmp_path):  # type: ignore[no-untyped-def]
    train, _ = digits_frames(connect_spark)
    plan = FaultPlan(rank=1, step=3, marker=str(tmp_path / "fault"))
    trainer = Trainer(DIGITS_MODEL, fast_config(epochs=2, max_restarts=0), fault_plan=plan)
    with pytest.raises(
        (WorkerError, CommError),
        match="InjectedFaultError: injected fault on rank 1 at step 3|lost contact with rank 1",
    ):
        trainer.fit(train)


def test_pipeline_stages_train_under_connect(connect_spark):  # type: ignore[no-untyped-def]
    train, test = digits_frames(connect_spark)
    cfg = fast_config(strategy="ring", parallelism_pipeline=2, epochs=5)
    result = Trainer(DIGITS_MODEL, cfg).fit(train, validation_data=test)
    assert result.summary["metric_value"] >= 0.9


def test_sparktrain_run_with_the_digits_train_fn(connect_spark):  # type: ignore[no-untyped-def]
    train, test = digits_frames(connect_spark)
    cfg = fast_config(lr=0.003, optimizer_kwargs={})
    result = sparktrain.run(
        "sparktrain.recipes:digits_train_fn", train, validation_data=test, config=cfg
    )
    model = mlp(64, (128,), 10)
    model.load_state_dict(result.value["model"])
    split = digits()
    assert accuracy(model, split.x_test, split.y_test) >= 0.95
    assert result.history[-1]["accuracy"] >= 0.95


def rank_sum_train_fn(ctx):  # type: ignore[no-untyped-def]
    """No data: the ranks only talk."""
    import torch

    total = ctx.allreduce(torch.tensor([float(ctx.rank + 1)]))
    return {"world": ctx.world_size, "sum": float(total[0]), "rows": ctx.train_rows}


def test_sparktrain_run_without_data(connect_spark):  # type: ignore[no-untyped-def]
    cfg = fast_config(strategy="tree")
    result = sparktrain.run(rank_sum_train_fn, config=cfg, spark=connect_spark)
    assert result.value == {"world": 2, "sum": 3.0, "rows": 0}


def test_an_rdd_under_connect_is_refused_with_the_way_out(connect_spark):  # type: ignore[no-untyped-def]
    from pyspark import RDD

    rdd = RDD.__new__(RDD)  # an RDD object; a Connect session could never have made one
    for strategy in ("ring", "tree_aggregate"):  # tree_aggregate's RDD path included
        trainer = Trainer(DIGITS_MODEL, fast_config(strategy=strategy), spark=connect_spark)
        with pytest.raises(
            DataError, match="Spark Connect session, which has no RDDs: pass a DataFrame"
        ):
            trainer.fit(rdd)
    with pytest.raises(DataError, match="pass a DataFrame"):
        sparktrain.run("sparktrain.recipes:digits_train_fn", rdd, spark=connect_spark)
