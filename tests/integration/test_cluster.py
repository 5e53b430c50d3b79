"""Two executor processes: local-cluster[2,1,1024]."""

from __future__ import annotations

import pytest

from sparktrain import Trainer

from .fixtures import DIGITS_MODEL, digits_frames, fast_config, pyspark_over_unix_sockets_works

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]


def test_local_cluster_smoke(spark_cluster):
    sc = spark_cluster.sparkContext
    train, test = digits_frames(spark_cluster)
    result = Trainer(DIGITS_MODEL, fast_config(epochs=5), spark=spark_cluster).fit(
        train, validation_data=test
    )
    assert sc.master.startswith("local-cluster")
    assert result.summary["metric_value"] > 0.9
    assert result.summary["replicas_in_sync"]


def test_local_cluster_runs_pyspark_over_unix_sockets(spark_cluster):
    """Issue 31, point 3, on executors of their own (test_unix_sockets.py: local mode)."""
    pyspark_over_unix_sockets_works(spark_cluster)
