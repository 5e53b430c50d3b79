"""The one barrier launcher: a per-task entry run in every task of one barrier stage.

DataFrames go through ``mapInArrow(..., barrier=True)`` (Arrow batches in, Arrow batches
out; works under Spark Connect too); RDDs through ``rdd.barrier().mapPartitions``. Both
run the same entry (the built-in loop, a pipeline stage) on the task's converted
partition and return :class:`~sparktrain.result.Record` rows to the driver. The task
functions close over the picklable :class:`JobSpec` and entry only. The attempt loop
around a launch is :mod:`sparktrain.driver.stage_runner`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa

from sparktrain.data.partition_data import PartitionData, SpillPlan, from_arrow, from_rows
from sparktrain.data.spill import spill_path, sweep_orphans
from sparktrain.driver import gpu
from sparktrain.driver.prepare import PreparedData
from sparktrain.driver.services import rendezvous
from sparktrain.errors import ConfigError, SparkTrainError, WorkerError
from sparktrain.result import Record
from sparktrain.task import output
from sparktrain.task.context import JobSpec, WorkerContext
from sparktrain.task.memory import reset_peak_anon
from sparktrain.wire.listen import address_of, open_listener

log = logging.getLogger(__name__)

TaskEntry = Callable[[WorkerContext, PartitionData], list[Record]]
"""What every task of the stage runs on its partition; picklable (a module-level
function or a ``functools.partial`` of one)."""

OUTPUT_SCHEMA = pa.schema(
    [("rank", pa.int32()), ("kind", pa.string()), ("seq", pa.int32()), ("data", pa.binary())]
)
OUTPUT_DDL = "rank int, kind string, seq int, data binary"


def worker_context(spec: JobSpec | None) -> WorkerContext:
    """Rank, world, this task's own host and the collectives, from Spark's barrier context.

    The all-gather goes through the driver's :mod:`~sparktrain.driver.services.rendezvous` when
    the job has one (Spark's own answers on a once-a-second poll), else through
    ``BarrierTaskContext.allGather``.
    """
    from pyspark import BarrierTaskContext

    tc = BarrierTaskContext.get()
    infos = tc.getTaskInfos()
    rank = tc.partitionId()
    host = infos[rank].address.rsplit(":", 1)[0]
    if spec is not None and spec.fault is not None and rank in spec.fault.unreachable_driver:
        spec = cut_off_from_driver(spec, host)
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
        nonlocal gather
        if gather is not None:
            try:
                return gather(message=message)
            except rendezvous.DriverUnreachable as exc:
                gather = None
                ctx.spec = without_driver(ctx.job, exc)
        return list(tc.allGather(message))

    ctx = WorkerContext(
        rank=rank,
        world_size=len(infos),
        host=host,
        all_gather=all_gather,
        barrier=tc.barrier,
        spec=spec,
        gpus=task_gpus(tc),
    )
    return ctx


def without_driver(spec: JobSpec, why: Exception) -> JobSpec:
    """The spec of a task that cannot reach the driver's services: it meets its peers
    through Spark's barrier ``allGather``, sends no live records (the history reaches
    the driver with the stage's results) and returns its state as task results. The
    parameter server lives in the driver, so ``ps`` cannot train this way."""
    if spec.ps_addresses or spec.ps_bootstrap:
        raise ConfigError(
            f"strategy='ps' needs every executor to reach the driver's parameter server, "
            f"but {why}. Set driver_services_host (and driver_services_ports, to open "
            "them in a firewall) to an address of the driver the executors can reach, or "
            "train with strategy='ring' or 'tree', which work without it"
        )
    log.warning(
        "%s: meeting the other tasks through Spark's barrier allGather; progress and "
        "callbacks get the history when the stage ends",
        why,
    )
    return dataclasses.replace(
        spec, metrics_address=None, rendezvous_address=None, state_address=None
    )


def cut_off_from_driver(spec: JobSpec, host: str) -> JobSpec:
    """Test-only (``FaultPlan.unreachable_driver``): every driver address becomes a port
    of this task's host on which nothing listens, so dialing it is refused."""
    listener = open_listener(host)
    dead = address_of(listener)
    listener.close()
    return dataclasses.replace(
        spec,
        metrics_address=dead if spec.metrics_address else None,
        rendezvous_address=dead if spec.rendezvous_address else None,
        state_address=dead if spec.state_address else None,
        ps_addresses=tuple(dead for _ in spec.ps_addresses),
        ps_bootstrap=dead if spec.ps_bootstrap else None,
    )


def task_gpus(tc: object) -> tuple[str, ...]:
    """The GPU addresses Spark assigned the task (none without GPU scheduling)."""
    resources = getattr(tc, "resources", None)
    gpu = resources().get("gpu") if callable(resources) else None
    return tuple(gpu.addresses) if gpu is not None else ()


def is_unsupported_chain(exc: BaseException) -> bool:
    """Spark's refusal of a barrier stage over RDDs with other partition counts."""
    text = str(exc)
    return "BarrierJobUnsupportedRDDChainException" in text or (
        "Barrier execution mode does not allow" in text
    )


def launch(
    prepared: PreparedData,
    spec: JobSpec,
    entry: TaskEntry,
    ship: Callable[[Any], Any] | None = None,
) -> list[Record]:
    """Run ``entry`` in every task of one barrier stage over the prepared data; Spark's
    errors come back as :class:`WorkerError` (a task's own sparktrain error keeps its
    type). ``ship`` (Spark Connect) turns a DataFrame stage's task function into what
    the plan carries: itself, or a stand-in that fetches it from the driver when it is
    too big for Connect's request cap
    (:class:`~sparktrain.driver.services.payload_server.ClosureShipper`)."""
    try:
        try:
            return _run(prepared, spec, entry, ship)
        except Exception as exc:
            if not is_unsupported_chain(exc):
                raise
        # Spark refuses barrier stages over a union or coalesce whose partition counts
        # differ (checked at submission, before any task runs): shuffle and retry.
        log.info(
            "the input's lineage cannot feed a barrier stage (union/coalesce); "
            "shuffling it into %d partitions",
            spec.config.num_workers,
        )
        return _run(prepared.shuffled(spec.config.num_workers), spec, entry, ship)
    except SparkTrainError:
        raise
    except Exception as exc:  # Py4J / PythonException wrapping a task's error
        raise WorkerError.from_spark(exc) from exc


def _run(
    prepared: PreparedData,
    spec: JobSpec,
    entry: TaskEntry,
    ship: Callable[[Any], Any] | None = None,
) -> list[Record]:
    """DataFrames go through ``mapInArrow(..., barrier=True)`` (works under Spark Connect
    too), RDDs through ``rdd.barrier().mapPartitions``; the task closures hold only the
    picklable spec and entry (or, as ``ship`` decides, a reference to them)."""
    if prepared.frame is not None:
        task: Any = functools.partial(_arrow_task, spec, entry)
        if ship is not None:
            task = ship(task)
        options = gpu.map_in_arrow_options(prepared, spec.config)  # the GPUs' profile
        table = prepared.frame.mapInArrow(task, OUTPUT_DDL, barrier=True, **options).toArrow()
        return [Record(**row) for row in table.to_pylist()]
    assert prepared.rdd is not None
    rdd_task = functools.partial(_rows_task, spec, entry)
    rdd = prepared.rdd
    profile = gpu.map_in_arrow_options(prepared, spec.config).get("profile")
    if profile is not None:
        rdd = rdd.withResources(profile)
    return [Record(*row) for row in rdd.barrier().mapPartitions(rdd_task).collect()]


def _arrow_task(
    spec: JobSpec, entry: TaskEntry, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    ctx = worker_context(spec)
    # the task's prints reach the driver; the user's exceptions become final
    with output.capture(spec, ctx.rank, functools.partial(_reaches_driver, ctx)):
        reset_peak_anon()
        data = from_arrow(batches, spec.data_layout, ctx.rank, spill_plan(spec, ctx.rank))
        try:
            records = entry(ctx, data)
        finally:
            data.close()  # the spill file goes with the task, on failure too
    yield pa.RecordBatch.from_pylist(
        [{"rank": r.rank, "kind": r.kind, "seq": r.seq, "data": r.data} for r in records],
        schema=OUTPUT_SCHEMA,
    )


def _reaches_driver(ctx: WorkerContext) -> bool:
    """False once the task met its peers without the driver (:func:`without_driver`)."""
    return ctx.spec is None or bool(ctx.spec.metrics_address)


def spill_plan(spec: JobSpec, rank: int) -> SpillPlan | None:
    """Where this task's rows spill past ``data_memory_mb``; first sweeps the spill files
    of killed workers. ``None`` for pipelines, which keep their rows in memory."""
    cfg = spec.config
    if cfg.parallelism_pipeline > 1:
        return None
    sweep_orphans()
    return SpillPlan(
        budget_bytes=int(cfg.data_memory_mb * (1 << 20)),
        path=spill_path(spec.job_id, rank, spec.attempt),
    )


def _rows_task(
    spec: JobSpec, entry: TaskEntry, rows: Iterable[tuple[object, ...]]
) -> Iterator[tuple[int, str, int, bytes]]:
    ctx = worker_context(spec)
    with output.capture(spec, ctx.rank, functools.partial(_reaches_driver, ctx)):
        records = entry(ctx, from_rows(rows, spec.feature_width, ctx.rank))
    for r in records:
        yield (r.rank, r.kind, r.seq, r.data)
