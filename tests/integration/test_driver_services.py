"""Executors that cannot reach the driver's services (a Spark Connect client behind a
firewall, say; forced here, since on one host they always can): ring and tree meet
through Spark's barrier allGather, return their state as task results and hand the
history to callbacks and metrics_jsonl when the stage ends; ps refuses with what to set.
A fit whose services take a configured port range trains as usual."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

import sparktrain
from sparktrain import Trainer
from sparktrain.errors import ConfigError
from sparktrain.task.faults import FaultPlan

from .fixtures import DIGITS_MODEL, accuracy, digits, digits_frames, fast_config


@pytest.mark.parametrize("cut_off", [(0, 1), (1,)], ids=["every rank", "rank 1"])
def test_ring_trains_when_the_executors_cannot_reach_the_driver(spark, tmp_path, cut_off):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    jsonl = tmp_path / "metrics.jsonl"
    cfg = fast_config(epochs=6, metrics_jsonl=str(jsonl), comm_timeout=15.0, max_restarts=0)
    seen: list[int] = []
    trainer = Trainer(
        DIGITS_MODEL, cfg, spark=spark, fault_plan=FaultPlan.driver_unreachable(cut_off)
    )
    if cut_off == (1,):
        # rank 0 reached the rendezvous and waits for rank 1, which never comes: the stage
        # fails within comm_timeout with an error naming the services, never hangs
        with pytest.raises(sparktrain.errors.SparkTrainError, match="driver_services_host"):
            trainer.fit(train, validation_data=test)
        return
    result = trainer.fit(
        train,
        validation_data=test,
        callbacks=[lambda record, history: seen.append(record["epoch"])],
    )
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) >= 0.95
    assert "could not reach the driver's services" in result.summary["driver_services"]
    assert seen == list(range(6))  # every epoch once, at the end of the stage
    lines = [json.loads(line) for line in Path(jsonl).read_text().splitlines()]
    assert [line["epoch"] for line in lines] == list(range(6))


def test_sparktrain_run_returns_its_value_without_the_driver_services(spark):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    cfg = fast_config(epochs=2, lr=0.003, optimizer="adam", optimizer_kwargs={})
    result = sparktrain.run(
        "sparktrain.recipes:digits_train_fn",
        train,
        validation_data=test,
        num_workers=2,
        config=cfg,
        fault_plan=FaultPlan.driver_unreachable((0, 1)),
    )
    assert set(result.value) >= {"model"}
    assert len(result.history) == 2 and "driver_services" in result.summary


def test_ps_refuses_with_what_to_set_when_the_driver_is_unreachable(spark):  # type: ignore[no-untyped-def]
    train, _ = digits_frames(spark)
    cfg = fast_config(epochs=1, strategy="ps", max_restarts=0)
    trainer = Trainer(
        DIGITS_MODEL, cfg, spark=spark, fault_plan=FaultPlan.driver_unreachable((0, 1))
    )
    with pytest.raises(ConfigError, match="driver_services_host"):
        trainer.fit(train)


def test_services_listen_in_the_configured_port_range(spark):  # type: ignore[no-untyped-def]
    with socket.socket() as probe:  # a free stretch of ports above an ephemeral one
        probe.bind(("127.0.0.1", 0))
        low = probe.getsockname()[1] % 20000 + 30000
    train, test = digits_frames(spark)
    cfg = fast_config(
        epochs=2,
        driver_services_host="127.0.0.1",
        driver_services_ports=f"{low}-{low + 40}",
    )
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    assert "driver_services" not in result.summary
    assert len(result.history) == 2
