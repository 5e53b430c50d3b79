"""``sparktrain.run``: your own training loop in every task of one barrier stage.

>>> import sparktrain
>>> def train_fn(ctx):  # doctest: +SKIP
...     model, opt = ctx.distributed(MyModel(), torch.optim.Adam(...))
...     for epoch in range(ctx.config.epochs):
...         for batch in ctx.batches(epoch):
...             loss = loss_fn(model(batch.inputs[0]), batch.labels)
...             ctx.backward(loss)
...             opt.step()
...             opt.zero_grad()
...         ctx.report(loss=float(loss))
...     return model.state_dict()
>>> result = sparktrain.run(train_fn, df, num_workers=2)  # doctest: +SKIP
>>> model.load_state_dict(result.value)  # doctest: +SKIP

The stage runner, the checkpoint store, the progress channel, the callbacks and loggers
are the built-in trainer's own (:mod:`sparktrain.launch.stage`); what each task sees is
:class:`~sparktrain.worker.run_context.RunContext`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from sparktrain import strategies
from sparktrain.config import TrainConfig
from sparktrain.data.columns import ColumnsSpec, parse_columns, parse_labels
from sparktrain.errors import ConfigError, WorkerError
from sparktrain.launch.prepare import ColumnOptions, PreparedData, prepare
from sparktrain.launch.resources import check_can_launch, check_transport_security
from sparktrain.launch.spark_env import check_data_kind, session_of, spark_env
from sparktrain.launch.stage import FitJob, train_in_stage
from sparktrain.result import (
    Record,
    TrainResult,
    data_summary,
    load_state_records,
    sparse_summary,
)
from sparktrain.strategies import registry
from sparktrain.worker.faults import FaultPlan
from sparktrain.worker.run_task import decode_value, run_partition

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sparktrain.worker.run_context import RunContext


@dataclass
class RunResult:
    """What :func:`run` returns: rank 0's return value (tensors, state dicts, numbers,
    strings, lists and dicts; tuples come back as lists), the reports' history and the
    run's summary."""

    value: Any
    history: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)


class _Received(nn.Module):
    """Stands in for the driver's model: the state receiver takes rank 0's tensors as
    they come (their layout is the train_fn's business)."""


def run(
    train_fn: Callable[[RunContext], Any] | str,
    data: Any = None,
    *,
    columns: ColumnsSpec = "features",
    label_col: str | Sequence[str] = "label",
    validation_data: Any = None,
    weight_col: str | None = None,
    num_workers: int | None = None,
    config: TrainConfig | None = None,
    callbacks: Sequence[Any] = (),
    spark: SparkSession | None = None,
    fault_plan: FaultPlan | None = None,
) -> RunResult:
    """Run ``train_fn(ctx)`` in each of ``num_workers`` tasks of one barrier stage and
    return rank 0's return value (in :class:`RunResult`).

    ``train_fn`` is a callable or ``"package.module:function"``: a function of your script
    or notebook travels by value with the globals it names
    (:mod:`sparktrain.launch.pickling`); ``ctx`` is a
    :class:`~sparktrain.worker.run_context.RunContext`. ``data`` (a DataFrame, or under a
    classic session an RDD of ``(features, label)`` pairs; optional) is split over the
    tasks and read with
    ``ctx.batches(epoch)``; ``columns``, ``label_col``, ``validation_data`` and
    ``weight_col`` mean what they mean for :meth:`sparktrain.Trainer.fit`. ``config``
    supplies the strategy (``ring``, ``tree`` or ``ps``), compression, batch size, epochs, seed,
    schedule, precision, accumulation, clipping, early stopping, checkpoints and
    restarts; ``num_workers`` overrides its ``num_workers``. ``callbacks`` get every
    report on the driver (``on_epoch_end(record, history)`` or a plain function).
    A failed task resubmits the stage (``max_restarts``); ``ctx.restore()`` then gives
    the newest checkpoint's state. ``fault_plan`` is for tests (failure injection).
    """
    started = time.perf_counter()
    cfg = config or TrainConfig()
    if num_workers is not None:
        cfg = cfg.replace(num_workers=num_workers)
    _check_run_config(cfg)
    if data is not None:
        parse_columns(columns)
        parse_labels(label_col)
    elif validation_data is not None or weight_col is not None:
        raise ConfigError("validation_data and weight_col need data: pass data= as well")
    session = spark or session_of(data)
    if session is None:
        from sparktrain.session import get_or_create_session

        session = get_or_create_session()
    env = spark_env(session)
    check_data_kind(env, data, validation_data)
    cfg = check_transport_security(env, cfg)
    strategy = strategies.get(cfg.strategy)
    check_can_launch(env, cfg.num_workers)
    if data is None:
        prepared = _no_data(session, cfg.num_workers)
    else:
        prepared = prepare(
            data,
            validation_data,
            columns,
            label_col,
            cfg.num_workers,
            weight_col,
            ColumnOptions.of(cfg),
            cfg.label_scaling,
        )
    received: dict[str, Any] = {}
    job = FitJob(
        spark=env,
        prepared=prepared,
        model=_Received(),
        model_fn=None,
        model_kwargs={},
        config=cfg,
        num_outputs=0,
        started=started,
        fault=fault_plan,
        callbacks=tuple(callbacks),
        received=received,
    )
    spec = dataclasses.replace(job.job_spec(strategy), train_fn=train_fn)
    value: list[Any] = []

    def finish(records: list[Record], stage_s: float) -> TrainResult:
        result, returned = _assemble(records, cfg, job, stage_s)
        value.append(returned)
        return result

    result = train_in_stage(job, strategy, entry=run_partition, assemble_result=finish, spec=spec)
    return RunResult(value=value[0], history=result.history, summary=result.summary)


def _check_run_config(cfg: TrainConfig) -> None:
    if not registry.get(cfg.strategy).supports_run:
        can = registry.having("supports_run")
        others = [n for n in registry.names() if n not in can]
        raise ConfigError(
            f"sparktrain.run trains with strategy={registry.spelled(can)}, not "
            f"{cfg.strategy!r}: {registry.spelled(others)} stay with Trainer.fit"
        )
    if cfg.parallelism_pipeline > 1:
        raise ConfigError(
            "sparktrain.run is data parallel: pipeline parallelism stays with Trainer.fit "
            "(set parallelism.pipeline = 1)"
        )
    if cfg.compression == "auto":
        raise ConfigError(
            "compression='auto' probes a model the driver knows; with sparktrain.run name a "
            "spec (e.g. 'int8+ef') or 'none'"
        )


def _no_data(session: SparkSession, workers: int) -> PreparedData:
    """``workers`` empty partitions in the prepared layout: one task each, no rows.

    A range whose rows a filter drops, not an empty DataFrame: Spark's optimizer turns a
    repartitioned empty local relation (what ``createDataFrame([])`` is under Spark
    Connect) into no partitions at all, and the stage would have no tasks."""
    from pyspark.sql import functions as F

    frame = (
        session.range(0, workers, numPartitions=workers)
        .where(F.col("id") < 0)
        .select(
            F.lit(None).cast("array<float>").alias("features"),
            F.lit(0.0).cast("double").alias("label"),
            F.lit(False).alias("is_validation"),
        )
    )
    return PreparedData(frame=frame, rdd=None, feature_width=0)


def _assemble(
    records: list[Record], cfg: TrainConfig, job: FitJob, stage_s: float
) -> tuple[TrainResult, Any]:
    """The RunResult from the task records (rank 0's meta and tensors, every rank's
    stats), built as the stage runner's assemble step."""
    stats = sorted(
        (json.loads(r.data) for r in records if r.kind == "stats"), key=lambda s: s["rank"]
    )
    metas = [json.loads(r.data) for r in records if r.kind == "meta"]
    if len(metas) != 1 or len(stats) != cfg.num_workers:
        raise WorkerError(
            f"the run's stage returned {len(stats)} of {cfg.num_workers} worker reports and "
            f"{len(metas)} results; this is a bug, please report it"
        )
    meta = metas[0]
    streamed = bool(meta.get("streamed"))
    tensors = (job.received or {}) if streamed else load_state_records(records, 0, meta)
    value = decode_value(meta["value"], tensors)
    comm = [s["comm"] for s in stats]
    bytes_sent = sum(c["raw_bytes_sent"] for c in comm)
    wire_bytes = sum(c["wire_bytes_sent"] for c in comm)
    summary: dict[str, Any] = {
        "strategy": cfg.strategy,
        "compression": cfg.compression,
        "world_size": cfg.num_workers,
        # the epochs the function reported (ctx.report(epoch=...)), as a fit's summary counts
        "epochs_run": len(meta["history"]),
        "train_rows_per_worker": [s["train_rows"] for s in stats],
        "steps_per_epoch": stats[0]["steps_per_epoch"],
        "wall_s": time.perf_counter() - job.started,
        "stage_s": stage_s,
        "comm_s": max(s["comm_s"] for s in stats),
        "bytes_sent": bytes_sent,
        "wire_bytes": wire_bytes,
        "compression_ratio": bytes_sent / wire_bytes if wire_bytes else 1.0,
        "peak_rss_bytes_per_worker": [s.get("peak_rss_bytes", 0) for s in stats],
        **data_summary(stats),
        "history": meta["history"],
        "config": cfg.to_dict(),
    }
    for key in ("precision", "skipped_steps", "overlap", "compression_path"):
        if key in stats[0]:
            summary[key] = stats[0][key]
    summary.update(sparse_summary(stats))
    if meta.get("early_stopping"):
        summary["early_stopping"] = meta["early_stopping"]
    if job.prepared.label_stats is not None:  # the train_fn saw standardised labels
        mean, std = job.prepared.label_stats
        summary["label_scaling"] = {"mean": mean, "std": std}
    return TrainResult(model=job.model, history=meta["history"], summary=summary), value
