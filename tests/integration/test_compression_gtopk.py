"""Top-k out of the box (issue 34.3) end to end at local[4]: ``compression="topk:0.01+ef"``
alone, under SGD momentum, moves the momentum into the compressor (said once) and keeps
the exact all-gather at world 4.

Marked ``scale`` (a world past the default run's local[2], so a session of its own);
tests/unit/test_compress_gtopk.py covers the resparsify ring and rounds at worlds 3 to 8
in-process, tests/unit/test_compress_correction.py the momentum move."""

from __future__ import annotations

import logging

import pytest

from sparktrain import Trainer

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.scale, pytest.mark.timeout(300)]


def test_digits_topk_ef_at_world_4_moves_the_momentum_and_keeps_the_all_gather(  # type: ignore[no-untyped-def]
    _sessions, caplog
):
    """Four workers (a local[4] session: one barrier slot each), the fast config with
    lr 0.2 and momentum 0.5 as test_compression.py's top-k run, 10 epochs."""
    spark = _sessions.get("local[4]")
    train, test = digits_frames(spark, partitions=4)
    cfg = fast_config(
        compression="topk:0.01+ef",
        num_workers=4,
        epochs=10,
        lr=0.2,
        optimizer="sgd",
        optimizer_kwargs={"momentum": 0.5},
    )
    with caplog.at_level(logging.WARNING, logger="sparktrain.compress.correction"):
        result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    summary = result.summary
    print({k: summary[k] for k in ("metric_value", "wire_bytes", "compression_path")})
    said = [r.getMessage() for r in caplog.records if "moves into the compressor" in r.getMessage()]
    assert len(said) == 1
    assert summary["compression"] == "topk:0.01+ef:momentum=0.5"
    assert cfg.compression == "topk:0.01+ef"  # the caller's config is untouched
    assert summary["compression_path"] == "allgather"
    assert summary["replicas_in_sync"]
    assert summary["metric_value"] > 0.9
    assert summary["compression_ratio"] >= 20
