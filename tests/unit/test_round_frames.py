"""tree_aggregate's DataFrame reduction without Spark: the level arithmetic is pyspark's
own ``RDD.treeAggregate`` (driven here over in-process partitions), the partial rows
carry contributions through Arrow unchanged, and the levels merge in the same order."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from sparktrain.compress.base import BucketState
from sparktrain.data.partition_data import PartitionData
from sparktrain.strategies.tree_aggregate.codec import make_codec, merge
from sparktrain.strategies.tree_aggregate.task_frames import (
    fold_table,
    from_row,
    level_fn,
    partial_fn,
    to_row,
    tree_levels,
)


class _ListRDD:
    """The RDD methods pyspark's ``treeAggregate`` calls, over in-process partitions;
    ``reduceByKey`` records its partition counts and merges a key's values in partition
    order (hash of a small int is the int, as in Spark's portable_hash)."""

    def __init__(self, parts: list[list[Any]], log: list[int]) -> None:
        self.parts, self.log = parts, log

    def getNumPartitions(self) -> int:
        return len(self.parts)

    def mapPartitions(self, f: Callable[[Iterator[Any]], Iterable[Any]]) -> _ListRDD:
        return _ListRDD([list(f(iter(p))) for p in self.parts], self.log)

    def mapPartitionsWithIndex(self, f: Callable[[int, Iterator[Any]], Iterable[Any]]) -> _ListRDD:
        return _ListRDD([list(f(i, iter(p))) for i, p in enumerate(self.parts)], self.log)

    def reduceByKey(self, f: Callable[[Any, Any], Any], n: int) -> _ListRDD:
        self.log.append(n)
        out: list[dict[int, Any]] = [{} for _ in range(n)]
        for key, value in itertools.chain.from_iterable(self.parts):
            slot = out[key % n]
            slot[key] = f(slot[key], value) if key in slot else value
        return _ListRDD([list(d.items()) for d in out], self.log)

    def values(self) -> _ListRDD:
        return _ListRDD([[v for _, v in p] for p in self.parts], self.log)

    def reduce(self, f: Callable[[Any, Any], Any]) -> Any:
        vals = [functools.reduce(f, p) for p in self.parts if p]
        return functools.reduce(f, vals)


def _pyspark_tree(partitions: int, depth: int) -> tuple[list[int], str]:
    """pyspark's treeAggregate over one item per partition: its levels, and the order it
    merges in (as a bracketed expression)."""
    from pyspark.core.rdd import RDD

    log: list[int] = []
    rdd = _ListRDD([[f"p{i}"] for i in range(partitions)], log)
    expr = RDD.treeAggregate(
        rdd,  # type: ignore[arg-type]
        None,
        lambda acc, x: x if acc is None else f"({acc}+{x})",
        lambda a, b: f"({a}+{b})",
        depth,
    )
    return log, expr


def _frames_tree(partitions: int, depth: int) -> str:
    """What the DataFrame path does: per level, group key % n, merge by key, key the
    result by the group; the client folds the last rows in key order."""
    rows = {i: f"p{i}" for i in range(partitions)}
    for n in tree_levels(partitions, depth):
        groups: dict[int, list[int]] = {}
        for key in sorted(rows):
            groups.setdefault(key % n, []).append(key)
        rows = {
            g: functools.reduce(lambda a, b: f"({a}+{b})", [rows[k] for k in keys])
            for g, keys in groups.items()
        }
    return functools.reduce(lambda a, b: f"({a}+{b})", [rows[k] for k in sorted(rows)])


@pytest.mark.parametrize("partitions", [1, 2, 3, 5, 7, 9, 16, 33, 100, 257])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_levels_and_merge_order_are_pyspark_tree_aggregates(partitions: int, depth: int) -> None:
    levels, expr = _pyspark_tree(partitions, depth)
    assert tree_levels(partitions, depth) == levels
    assert _frames_tree(partitions, depth) == expr


def test_tree_levels_examples_and_bad_depth() -> None:
    assert tree_levels(2, 2) == []  # two partitions: no shuffle level
    assert tree_levels(9, 2) == [3]
    assert tree_levels(100, 3) == [20, 4]
    with pytest.raises(ValueError, match="at least 1"):
        tree_levels(4, 0)


def _contribution(seed: int, codec: Any, samples: float) -> tuple[Any, np.ndarray]:
    vec = np.random.default_rng(seed).standard_normal(50).astype(np.float32)
    stats = np.zeros(8)
    stats[0] = samples
    state = BucketState(key=0, seed=7) if codec.compressed else None
    return codec.encode(vec, state), stats


@pytest.mark.parametrize("spec", ["none", "int8", "fp16"])
def test_partial_rows_round_trip_and_a_level_merges_like_comb_op(spec: str) -> None:
    codec = make_codec(spec)
    parts = [_contribution(i, codec, 10.0 + i) for i in range(5)]
    parts[3] = (None, parts[3][1])  # a partition with nothing to send
    for c in parts:
        back = from_row(*(to_row(0, c)[k] for k in ("payload", "message", "stats")))
        assert back is not None
        assert (back[0] is None) == (c[0] is None)
        if c[0] is not None:
            np.testing.assert_array_equal(back[0], c[0])
            assert back[0].dtype == np.asarray(c[0]).dtype and back[0].flags.writeable
    assert to_row(4, None)["stats"] is None and from_row(None, False, None) is None
    # rows in a shuffled order, with the group column a level adds: merged in key order
    rows = [{**to_row(k, parts[k]), "group": 1} for k in (2, 0, 4, 3, 1)]
    table = pa.Table.from_pylist(rows)
    out = level_fn(codec)(table)
    assert out.column("key").to_pylist() == [1]
    merged = fold_table(out, codec)
    expected = functools.reduce(lambda a, b: merge(a, b, codec), parts, None)
    assert merged is not None and expected is not None
    np.testing.assert_array_equal(codec.decode(merged[0]), codec.decode(expected[0]))
    np.testing.assert_array_equal(merged[1], expected[1])
    assert merged[1][0] == sum(10.0 + i for i in range(5))


def _encoded_batch(part: int, data: PartitionData) -> pa.RecordBatch:
    """One batch of the cached encoded rows, as the Arrow encoder writes them."""
    return pa.RecordBatch.from_pydict(
        {
            "part": pa.array([part], pa.int32()),
            "x": pa.array([data.x.tobytes()], pa.binary()),
            "y": pa.array([data.y.tobytes()], pa.binary()),
            "v": pa.array([data.is_val.tobytes()], pa.binary()),
            "w": pa.array([None], pa.binary()),
        }
    )


def test_a_partial_row_is_the_seq_op_of_the_partitions_block() -> None:
    """The mapInArrow function rebuilds the block from the encoded batches (in order,
    validation rows split off) and writes exactly what the RDD path's seqOp computes."""
    from sparktrain.strategies.tree_aggregate.driver_round import block_builder
    from sparktrain.strategies.tree_aggregate.task import _STATES, make_seq_op

    from .fixtures import ROUNDS_WIDTH, rounds_blocks, rounds_cfg, rounds_model, rounds_spec

    cfg = rounds_cfg(local_steps=2)
    blocks = rounds_blocks((37, 20))
    model = rounds_model()
    spec = rounds_spec(cfg, model, blocks, "frames")
    weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    seq_op = make_seq_op(spec, weights, 1, True, True)
    build = block_builder(cfg, 3)
    block = blocks[1]
    rows = PartitionData.concat([block.train, block.val], ROUNDS_WIDTH)
    halves = [PartitionData(rows.x[:15], rows.y[:15], rows.is_val[:15]),
              PartitionData(rows.x[15:], rows.y[15:], rows.is_val[15:])]  # fmt: skip
    fn = partial_fn(seq_op, ROUNDS_WIDTH, build, lambda: 9)
    try:
        (out,) = list(fn(iter([_encoded_batch(1, h) for h in halves])))
        expected = seq_op(None, build(1, rows))
        empty = list(fn(iter([])))
    finally:
        _STATES.clear()
    assert out.column(0).to_pylist() == [1]
    got = from_row(out.column(1)[0].as_py(), out.column(2)[0].as_py(), out.column(3)[0].as_py())
    assert got is not None and expected is not None
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1][:6].tolist() == expected[1][:6].tolist()  # all but the timing slots
    assert got[1][0] == 4 and got[1][3] == 10  # round 1: the last 4 of 20 rows; 10 evaluated
    # a partition without rows is keyed by its task and contributes no samples
    (row,) = empty
    assert row.column(0).to_pylist() == [9]
    nothing = from_row(None, False, row.column(3)[0].as_py())
    assert nothing is not None and nothing[0] is None and nothing[1][0] == 0
