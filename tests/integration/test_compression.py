"""Compressed ring training end to end on local[2] (real barrier stages and sockets)."""

from __future__ import annotations

import pytest

from sparktrain import Trainer

from .fixtures import DIGITS_MODEL, digits_frames, fast_config

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]


def test_digits_topk_with_error_feedback_matches_uncompressed_with_25x_fewer_bytes(spark):
    """SGD lr 0.2, momentum 0.5, 20 epochs, batch 32, for both runs.

    The 2.4-3.6 pp gap once seen with conf/digits_mlp.toml's momentum 0.9 was a bug: the
    residual was kept in units of ``n_r g_r`` and divided by the next step's ``N``, 32x too
    large after an epoch's 1-sample last batch. Kept per sample (``ef.scale``), top-k 1 %
    with error feedback is within 0.3 pp at momentum 0.9 too (``bench compression
    --quality``).
    """
    train, test = digits_frames(spark)
    results = {}
    for spec in ("none", "topk:0.01+ef"):
        cfg = fast_config(
            strategy="ring", compression=spec, lr=0.2, optimizer_kwargs={"momentum": 0.5}
        )
        results[spec] = (
            Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test).summary
        )
    base, topk = results["none"], results["topk:0.01+ef"]
    figures = {k: (v["metric_value"], v["wire_bytes"]) for k, v in results.items()}
    print(figures)
    assert topk["replicas_in_sync"]
    assert topk["metric_value"] >= base["metric_value"] - 0.01
    assert base["wire_bytes"] >= 25 * topk["wire_bytes"]
    # honest figures: raw bytes are what the uncompressed ring would have sent
    assert topk["bytes_sent"] == pytest.approx(base["bytes_sent"], rel=0.01)
    assert topk["compression_ratio"] >= 25


def _digits_run(spark, **overrides):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    cfg = fast_config(**overrides)
    return Trainer(DIGITS_MODEL, cfg, spark=spark).fit(train, validation_data=test).summary


def test_digits_ps_sync_fp16_matches_and_topk_cuts_the_push_bytes(spark):
    """Synchronous PS, 2 shards, the fast config (momentum 0.9, lr 0.05, 20 epochs)."""
    common = {"strategy": "ps", "ps_mode": "sync", "ps_shards": 2}
    runs = {
        spec: _digits_run(spark, compression=spec, **common)
        for spec in ("none", "fp16", "topk:0.01+ef")
    }
    print({k: (v["metric_value"], v["ps"]["push"], v["ps"]["pull"]) for k, v in runs.items()})
    base, half, topk = runs["none"], runs["fp16"], runs["topk:0.01+ef"]
    assert half["metric_value"] >= base["metric_value"] - 0.002  # within 0.2 pp
    assert topk["metric_value"] >= base["metric_value"] - 0.03
    for s in (half, topk):  # raw bytes: what the uncompressed exchange sends
        assert s["ps"]["push"]["raw_bytes"] == base["ps"]["push"]["raw_bytes"]
        assert s["bytes_sent"] == base["bytes_sent"]
    assert half["ps"]["push"]["payload_ratio"] >= 1.9
    # top-k 1 %: fp32 values + int32 indices, so 50x at best on the payload; headers,
    # pull requests and handshakes count in the direction's wire bytes
    assert topk["ps"]["push"]["payload_ratio"] >= 25
    assert base["ps"]["push"]["wire_bytes"] >= 10 * topk["ps"]["push"]["wire_bytes"]
    assert topk["ps"]["pull"]["payload_ratio"] == pytest.approx(
        base["ps"]["pull"]["payload_ratio"]
    )  # pulls stay exact without delta+
    assert topk["wire_bytes"] < 0.6 * base["wire_bytes"]


def test_digits_ps_delta_pulls_are_compressed(spark):
    s = _digits_run(spark, strategy="ps", ps_shards=2, compression="delta+int8+ef")
    assert s["metric_value"] >= 0.94
    assert s["ps"]["pull"]["payload_ratio"] >= 3.5 and s["ps"]["push"]["payload_ratio"] >= 3.5
    assert s["replicas_in_sync"]


TREE_AGGREGATE = {"strategy": "tree_aggregate", "local_steps": 8, "epochs": 15}


@pytest.fixture(scope="module")
def tree_aggregate_uncompressed(_sessions):  # type: ignore[no-untyped-def]
    """The uncompressed tree_aggregate run both compressed runs below are held against
    (on the shared local[2] session, as the ``spark`` fixture's)."""
    return _digits_run(_sessions.get("local[2]"), compression="none", **TREE_AGGREGATE)


def test_digits_tree_aggregate_compressed_payloads_shrink_sparks_own_bytes(  # type: ignore[no-untyped-def]
    spark, tree_aggregate_uncompressed
):
    """Spark's status store (task result bytes) sees the compressed contributions."""
    base = tree_aggregate_uncompressed
    q = _digits_run(spark, compression="int8+ef", **TREE_AGGREGATE)
    runs = {"none": base, "int8+ef": q}
    print({k: (v["metric_value"], v["spark_result_bytes"]) for k, v in runs.items()})
    assert q["metric_value"] >= base["metric_value"] - 0.01
    assert q["bytes_sent"] == base["bytes_sent"]
    # both directions count; only the uploads are compressed without delta+
    assert q["upload_bytes"] / q["upload_wire_bytes"] >= 3.5
    assert q["download_wire_bytes"] == q["download_bytes"] == base["download_bytes"]
    assert q["spark_result_bytes"] < 0.5 * base["spark_result_bytes"]


def test_digits_tree_aggregate_delta_compresses_the_weight_downloads_too(  # type: ignore[no-untyped-def]
    spark, tree_aggregate_uncompressed
):
    """delta+int8+ef: int8 deltas of the weights go down, int8+ef gradients come up."""
    base = tree_aggregate_uncompressed
    both = _digits_run(spark, compression="delta+int8+ef", **TREE_AGGREGATE)
    print({k: both[k] for k in ("metric_value", "download_wire_bytes", "mirror_fetches")})
    assert both["metric_value"] >= base["metric_value"] - 0.02
    assert both["download_bytes"] == base["download_bytes"]
    # int8 deltas: about 1/4 of the float32 weights, plus the exact first and last rounds
    assert both["download_wire_bytes"] < 0.45 * both["download_bytes"]
    assert both["compression_ratio"] >= 2.5
