"""tree_aggregate's rounds as DataFrame operations (the Spark Connect backend's executor
side): the same reduction as ``RDD.treeAggregate``, with the same seqOp and combOp.

A round is ``cached.mapInArrow(partial)``, one *partial row* per partition (its
contribution, from :func:`~.task.make_seq_op`), then one
``groupBy(group).applyInArrow(level)`` per tree level, then a fold on the driver.
:func:`tree_levels` is pyspark's own ``treeAggregate`` arithmetic: the same depth gives
the same levels, a row with key ``i`` goes to group ``i % n`` of a level of ``n``, and
each group is merged in key order, so the sums are those of the RDD path (a shuffle
merges in fetch order, the only difference: float32 rounding).

A partial row is ``(key, payload, message, stats)``: the payload's bytes (``None``: the
partition had nothing to send), whether they are a compressed ``uint8`` message rather
than a dense float32 vector, and the float64 stats. Nothing here imports pyspark at
module level.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from sparktrain.data.partition_data import PartitionData
from sparktrain.strategies.tree_aggregate.codec import Contribution, PayloadCodec, merge
from sparktrain.strategies.tree_aggregate.task import Block

PARTIAL_DDL = "key int, payload binary, message boolean, stats binary"
_PARTIAL_SCHEMA = pa.schema(
    [
        ("key", pa.int32()),
        ("payload", pa.binary()),
        ("message", pa.bool_()),
        ("stats", pa.binary()),
    ]
)


def tree_levels(partitions: int, depth: int) -> list[int]:
    """The number of groups of each shuffle level ``RDD.treeAggregate(depth=depth)`` puts
    between ``partitions`` partial results and the final reduce (pyspark's arithmetic,
    float division included: a level is added only while it shortens the tree)."""
    if depth < 1:
        raise ValueError(f"aggregation depth must be at least 1, got {depth}")
    if partitions <= 0:
        return []
    scale = max(math.ceil(pow(partitions, 1.0 / depth)), 2)
    levels = []
    current: float = partitions
    while current > scale + current / scale:
        current /= scale
        levels.append(int(current))
    return levels


def decode_parts(
    xs: Iterable[bytes], ys: Iterable[bytes], vs: Iterable[bytes], ws: Iterable[bytes | None],
    width: int,
) -> PartitionData:  # fmt: skip
    """One partition's rows from the raw buffers the Arrow encoder wrote (one entry per
    Arrow batch: features, labels, validation flags, weights or None), in order."""
    parts = [
        PartitionData(
            np.frombuffer(x, dtype=np.float32).reshape(-1, width),
            np.frombuffer(y, dtype=np.float64),
            np.frombuffer(v, dtype=np.bool_),
            None if w is None else np.frombuffer(w, dtype=np.float64),
        )
        for x, y, v, w in zip(xs, ys, vs, ws, strict=True)
    ]
    return PartitionData.concat(parts, width)


def to_row(key: int, contribution: Contribution | None) -> dict[str, Any]:
    """A contribution as one partial row (``None``, the zero value: no payload, no stats)."""
    if contribution is None:
        return {"key": key, "payload": None, "message": False, "stats": None}
    payload, stats = contribution
    if payload is None:
        body, message = None, False
    else:
        array = np.asarray(payload)
        message = array.dtype == np.uint8
        body = np.ascontiguousarray(array, dtype=np.uint8 if message else np.float32).tobytes()
    return {"key": key, "payload": body, "message": message, "stats": stats.tobytes()}


def from_row(payload: bytes | None, message: bool, stats: bytes | None) -> Contribution | None:
    """A partial row's contribution, in fresh writable arrays (combOp sums in place)."""
    if stats is None:
        return None
    values = np.frombuffer(stats, dtype=np.float64).copy()
    if payload is None:
        return None, values
    return np.frombuffer(payload, dtype=np.uint8 if message else np.float32).copy(), values


def fold(rows: Iterable[tuple[bytes | None, bool, bytes | None]], codec: PayloadCodec) -> Any:
    """combOp over partial rows, in the given order (what ``reduce`` does)."""
    acc: Contribution | None = None
    for payload, message, stats in rows:
        acc = merge(acc, from_row(payload, message, stats), codec)
    return acc


def fold_table(table: pa.Table, codec: PayloadCodec) -> Contribution | None:
    """combOp over a table of partial rows in key order (the RDD path's partition order)."""
    keys = table.column("key").to_pylist()
    order = sorted(range(len(keys)), key=keys.__getitem__)
    payloads = table.column("payload").to_pylist()
    messages = table.column("message").to_pylist()
    stats = table.column("stats").to_pylist()
    result: Contribution | None = fold(
        ((payloads[i], bool(messages[i]), stats[i]) for i in order), codec
    )
    return result


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=_PARTIAL_SCHEMA)


def partial_fn(
    seq_op: Callable[[Contribution | None, Block], Contribution | None],
    width: int,
    build: Callable[[int, PartitionData], Block],
    task_partition: Callable[[], int],
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The round's ``mapInArrow`` function over the cached encoded rows
    (``part, x, y, v, w``): the partition's :class:`Block` (``build``: label checks and
    the validation split, as the RDD path's cache does), its contribution through
    ``seq_op``, one partial row keyed by the partition index (``task_partition``: the
    running task's, for a partition without rows; the driver side passes Spark's)."""

    def partial(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        xs: list[bytes] = []
        ys: list[bytes] = []
        vs: list[bytes] = []
        ws: list[bytes | None] = []
        part: int | None = None
        for batch in batches:
            cols = batch.to_pydict()
            part = int(cols["part"][0]) if cols["part"] else part
            xs += cols["x"]
            ys += cols["y"]
            vs += cols["v"]
            ws += cols["w"]
        if part is None:  # an empty partition wrote no rows: the task's own index
            part = task_partition()
        block = build(part, decode_parts(xs, ys, vs, ws, width))
        yield from _table([to_row(part, seq_op(None, block))]).to_batches()

    return partial


def level_fn(codec: PayloadCodec) -> Callable[[pa.Table], pa.Table]:
    """One tree level's ``applyInArrow`` function: a group's partial rows (with their
    ``group`` column) merged in key order into one row keyed by the group."""

    def level(table):  # type: ignore[no-untyped-def]  # unhinted: pyspark's table -> table UDF
        group = int(table.column("group")[0].as_py())
        return _table([to_row(group, fold_table(table, codec))])

    return level
