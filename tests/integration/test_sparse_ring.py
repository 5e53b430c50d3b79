"""Sparse embedding gradients through a real Spark (local[2]) with the ring: a
``sparse=True`` table trains on its touched rows to the losses of the dense path
(docs/sparse.md)."""

from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest

from sparktrain import Trainer

from .fixtures import fast_config

MODULE = textwrap.dedent(
    '''
    """A recommender-shaped model whose table gives sparse gradients."""
    from sparktrain.models import embedding_regressor


    def build():
        model = embedding_regressor(500, 8)
        model.embedding.sparse = True  # read by every forward: the rows' gradient
        return model
    '''
)


@pytest.fixture()
def sparse_model(spark, tmp_path):  # type: ignore[no-untyped-def]
    path = tmp_path / "sparse_ids_model.py"
    path.write_text(MODULE)
    spark.sparkContext.addPyFile(str(path))  # the executors import it from here
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("sparse_ids_model")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("sparse_ids_model", None)


def test_a_sparse_table_trains_on_its_rows_like_the_dense_path(spark, sparse_model):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, (400, 3)), 500) - 1  # Zipf: ranks share hot rows
    signal = np.sin(np.arange(500) / 7.0)  # each id's value, learnable from its row
    label = signal[ids].mean(axis=1)
    rows = [([float(i) for i in r], float(y)) for r, y in zip(ids, label, strict=True)]
    df = spark.createDataFrame(rows, "features array<double>, label double").repartition(2)
    cfg = fast_config(
        strategy="ring", epochs=3, batch_size=40, lr=0.5, optimizer_kwargs={}, loss="mse"
    )
    sparse = Trainer("sparse_ids_model:build", cfg, spark=spark).fit(df)
    dense = Trainer(
        "sparse_ids_model:build", cfg.replace(sparse_embeddings="off"), spark=spark
    ).fit(df)
    s = sparse.summary
    assert s["replicas_in_sync"] and s["sparse_tables"] == 1
    # the features are row indices: feature_scaling="auto" leaves them to the embedding
    assert "feature_scaling" not in s
    assert s["sparse_row_way"] > 0 and 0 < s["sparse_rows_per_step"] < 500
    assert 0 < s["sparse_bytes_sent"] < dense.summary["bytes_sent"]
    assert "sparse_tables" not in dense.summary
    # the same averaged gradients: the same losses (float32 sums in another order)
    for mine, theirs in zip(sparse.history, dense.history, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
    assert sparse.history[-1]["loss"] < sparse.history[0]["loss"]
    # the table's rows int8-compressed with error feedback (docs/sparse.md): fewer
    # bytes, every epoch's loss close to the exact rows'
    policy = {"embedding.*": "int8+ef", "*": "none"}
    packed = Trainer("sparse_ids_model:build", cfg.replace(compression=policy), spark=spark).fit(df)
    p = packed.summary
    assert p["replicas_in_sync"] and p["sparse_compression"] == {"embedding.weight": "int8+ef"}
    assert p["sparse_rows_ratio"] > 2 * s["sparse_rows_ratio"]
    assert 0 < p["sparse_bytes_sent"] < s["sparse_bytes_sent"]
    for mine, theirs in zip(packed.history, sparse.history, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=0.05)
