"""Sparse embedding rows through the parameter server on local[2] (docs/sparse_ps.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparktrain import Trainer

from .fixtures import fast_config

pytestmark = [pytest.mark.spark]

ROWS, DIM = 1000, 8


@pytest.mark.timeout(240)  # the session fixture starts Spark inside it
def test_a_sparse_table_trains_through_the_ps_by_rows(spark):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 200, (1200, 1))  # 200 of the table's 1000 rows are ever used
    labels = (ids[:, 0] % 2).astype(float)  # learnable from the id's row alone
    df = spark.createDataFrame(
        [([int(v) for v in row], float(y)) for row, y in zip(ids, labels, strict=True)],
        "features array<long>, label double",
    ).repartition(2)
    cfg = fast_config(
        strategy="ps", ps_shards=2, epochs=6, lr=5.0, optimizer_kwargs={}, batch_size=64
    )
    result = Trainer(
        "tests.integration.sparse_models:id_bag", cfg, model_kwargs={"rows": ROWS, "dim": DIM}
    ).fit(df)
    s, ps = result.summary, result.summary["ps"]
    assert s["strategy"] == "ps" and ps["failure"] is None and s["replicas_in_sync"]
    with torch.no_grad():
        pred = result.model(torch.from_numpy(ids)).argmax(1).numpy()
    assert (pred == labels).mean() > 0.9  # the driver's model: the server's tables
    # rows, not tables: each push carries at most the batch's ids, never the 1000 rows
    steps = s["steps_per_epoch"] * cfg.epochs
    table_bytes = ROWS * DIM * 4
    assert 0 < ps["rows_pushed"] <= steps * 2 * 64
    assert ps["push"]["raw_bytes"] < steps * 2 * table_bytes / 4
    assert ps["pull"]["raw_bytes"] < steps * 2 * table_bytes / 4
