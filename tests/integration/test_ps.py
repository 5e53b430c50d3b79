"""The parameter server end to end on local[2]: real barrier stages, the PS in the driver."""

from __future__ import annotations

import threading

import pytest

from sparktrain import Trainer

from .helpers import DIGITS_MODEL, accuracy, digits, digits_frames, fast_config

pytestmark = [pytest.mark.spark]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("mode", "floor", "extra"),
    [
        ("sync", 0.95, {}),
        ("async", 0.93, {}),
        ("ssp", 0.93, {"staleness": 2, "staleness_lr": True}),
    ],
)
def test_digits_mlp_through_the_parameter_server(spark, mode, floor, extra):
    train, test = digits_frames(spark)
    cfg = fast_config(strategy="ps", ps_mode=mode, ps_shards=2, **extra)
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    s = result.summary
    assert s["strategy"] == "ps" and s["metric_value"] >= floor
    split = digits()
    # the returned model holds the server's parameters
    assert accuracy(result.model, split.x_test, split.y_test) >= floor
    ps = s["ps"]
    steps = s["steps_per_epoch"] * cfg.epochs
    assert ps["mode"] == mode and ps["shards"] == 2 and ps["failure"] is None
    assert ps["pushes"] == steps * 2 * 2  # every rank, every step, every shard
    assert ps["duplicates"] == 0 and ps["rejected"] == 0
    assert ps["bytes_in"] > 0 and ps["bytes_out"] > 0
    assert len(ps["wait_s_per_rank"]) == 2
    if mode == "sync":
        assert s["replicas_in_sync"] and ps["staleness_hist"] == {}
    else:
        assert sum(ps["staleness_hist"].values()) > 0
    if mode == "ssp":
        assert ps["max_ssp_gap"] <= 2
    assert s["bytes_sent"] > 0 and s["wire_bytes"] > s["bytes_sent"]
    assert not [t for t in threading.enumerate() if t.name.startswith("sparktrain-ps-")]
