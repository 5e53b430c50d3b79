"""Data preparation's Spark jobs (issue 36.3): where a fit scales its features or its
label, one aggregation job gives the statistics and every fixed-size column's width, and
no ``first()`` job runs to learn them; rows whose widths differ, empty frames and empty
arrays get the errors they got before."""

from __future__ import annotations

import numpy as np
import pytest

from sparktrain.driver import prepare as prep
from sparktrain.errors import DataError

from .fixtures import digits, digits_frames

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.fixture()
def no_first_row(monkeypatch):  # type: ignore[no-untyped-def]
    def refuse(frame):  # type: ignore[no-untyped-def]
        raise AssertionError("data preparation read a first row")

    monkeypatch.setattr(prep, "_first_row", refuse)


def test_scaled_features_give_their_width_without_a_first_row(spark, no_first_row):  # type: ignore[no-untyped-def]
    train, test = digits_frames(spark)
    prepared = prep.prepare(train, test, "features", "label", 2, feature_scaling="auto")
    assert prepared.feature_width == 64 and prepared.data_layout.width == 64
    split = digits()
    x = split.x_train.astype(np.float64)
    stds = x.std(axis=0)
    stds[stds <= 0] = 1.0
    assert prepared.feature_stats is not None
    means, got = prepared.feature_stats
    np.testing.assert_allclose(means, x.mean(axis=0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got, stds, rtol=1e-9, atol=1e-12)
    # the frame carries the figures exactly: each value is (x - mean) / std in doubles
    rows = prepared.frame.where("not is_validation").select("features").collect()
    shipped = np.array([r["features"] for r in rows], dtype=np.float32)
    want = ((x - means) / got).astype(np.float32)
    assert np.array_equal(np.sort(shipped, axis=0), np.sort(want, axis=0))


def test_labels_and_typed_columns_share_the_one_job(spark, no_first_row):  # type: ignore[no-untyped-def]
    rows = [([1.0, 2.0], [3, 4, 5], 1.0), ([3.0, 6.0], [1, 2, 3], 3.0), (None, [0, 0, 0], 5.0)]
    df = spark.createDataFrame(rows, "a array<double>, ids array<int>, y double")
    prepared = prep.prepare(df, None, ["a", "ids"], "y", 1, label_scaling=True)
    assert [c.shape for c in prepared.data_layout.columns] == [(2,), (3,)]
    assert prepared.label_stats == pytest.approx((3.0, np.std([1.0, 3.0, 5.0])))
    assert prepared.feature_stats is None  # several columns: features stay as they are


def test_an_array_label_width_comes_from_the_job(spark, no_first_row):  # type: ignore[no-untyped-def]
    rows = [([1.0, 2.0], [1.0, 0.0]), ([3.0, 2.0], [0.0, 1.0])]
    df = spark.createDataFrame(rows, "features array<double>, label array<double>")
    prepared = prep.prepare(df, None, "features", "label", 1, feature_scaling="auto")
    assert prepared.data_layout.label_width == 2
    assert prepared.data_layout.columns[0].shape == (2,)


def test_rows_of_several_widths_fall_back_to_the_first_row(spark):  # type: ignore[no-untyped-def]
    # the first row's width, as before: the tasks' ingest names the rows that differ
    df = spark.createDataFrame([([1.0, 2.0], 1.0)], "features array<double>, label double")
    df = df.union(spark.createDataFrame([([1.0, 2.0, 3.0], 0.0)], df.schema)).coalesce(1)
    prepared = prep.prepare(df, None, "features", "label", 1, feature_scaling="auto")
    assert prepared.feature_width == 2


@pytest.mark.parametrize("scaling", ["auto", False])
def test_empty_frames_and_empty_arrays_say_so(spark, scaling):  # type: ignore[no-untyped-def]
    schema = "features array<double>, label double"
    with pytest.raises(DataError, match="the training data is empty"):
        prep.prepare(spark.createDataFrame([], schema), None, "features", "label", 1,
                     feature_scaling=scaling)  # fmt: skip
    empty = spark.createDataFrame([([], 1.0), ([], 0.0)], schema)
    with pytest.raises(DataError, match="empty"):
        prep.prepare(empty, None, "features", "label", 1, feature_scaling=scaling)


def test_the_partition_count_is_read_from_the_plan_without_a_job(spark):  # type: ignore[no-untyped-def]
    from pyspark.sql import functions as F

    train, _ = digits_frames(spark, partitions=3)
    sc = spark.sparkContext
    group = "sparktrain-test-partitions"
    sc.setJobGroup(group, "partition counts")
    try:
        assert prep._partitions(train.select("features", F.col("label") + 1)) == 3
        assert prep._partitions(train.repartition(5, "label").where("label > 1")) == 5
        assert prep._partitions(spark.createDataFrame([(1,)], "a int")) >= 1
        # a shuffle adaptive execution sizes itself: known once it ran, so not asked
        assert prep._partitions(train.groupBy("label").count()) is None
        assert sc.statusTracker().getJobIdsForGroup(group) == []
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
