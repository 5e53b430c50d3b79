"""End to end on local[2] with wire security: every connection of a ring and of a
parameter-server fit (mesh, rendezvous, progress channel, PS shards) over TLS with the
job's pinned certificate. The driver's services (rendezvous, progress channel, PS
shards) run in this process: they must have served TLS handshakes, and a task that did
not speak TLS would have failed its own, so a fit that trains and reports every epoch ran
its channels encrypted."""

from __future__ import annotations

import json

import pytest

from sparktrain import Trainer
from sparktrain.wire.security import WireSecurity

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.mark.parametrize(("strategy", "floor"), [("ring", 0.93), ("ps", 0.9)])
def test_digits_fit_over_tls(spark, strategy, floor, tmp_path, monkeypatch):
    served: list[int] = []
    wrap = WireSecurity.wrap_server

    def counting(self, sock):  # type: ignore[no-untyped-def]
        served.append(1)
        return wrap(self, sock)

    monkeypatch.setattr(WireSecurity, "wrap_server", counting)
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
    # the rendezvous (2 tasks) and the progress channel, plus 2 tasks x 2 shards for ps
    assert len(served) >= (3 if strategy == "ring" else 7)
