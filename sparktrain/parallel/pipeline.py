"""Driver side of pipeline (and hybrid data x pipeline) training.

``Trainer.fit`` calls :func:`run_pipeline` when ``parallelism.pipeline > 1``:

1. resolve the layout: P stages x D replicas = ``num_workers`` tasks;
2. split the driver's seeded model into P stages (:mod:`partition`: measured forward +
   backward time, else parameter count; every stage under ``max_param_mb``);
3. run one barrier stage through the stage runner (:mod:`sparktrain.driver.stage_runner`:
   restarts, resume from the stages' checkpoints, job group, slot watchdog) whose tasks
   run :func:`~sparktrain.parallel.stage.train_stage` (the partition travels in a
   picklable :class:`PipelineSpec`, so every task agrees; a resumed run keeps its
   checkpoint's split);
4. each stage's replica 0 streams its part of the state, under the whole model's key
   names, into the driver's model; the summary has the data-parallel keys plus the
   pipeline's own (bubble fraction, bytes between stages per step, ...).

The knobs: ``parallelism.micro_batches``, ``parallelism.schedule`` ("1f1b" | "gpipe"),
``parallelism.activation_dtype``, ``parallelism.balance`` ("time" | "params") and
``max_param_mb`` (0 = no cap); see docs/configuration.md.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sparktrain.checkpoint import PIPELINE_LAYOUT, CheckpointStore
from sparktrain.config import TrainConfig
from sparktrain.driver.stage_runner import FitJob, train_in_stage
from sparktrain.errors import ConfigError, WorkerError
from sparktrain.parallel.partition import Partition, partition
from sparktrain.parallel.schedule import SCHEDULES, ideal_bubble
from sparktrain.parallel.stage import WIRE_DTYPES, PipelineSpec, stage_entry, state_senders
from sparktrain.result import Record, TrainResult, load_state_records, stage_summary
from sparktrain.task.context import JobSpec

if TYPE_CHECKING:
    from sparktrain.strategies.base import Strategy

log = logging.getLogger(__name__)


def pipeline_options(cfg: TrainConfig) -> dict[str, Any]:
    """The pipeline knobs, checked (a config built around validation still fails here)."""
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
    model: nn.Module,
    cfg: TrainConfig,
    feature_width: int,
    stages: int | None = None,
    bounds: Sequence[int] | None = None,
) -> Partition:
    """Split the driver's model into the configured number of stages (at ``bounds``
    when given, e.g. a resumed checkpoint's split)."""
    opts = pipeline_options(cfg)
    cap = opts["max_param_mb"]
    return partition(
        model,
        stages or cfg.parallelism_pipeline,
        feature_width,
        balance=opts["balance"],
        max_param_bytes=int(cap * (1 << 20)) if cap > 0 else None,
        bounds=bounds,
    )


def resumed_bounds(cfg: TrainConfig) -> list[int] | None:
    """The layer split of the checkpoint a resumed run continues from: a time-balanced
    split is measured anew each run and may differ, and every stage must restore the
    layers it saved."""
    if not (cfg.resume and cfg.checkpoint_dir):
        return None
    store = CheckpointStore(cfg.checkpoint_dir, cfg.keep_checkpoints)
    step = store.newest_intact()
    ckpt = store.load(step) if step is not None else None
    layout = ckpt.extra.get(PIPELINE_LAYOUT) if ckpt is not None else None
    return list(layout["bounds"]) if layout else None


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


def run_pipeline(job: FitJob, strategy: Strategy) -> TrainResult:
    """Train ``job.model``'s stages across ``num_workers`` barrier tasks through the stage
    runner (restarts, resume, job group and slot watchdog as for data parallel); see the
    module doc."""
    cfg = job.config
    stages, replicas = layout(cfg)
    part = plan(job.model, cfg, job.prepared.feature_width, bounds=resumed_bounds(cfg))
    template = make_spec(job.job_spec(strategy), part, replicas)

    def finish(records: list[Record], stage_s: float) -> TrainResult:
        wall_s = time.perf_counter() - job.started
        return assemble(job.model, records, template, wall_s=wall_s, stage_s=stage_s)

    describe = (
        f": {stages} pipeline stages (layers {list(part.bounds)}, balanced by {part.balance}) "
        f"x {replicas} replicas, {template.schedule}, {template.micro_batches} micro-batches"
    )
    return train_in_stage(
        job,
        strategy,
        spec=template.job,
        entry=functools.partial(stage_entry, template),
        assemble_result=finish,
        senders=state_senders(template, job.model),
        describe=describe,
    )


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
