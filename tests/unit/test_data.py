import numpy as np
import pyarrow as pa
import pytest

from sparktrain.data.partition_data import (
    FEATURES,
    IS_VALIDATION,
    LABEL,
    WEIGHT,
    PartitionData,
    check_labels,
    epoch_batches,
    from_arrow,
    from_rows,
)
from sparktrain.errors import DataError


def _batch(rows, labels, val=None, weight=None):
    cols = {FEATURES: pa.array(rows, pa.list_(pa.float32())), LABEL: pa.array(labels, pa.float64())}
    if val is not None:
        cols[IS_VALIDATION] = pa.array(val)
    if weight is not None:
        cols[WEIGHT] = pa.array(weight, pa.float64())
    return pa.RecordBatch.from_pydict(cols)


def test_arrow_batches_become_one_array():
    batches = [_batch([[1, 2], [3, 4]], [0, 1]), _batch([], []), _batch([[5, 6]], [1], [True])]
    data = from_arrow(batches, layout=2, rank=0)
    np.testing.assert_array_equal(data.x, [[1, 2], [3, 4], [5, 6]])
    np.testing.assert_array_equal(data.y, [0, 1, 1])
    np.testing.assert_array_equal(data.is_val, [False, False, True])
    assert data.x.dtype == np.float32 and data.x.flags.c_contiguous


def test_empty_partition_has_the_right_shape():
    data = from_arrow([], layout=3, rank=1)
    assert data.x.shape == (0, 3) and data.size == 0


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([[1.0, 2.0], [1.0]], "has 1 values but the model expects 2"),
        ([[1.0, float("nan")]], "NaN or infinite features"),
        ([[1.0, float("inf")]], "NaN or infinite features"),
        ([None], "null features"),
    ],
)
def test_bad_arrow_rows_are_refused(rows, needle):
    with pytest.raises(DataError, match=needle):
        from_arrow([_batch(rows, [0] * len(rows))], layout=2, rank=0)


def test_rdd_rows():
    data = from_rows([(np.array([1.0, 2.0]), 1), ([3, 4], 0, True)], width=2, rank=0)
    np.testing.assert_array_equal(data.x, [[1, 2], [3, 4]])
    np.testing.assert_array_equal(data.is_val, [False, True])
    with pytest.raises(DataError, match="expects width 3"):
        from_rows([([1.0, 2.0], 0)], width=3, rank=0)
    with pytest.raises(DataError, match=r"\(features, label\) pairs"):
        from_rows([(1.0,)], width=1, rank=0)


def test_split_uses_tags_or_a_seeded_fraction():
    x = np.zeros((1000, 1), np.float32)
    tagged = PartitionData(x, np.zeros(1000), np.arange(1000) < 100)
    train, val = tagged.split(0.5, seed=0, rank=0)
    assert (train.size, val.size) == (900, 100)
    untagged = PartitionData(x, np.zeros(1000), np.zeros(1000, bool))
    a = untagged.split(0.2, seed=1, rank=0)[1].size
    assert a == untagged.split(0.2, seed=1, rank=0)[1].size and 140 < a < 260


def test_labels_must_be_class_indices():
    check_labels(np.array([0.0, 9.0]), 10, 0)
    for bad in ([0.5], [-1.0], [10.0]):
        with pytest.raises(DataError, match="class indices 0..9"):
            check_labels(np.array(bad), 10, 0)


def test_epoch_batches_cover_every_row_once():
    idx = np.concatenate(list(epoch_batches(10, 3, np.random.default_rng(0))))
    assert sorted(idx.tolist()) == list(range(10))
    assert [len(b) for b in epoch_batches(10, 3, None)] == [3, 3, 3, 1]


def test_weights_travel_with_their_rows():
    batches = [
        _batch([[1, 2], [3, 4]], [0, 1], weight=[0.5, 0.0]),
        _batch([[5, 6]], [1], weight=[2.5]),
    ]
    data = from_arrow(batches, layout=2, rank=0)
    assert data.w is not None and data.w.dtype == np.float64
    np.testing.assert_array_equal(data.w, [0.5, 0.0, 2.5])
    picked = data.select(np.array([True, False, True]))
    np.testing.assert_array_equal(picked.w, [0.5, 2.5])
    np.testing.assert_array_equal(data.weights_at(np.array([2, 0])).numpy(), [2.5, 0.5])
    train, val = data.split(0.5, seed=1, rank=0)
    assert train.w is not None and val.w is not None and train.w.size + val.w.size == 3
    both = PartitionData.concat([picked, data], width=2)
    np.testing.assert_array_equal(both.w, [0.5, 2.5, 0.5, 0.0, 2.5])
    unweighted = from_arrow([_batch([[1, 2]], [0])], layout=2, rank=0)
    assert unweighted.w is None and unweighted.weights_at(np.array([0])) is None
    with pytest.raises(DataError, match="weighted and unweighted"):
        PartitionData.concat([data, unweighted], width=2)


@pytest.mark.parametrize(
    ("weight", "needle"),
    [([None, 1.0], "null weight"), ([1.0, -1.0], "finite and >= 0"), ([1.0, np.inf], "finite")],
)
def test_bad_weights_are_refused_on_the_worker(weight, needle):
    with pytest.raises(DataError, match=needle):
        from_arrow([_batch([[1, 2], [3, 4]], [0, 1], weight=weight)], layout=2, rank=3)


def test_drop_last_leaves_out_the_short_batch_and_keeps_every_full_one():
    from sparktrain.data.partition_data import epoch_batches, steps_for

    assert steps_for(673, 32) == 22 and steps_for(673, 32, drop_last=True) == 21
    assert steps_for(31, 32, drop_last=True) == 0 and steps_for(0, 32) == 0
    rng = np.random.default_rng(0)
    batches = list(epoch_batches(673, 32, rng, drop_last=True))
    assert [len(b) for b in batches] == [32] * 21
    flat = np.concatenate(batches)
    assert len(np.unique(flat)) == 672  # no row twice; one row sits this epoch out
    assert [len(b) for b in epoch_batches(673, 32, None)][-1] == 1


def test_the_windowed_shuffle_is_a_permutation_read_one_window_at_a_time():
    from sparktrain.data.partition_data import epoch_order

    n, window = 1003, 100
    order = epoch_order(n, np.random.default_rng([0, 1, 2]), window)
    assert sorted(order.tolist()) == list(range(n))
    # every window's rows come as one run: the window id changes once per window
    ids = order // window
    runs = ids[np.r_[True, ids[1:] != ids[:-1]]]
    assert sorted(runs.tolist()) == list(range(-(-n // window)))
    assert runs.tolist() != sorted(runs.tolist())  # windows visited in a shuffled order
    first = order[ids == runs[0]]
    assert not np.array_equal(first, np.sort(first))  # rows within a window shuffled
    # seeded: the same generator state gives the same order; 0 is the full permutation
    assert np.array_equal(order, epoch_order(n, np.random.default_rng([0, 1, 2]), window))
    full = epoch_order(n, np.random.default_rng(5), 0)
    assert np.array_equal(full, np.random.default_rng(5).permutation(n))
    assert np.array_equal(epoch_order(n, None, window), np.arange(n))
