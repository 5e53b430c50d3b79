"""``shard_optimizer = true`` through a real Spark (local[2]): digits trains to the usual
accuracy with each worker keeping half of the optimizer state."""

from __future__ import annotations

from sparktrain import Trainer

from .fixtures import DIGITS_MODEL, digits_frames, fast_config


def test_digits_trains_with_sharded_optimizer_state(spark):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    cfg = fast_config(strategy="ring", shard_optimizer=True, epochs=15)
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    assert result.summary["metric_value"] >= 0.95
    assert result.summary["replicas_in_sync"]
