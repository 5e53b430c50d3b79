"""Launching the training loop as one Spark barrier stage.

DataFrames go through ``mapInArrow(..., barrier=True)`` (Arrow batches in, Arrow batches
out; works under Spark Connect too); RDDs through ``rdd.barrier().mapPartitions``. Both
run the same :func:`train_partition` and return :class:`Record` rows to the driver.
The task functions close over the picklable :class:`JobSpec` only.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import pyarrow as pa

from sparktrain.launch import rendezvous
from sparktrain.launch.prepare import PreparedData
from sparktrain.result import Record
from sparktrain.worker.context import JobSpec, WorkerContext
from sparktrain.worker.data import from_arrow, from_rows
from sparktrain.worker.loop import train_partition

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame

OUTPUT_SCHEMA = pa.schema(
    [("rank", pa.int32()), ("kind", pa.string()), ("seq", pa.int32()), ("data", pa.binary())]
)
OUTPUT_DDL = "rank int, kind string, seq int, data binary"


def worker_context(spec: JobSpec | None) -> WorkerContext:
    """Rank, world, this task's own host and the collectives, from Spark's barrier context.

    The all-gather goes through the driver's :mod:`~sparktrain.launch.rendezvous` when
    the job has one (Spark's own answers on a once-a-second poll), else through
    ``BarrierTaskContext.allGather``.
    """
    from pyspark import BarrierTaskContext

    tc = BarrierTaskContext.get()
    infos = tc.getTaskInfos()
    rank = tc.partitionId()
    host = infos[rank].address.rsplit(":", 1)[0]
    gather = None
    if spec is not None and spec.rendezvous_address:
        gather = functools.partial(
            rendezvous.all_gather,
            spec.rendezvous_address,
            secret=spec.secret,
            job_id=spec.job_id,
            attempt=spec.attempt,
            rank=rank,
            timeout=spec.config.comm_timeout,
            security=spec.security,
        )

    def all_gather(message: str) -> list[str]:
        if gather is not None:
            return gather(message=message)
        return list(tc.allGather(message))

    return WorkerContext(
        rank=rank,
        world_size=len(infos),
        host=host,
        all_gather=all_gather,
        barrier=tc.barrier,
        spec=spec,
    )


def run(prepared: PreparedData, spec: JobSpec) -> list[Record]:
    """Run the training stage over whichever form the prepared data has."""
    if prepared.frame is not None:
        return run_dataframe(prepared.frame, spec)
    assert prepared.rdd is not None
    return run_rdd(prepared.rdd, spec)


def is_unsupported_chain(exc: BaseException) -> bool:
    """Spark's refusal of a barrier stage over RDDs with other partition counts."""
    text = str(exc)
    return "BarrierJobUnsupportedRDDChainException" in text or (
        "Barrier execution mode does not allow" in text
    )


def run_dataframe(df: DataFrame, spec: JobSpec) -> list[Record]:
    """Train over a DataFrame with columns features (array), label, is_validation."""

    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        ctx = worker_context(spec)
        data = from_arrow(batches, spec.feature_width, ctx.rank)
        records = train_partition(ctx, data)
        yield pa.RecordBatch.from_pylist(
            [{"rank": r.rank, "kind": r.kind, "seq": r.seq, "data": r.data} for r in records],
            schema=OUTPUT_SCHEMA,
        )

    table = df.mapInArrow(task, OUTPUT_DDL, barrier=True).toArrow()
    return [Record(**row) for row in table.to_pylist()]


def run_rdd(rdd: RDD[tuple[object, ...]], spec: JobSpec) -> list[Record]:
    """Train over an RDD of (features, label, is_validation) tuples."""

    def task(rows: Iterable[tuple[object, ...]]) -> Iterator[tuple[int, str, int, bytes]]:
        ctx = worker_context(spec)
        data = from_rows(rows, spec.feature_width, ctx.rank)
        for r in train_partition(ctx, data):
            yield (r.rank, r.kind, r.seq, r.data)

    return [Record(*row) for row in rdd.barrier().mapPartitions(task).collect()]
