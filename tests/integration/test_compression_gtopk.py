"""The resparsify ring (gTop-k) end to end: top-k 1 % with error feedback at local[4].

Marked ``scale`` (a world past the default run's local[2], so a session of its own);
tests/unit/test_compress_gtopk.py covers the path itself at worlds 3 to 8 in-process."""

from __future__ import annotations

import pytest

from sparktrain import Trainer

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.scale, pytest.mark.timeout(300)]


def test_digits_topk_ef_at_world_4_takes_the_resparsify_ring(_sessions):  # type: ignore[no-untyped-def]
    """Four workers (a local[4] session: one barrier slot each), the fast config with
    lr 0.2 and momentum 0.5 as test_compression.py's top-k run, 10 epochs."""
    spark = _sessions.get("local[4]")
    train, test = digits_frames(spark, partitions=4)
    cfg = fast_config(
        compression="topk:0.01+ef",
        num_workers=4,
        epochs=10,
        lr=0.2,
        optimizer_kwargs={"momentum": 0.5},
    )
    summary = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test).summary
    print({k: summary[k] for k in ("metric_value", "wire_bytes", "compression_path")})
    assert summary["compression_path"] == "resparsify"
    assert summary["replicas_in_sync"]
    assert summary["metric_value"] > 0.9
    assert summary["compression_ratio"] >= 20
