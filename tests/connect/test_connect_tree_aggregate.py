"""``strategy="tree_aggregate"`` from a Spark Connect session (the shared server on
loopback): each round is ``mapInArrow`` partials and grouped ``applyInArrow`` levels
instead of ``RDD.treeAggregate``. The digits job reaches the classic path's accuracy, and
the same fit in a classic session and under Connect ends with the same parameters."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from sparktrain import Trainer
from sparktrain.driver.spark_env import ConnectEnv
from sparktrain.errors import ConfigError
from sparktrain.result import state_to_bytes
from sparktrain.strategies.tree_aggregate.driver_frames import CLOSURE_SHARE

from .fixtures import DIGITS_MODEL, SUMMARY_KEYS, accuracy, classic_mode, digits, fast_config

pytestmark = [pytest.mark.connect, pytest.mark.timeout(300)]


def keyed_digits_frames(spark: Any) -> tuple[Any, Any]:
    """Digits train/test frames whose partitions hold the same rows in any session: hash
    partitioned by a row id (createDataFrame slices a local table differently in a
    classic session and under Connect, and the fit's round-robin shuffle follows that)."""
    split = digits()

    def frame(x: np.ndarray, y: np.ndarray, offset: int) -> Any:
        width = x.shape[1]
        flat = pa.array(x.reshape(-1), pa.float32())
        features = pa.FixedSizeListArray.from_arrays(flat, width).cast(pa.list_(pa.float32()))
        table = pa.table(
            {
                "id": pa.array(np.arange(offset, offset + len(y)), pa.int64()),
                "features": features,
                "label": pa.array(y.astype(np.float64)),
            }
        )
        return spark.createDataFrame(table).repartition(2, "id").select("features", "label")

    return frame(split.x_train, split.y_train, 0), frame(split.x_test, split.y_test, 10**6)


@pytest.mark.parametrize("compression", ["none", "delta+int8+ef"])
def test_digits_tree_aggregate_through_connect_reaches_95_percent(  # type: ignore[no-untyped-def]
    connect_spark, compression
):
    train, test = keyed_digits_frames(connect_spark)
    cfg = fast_config(strategy="tree_aggregate", local_steps=8, lr=0.1, compression=compression)
    result = Trainer(DIGITS_MODEL, cfg).fit(train, validation_data=test)  # the data's session
    s = result.summary
    assert set(s) >= SUMMARY_KEYS
    assert s["strategy"] == "tree_aggregate" and s["metric_value"] >= 0.95
    split = digits()
    assert accuracy(result.model, split.x_test, split.y_test) == pytest.approx(s["metric_value"])
    assert s["train_samples"] == len(split.y_train) and len(result.history) == cfg.epochs
    assert s["rounds_per_epoch"] == math.ceil(max(s["train_rows_per_worker"]) / (32 * 8))
    assert s["rounds"] == cfg.epochs * s["rounds_per_epoch"] + 1  # + the last evaluation
    assert s["broadcast_bytes"] == 0 and s["closure_weight_bytes"] > 0  # no broadcasts
    assert s["spark_shuffle_bytes"] is None  # a Connect client cannot read Spark's counts
    if compression == "none":
        assert s["bytes_sent"] == s["wire_bytes"]
    else:  # int8 both ways: uploads and the weight deltas shrink
        assert s["upload_wire_bytes"] < 0.4 * s["upload_bytes"]
        assert s["download_wire_bytes"] < 0.6 * s["download_bytes"]


def _fit(spark: Any, cfg: Any) -> tuple[list[np.ndarray], dict[str, Any]]:
    train, test = keyed_digits_frames(spark)
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    return [p.detach().numpy().copy() for p in result.model.parameters()], result.summary


def _state_and_weight_bytes(cfg: Any) -> tuple[int, int]:
    model = Trainer(DIGITS_MODEL, cfg)._build_model()[0]
    weights = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4
    return len(state_to_bytes(model.state_dict())), weights


# 2 workers: no shuffle level; 5 workers at depth 2: one grouped level, which the RDD
# path merges in shuffle-fetch order (float32 rounding could differ there, not here).
# "served": the request cap made small enough that the weights no longer fit the
# round's closure, so the tasks fetch them from the driver's weights server.
@pytest.mark.parametrize(
    "settings",
    [
        {"num_workers": 2, "compression": "delta+int8", "epochs": 2, "local_steps": 2},
        {"num_workers": 2, "compression": "none", "epochs": 2, "local_steps": 1},
        {"num_workers": 5, "compression": "none", "epochs": 1, "local_steps": 4},
        {"num_workers": 2, "compression": "none", "epochs": 1, "local_steps": 2, "served": 1},
    ],
    ids=["2-delta+int8", "2-none", "5-depth2", "2-served"],
)
def test_classic_and_connect_fits_end_with_the_same_parameters(  # type: ignore[no-untyped-def]
    connect_spark, _sessions, monkeypatch, settings
):
    served = bool(settings.pop("served", 0))
    cfg = fast_config(strategy="tree_aggregate", batch_size=64, aggregation_depth=2, **settings)
    with classic_mode():  # pyspark's classic implementations for the classic session
        classic, _ = _fit(_sessions.get("local[2]"), cfg)
    if served:  # room in the closure for the state and half the weights
        state, weights = _state_and_weight_bytes(cfg)
        cap = CLOSURE_SHARE * (state + weights // 2)
        monkeypatch.setattr(ConnectEnv, "max_request_bytes", lambda self: cap)
    connect, summary = _fit(connect_spark, cfg)
    if served:
        assert summary["served_weight_bytes"] > 0 and summary["mirror_fetches"] > 0
    diff = max(float(np.abs(a - b).max()) for a, b in zip(classic, connect, strict=True))
    print(f"max |classic - connect| over the parameters: {diff:.3g}")
    assert diff <= 1e-6
    # and the fit did move the parameters (equal initial weights would pass trivially)
    start = Trainer(DIGITS_MODEL, cfg)._build_model()[0]
    moved = max(
        float(np.abs(a - p.detach().numpy()).max())
        for a, p in zip(connect, start.parameters(), strict=True)
    )
    assert moved > 1e-2


def test_a_model_state_over_the_closure_share_is_refused_before_any_job(  # type: ignore[no-untyped-def]
    connect_spark, monkeypatch
):
    cfg = fast_config(strategy="tree_aggregate")
    state, _ = _state_and_weight_bytes(cfg)
    monkeypatch.setattr(ConnectEnv, "max_request_bytes", lambda self: CLOSURE_SHARE * state - 4)
    train, _ = keyed_digits_frames(connect_spark)
    with pytest.raises(ConfigError, match="raise that setting on the Connect server"):
        Trainer(DIGITS_MODEL, cfg).fit(train)
