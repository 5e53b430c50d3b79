"""Driver side of pipeline (and hybrid data x pipeline) training.

``Trainer.fit`` calls :func:`run_pipeline` when ``parallelism.pipeline > 1``:

1. resolve the layout: P stages x D replicas = ``num_workers`` tasks;
2. split the driver's seeded model into P stages (:mod:`partition`: measured forward +
   backward time, else parameter count; every stage under ``max_param_mb``);
3. run one barrier stage whose tasks run :func:`~sparktrain.parallel.stage.train_stage`
   (the partition travels in a picklable :class:`PipelineSpec`, so every task agrees);
4. load each stage's state (returned by its replica-0 task, in chunks, under the whole
   model's key names) into the driver's model, and build the summary: the data-parallel
   keys plus the pipeline's own (bubble fraction, bytes between stages per step, ...).

Config keys read with defaults until TrainConfig declares them:
``parallelism.micro_batches`` (4), ``parallelism.schedule`` ("1f1b" | "gpipe"),
``parallelism.activation_dtype`` ("float32" | "float16" | "bfloat16"),
``parallelism.balance`` ("time" | "params") and ``max_param_mb`` (0 = no cap).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch
from torch import nn

from sparktrain.comm.security import WireSecurity
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError, SparkTrainError, WorkerError
from sparktrain.launch import barrier
from sparktrain.launch.prepare import PreparedData
from sparktrain.launch.rendezvous import RendezvousServer
from sparktrain.launch.resources import task_cpus
from sparktrain.metrics import MetricsServer, ProgressDisplay
from sparktrain.parallel.partition import Partition, partition
from sparktrain.parallel.schedule import SCHEDULES, ideal_bubble
from sparktrain.parallel.stage import WIRE_DTYPES, PipelineSpec, train_stage
from sparktrain.result import Record, TrainResult, load_state_records, stage_summary
from sparktrain.worker.context import JobSpec
from sparktrain.worker.data import from_arrow, from_rows

if TYPE_CHECKING:
    from pyspark import SparkContext

    from sparktrain.trainer import Trainer

log = logging.getLogger(__name__)


def pipeline_options(cfg: TrainConfig) -> dict[str, Any]:
    """The pipeline knobs, with their defaults while TrainConfig lacks the keys."""
    opts: dict[str, Any] = {
        "micro_batches": int(getattr(cfg, "parallelism_micro_batches", 4)),
        "schedule": str(getattr(cfg, "parallelism_schedule", "1f1b")).lower(),
        "activation_dtype": str(getattr(cfg, "parallelism_activation_dtype", "float32")),
        "balance": str(getattr(cfg, "parallelism_balance", "time")),
        "max_param_mb": float(getattr(cfg, "max_param_mb", 0.0) or 0.0),
    }
    if opts["micro_batches"] < 1:
        raise ConfigError(
            f"parallelism.micro_batches={opts['micro_batches']} must be >= 1 (e.g. 4)"
        )
    if opts["schedule"] not in SCHEDULES:
        raise ConfigError(
            f"parallelism.schedule={opts['schedule']!r} unknown: choose one of "
            f"{', '.join(SCHEDULES)}"
        )
    if opts["activation_dtype"] not in WIRE_DTYPES:
        raise ConfigError(
            f"parallelism.activation_dtype={opts['activation_dtype']!r} unknown: choose one "
            f"of {', '.join(WIRE_DTYPES)}"
        )
    return opts


def layout(cfg: TrainConfig) -> tuple[int, int]:
    """(P, D) with P x D == num_workers (D = 0 means num_workers / P)."""
    p = cfg.parallelism_pipeline
    d = cfg.parallelism_data or cfg.num_workers // p
    if d < 1 or p * d != cfg.num_workers:
        raise ConfigError(
            f"parallelism.pipeline={p} x parallelism.data={cfg.parallelism_data} does not "
            f"match num_workers={cfg.num_workers}: set num_workers = pipeline x data "
            f"(e.g. num_workers={p * max(d, 1)})"
        )
    return p, d


def param_mb(model: nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / (1 << 20)


def check_param_cap(model: nn.Module, cfg: TrainConfig) -> None:
    """Data parallel keeps the whole model on every worker: refuse it over the cap."""
    cap = float(getattr(cfg, "max_param_mb", 0.0) or 0.0)
    size = param_mb(model)
    if cap > 0 and size > cap and cfg.parallelism_pipeline <= 1:
        raise ConfigError(
            f"the model's parameters take {size:.2f} MiB, over max_param_mb={cap:g} per "
            "worker; data parallelism keeps the whole model on every worker: split it with "
            "parallelism.pipeline=P (each stage must fit the cap), or raise max_param_mb"
        )


def plan(
    model: nn.Module, cfg: TrainConfig, feature_width: int, stages: int | None = None
) -> Partition:
    """Split the driver's model into the configured number of stages."""
    opts = pipeline_options(cfg)
    cap = opts["max_param_mb"]
    return partition(
        model,
        stages or cfg.parallelism_pipeline,
        feature_width,
        balance=opts["balance"],
        max_param_bytes=int(cap * (1 << 20)) if cap > 0 else None,
    )


def make_spec(job: JobSpec, part: Partition, replicas: int) -> PipelineSpec:
    opts = pipeline_options(job.config)
    return PipelineSpec(
        job=job,
        partition=part,
        replicas=replicas,
        micro_batches=opts["micro_batches"],
        schedule=opts["schedule"],
        activation_dtype=opts["activation_dtype"],
    )


def run_pipeline(
    trainer: Trainer,
    sc: SparkContext,
    prepared: PreparedData,
    model: nn.Module,
    *,
    num_outputs: int,
    started: float,
) -> TrainResult:
    """Train ``model``'s stages across ``num_workers`` barrier tasks; see the module doc."""
    cfg = trainer.config
    stages, replicas = layout(cfg)
    if cfg.strategy not in ("ring", "tree"):
        raise ConfigError(
            f"strategy={cfg.strategy!r} does not combine with parallelism.pipeline > 1: the "
            "replicas of a stage average gradients with the ring; use strategy='ring'"
        )
    part = plan(model, cfg, prepared.feature_width)
    job = JobSpec(
        job_id=uuid.uuid4().hex[:12],
        attempt=0,
        secret=secrets.token_bytes(32),
        config=cfg,
        model_fn=trainer.model_fn,
        model_kwargs=trainer.model_kwargs,
        feature_width=prepared.feature_width,
        num_outputs=num_outputs,
        threads=cfg.threads_per_worker or task_cpus(sc),
        security=WireSecurity.for_job(cfg.encryption, cfg.frame_integrity),
    )
    spec = make_spec(job, part, replicas)
    log.info(
        "job %s: %d pipeline stages (layers %s, balanced by %s) x %d replicas, %s, "
        "%d micro-batches",
        job.job_id,
        stages,
        list(part.bounds),
        part.balance,
        replicas,
        spec.schedule,
        spec.micro_batches,
    )
    if cfg.checkpoint_dir:
        log.warning(
            "checkpoints are not written under pipeline parallelism yet; a failed stage "
            "is not resubmitted (checkpoint_dir=%s ignored)",
            cfg.checkpoint_dir,
        )
    host = sc.getConf().get("spark.driver.host", "127.0.0.1")
    display = ProgressDisplay(cfg.progress, cfg.metrics_jsonl)
    server = MetricsServer(
        host,
        secret=job.secret,
        job_id=job.job_id,
        attempt=0,
        on_message=display,
        security=job.security,
    )
    meeting = RendezvousServer(
        host,
        secret=job.secret,
        job_id=job.job_id,
        attempt=0,
        world_size=cfg.num_workers,
        security=job.security,
    )
    launched = time.perf_counter()
    try:
        spec = replace(
            spec,
            job=replace(job, metrics_address=server.address, rendezvous_address=meeting.address),
        )
        records = _launch(prepared, spec)
    finally:
        meeting.stop()
        server.stop()
        display.close()
    now = time.perf_counter()
    result = assemble(model, records, spec, wall_s=now - started, stage_s=now - launched)
    result.summary.update(restarts=0, steps_redone=0)
    return result


# --------------------------------------------------------------------------- launching


def _launch(prepared: PreparedData, spec: PipelineSpec) -> list[Record]:
    try:
        try:
            return _run(prepared, spec)
        except Exception as exc:
            if not barrier.is_unsupported_chain(exc):
                raise
        return _run(prepared.shuffled(spec.job.config.num_workers), spec)
    except SparkTrainError:
        raise
    except Exception as exc:  # Py4J / PythonException wrapping a task's error
        raise WorkerError.from_spark(exc) from exc


def _run(prepared: PreparedData, spec: PipelineSpec) -> list[Record]:
    job = spec.job
    if prepared.frame is not None:

        def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            ctx = barrier.worker_context(job)
            data = from_arrow(batches, job.feature_width, ctx.rank)
            records = train_stage(ctx, data, spec)
            yield pa.RecordBatch.from_pylist(
                [{"rank": r.rank, "kind": r.kind, "seq": r.seq, "data": r.data} for r in records],
                schema=barrier.OUTPUT_SCHEMA,
            )

        table = prepared.frame.mapInArrow(task, barrier.OUTPUT_DDL, barrier=True).toArrow()
        return [Record(**row) for row in table.to_pylist()]
    assert prepared.rdd is not None

    def rdd_task(rows: Iterable[tuple[object, ...]]) -> Iterator[tuple[int, str, int, bytes]]:
        ctx = barrier.worker_context(job)
        data = from_rows(rows, job.feature_width, ctx.rank)
        for r in train_stage(ctx, data, spec):
            yield (r.rank, r.kind, r.seq, r.data)

    return [Record(*row) for row in prepared.rdd.barrier().mapPartitions(rdd_task).collect()]


# --------------------------------------------------------------------------- assembling


def load_stage_states(model: nn.Module, records: list[Record], stages: int) -> dict[str, Any]:
    """Load every stage's returned state into ``model`` (unless the stages streamed it
    there through the state receiver); returns the last stage's meta."""
    metas = {r.rank: json.loads(r.data) for r in records if r.kind == "meta"}
    if sorted(m["stage"] for m in metas.values()) != list(range(stages)):
        raise WorkerError(
            f"the pipeline returned the states of stages "
            f"{sorted(m['stage'] for m in metas.values())} of {stages}; this is a bug, "
            "please report it"
        )
    state: dict[str, torch.Tensor] = {}
    last_meta: dict[str, Any] = {}
    streamed = {bool(m.get("streamed")) for m in metas.values()}
    if len(streamed) != 1:
        raise WorkerError(
            "some pipeline stages streamed their state, others returned it as task "
            "results; this is a bug, please report it"
        )
    for rank, meta in metas.items():
        if not meta.get("streamed"):  # else the state receiver already wrote it into model
            state.update(load_state_records(records, rank, meta))
        if meta["stage"] == stages - 1:
            last_meta = meta
    if streamed == {False}:
        model.load_state_dict(state)  # strict: every key of the whole model, from some stage
    return last_meta


def assemble(
    model: nn.Module,
    records: list[Record],
    spec: PipelineSpec,
    wall_s: float,
    stage_s: float,
) -> TrainResult:
    """The trained model and the summary (data-parallel keys plus pipeline figures)."""
    cfg = spec.job.config
    P, D = spec.stages, spec.replicas
    stats = sorted(
        (json.loads(r.data) for r in records if r.kind == "stats"), key=lambda s: s["rank"]
    )
    if len(stats) != P * D:
        raise WorkerError(
            f"the pipeline returned {len(stats)} of {P * D} worker reports; this is a bug, "
            "please report it"
        )
    meta = load_stage_states(model, records, P)
    steps = max(1, max(s["steps"] for s in stats))
    stage_bytes = sum(s["stage_bytes_sent"] for s in stats)
    step_time = max(s["step_s_total"] for s in stats)
    busy = [s["busy_s"] for s in stats]
    bubble = 1.0 - sum(busy) / (len(busy) * step_time) if step_time > 0 else 0.0
    digests: dict[int, set[str]] = {}
    for s in stats:
        digests.setdefault(s["stage"], set()).add(s["param_digest"])
    summary = stage_summary(
        cfg,
        model,
        stats,
        meta,
        world_size=P * D,
        wall_s=wall_s,
        stage_s=stage_s,
        replicas_in_sync=all(len(d) == 1 for d in digests.values()),
    )
    summary |= {
        # pipeline figures
        "pipeline_stages": P,
        "data_replicas": D,
        "schedule": spec.schedule,
        "micro_batches": spec.micro_batches,
        "activation_dtype": spec.activation_dtype,
        "stage_bounds": list(spec.partition.bounds),
        "balanced_by": spec.partition.balance,
        "stage_param_mb": [b / (1 << 20) for b in spec.partition.param_bytes],
        "bubble_fraction": max(0.0, bubble),
        "bubble_fraction_ideal": ideal_bubble(P, spec.micro_batches),
        "stage_bytes_per_step": stage_bytes / steps,
        "peak_in_flight_micro_batches": max(s["peak_in_flight"] for s in stats),
        "peak_activation_bytes": max(s["peak_activation_bytes"] for s in stats),
    }
    return TrainResult(model=model, history=summary["history"], summary=summary)
