"""``strategy="auto"``, ``compression="auto"`` end to end on local[2]: the barrier stage
probes its links, picks ring/tree and a compressor, trains, and says why."""

from __future__ import annotations

import pytest

from sparktrain import Trainer

from .fixtures import DIGITS_MODEL, SUMMARY_KEYS, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]


def test_auto_trains_digits_and_reports_its_choice(spark):
    train, test = digits_frames(spark)
    cfg = fast_config(strategy="auto", compression="auto")
    summary = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test).summary
    auto = summary["auto"]
    print({k: v for k, v in auto.items() if k != "candidates"})
    assert set(summary) >= SUMMARY_KEYS
    assert summary["strategy"] == "auto"  # what was asked; the choice is in "auto"
    assert summary["metric_value"] >= 0.9
    assert summary["replicas_in_sync"]
    assert auto["asked"] == {"strategy": "auto", "compression": "auto"}
    assert auto["strategy"] in ("ring", "tree")
    assert auto["compression"] in ("none", "fp16", "int8+ef", "powersgd:2+ef", "topk:0.01+ef")
    assert "measured alpha" in auto["reason"]
    probe = auto["probe"]
    assert probe["world"] == 2 and probe["alpha_s"] > 0 and probe["beta_s_per_byte"] > 0
    assert probe["compute_s"] > 0 and probe["probe_s"] > 0  # measured and reported
    assert f"{auto['strategy']}/{auto['compression']}" in auto["candidates"]
