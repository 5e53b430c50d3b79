"""``bench compression --quality``'s one run on local[2]: the per-worker batch, the seed,
the compression path and each epoch's validation accuracy and time reach the record."""

from __future__ import annotations

import pytest

from benchmarks.compression import quality_run
from benchmarks.compression_worlds import per_worker_batch, time_to_accuracy

from .fixtures import digits_frames

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def test_quality_run_records_batch_seed_path_and_epoch_history(spark):
    frames = digits_frames(spark)
    batch = per_worker_batch(64, 2)

    def run(spec: str, seed: int):  # type: ignore[no-untyped-def]
        return quality_run(spark, frames, "mlp", "ring", spec, 2, 1, seed=seed, batch_size=batch)

    first, again, topk = run("none", 3), run("none", 3), run("topk:0.01+ef", 3)
    assert first["batch_size"] == 32 and first["seed"] == 3 and first["link"] == "none"
    # 1347 training images over 2 workers at 32 each: 21 full steps and a short one
    assert first["steps_per_epoch"] == 22
    # the seed makes the run: the same seed trains the same accuracies epoch by epoch
    assert [h["metric"] for h in first["history"]] == [h["metric"] for h in again["history"]]
    assert [h["epoch"] for h in topk["history"]] == [0]
    assert all(h["seconds"] > 0 and 0.0 <= h["metric"] <= 1.0 for h in topk["history"])
    reached = time_to_accuracy(topk["history"], 0.0)
    assert reached == {"seconds": topk["history"][0]["seconds"], "epoch": 0}
    # the path the collective took is reported for compressed runs only
    assert first["compression_path"] is None
    assert isinstance(topk["compression_path"], str) and topk["compression_path"]
    assert topk["wire_bytes"] * 25 <= first["wire_bytes"]
