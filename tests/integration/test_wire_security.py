"""End to end on local[2] with wire security: every connection of a ring and of a
parameter-server fit (mesh, rendezvous, progress channel, PS shards) over TLS with the
job's pinned certificate. A side that did not speak TLS would fail its handshake, so a
fit that trains and reports every epoch ran all of its channels encrypted."""

from __future__ import annotations

import json

import pytest

from sparktrain import Trainer

from .helpers import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.mark.parametrize(("strategy", "floor"), [("ring", 0.93), ("ps", 0.9)])
def test_digits_fit_over_tls(spark, strategy, floor, tmp_path):
    train, test = digits_frames(spark)
    jsonl = tmp_path / "epochs.jsonl"
    extra = {"ps_mode": "sync", "ps_shards": 2} if strategy == "ps" else {}
    cfg = fast_config(
        strategy=strategy, encryption="tls", epochs=8, metrics_jsonl=str(jsonl), **extra
    )
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test)
    s = result.summary
    assert s["metric_name"] == "accuracy" and s["metric_value"] >= floor
    epochs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == list(range(8))  # the progress channel, over TLS
