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
are the built-in trainer's own (:mod:`sparktrain.driver.stage_runner`); what each task sees is
:class:`~sparktrain.task.run_context.RunContext`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from sparktrain.config import TrainConfig
from sparktrain.data.columns import ColumnsSpec
from sparktrain.driver.job import open_job
from sparktrain.driver.prepare import PreparedData
from sparktrain.driver.stage_runner import FitJob, train_in_stage
from sparktrain.errors import ConfigError, WorkerError
from sparktrain.result import (
    Record,
    TrainResult,
    load_state_records,
    stats_summary,
)
from sparktrain.task.faults import FaultPlan
from sparktrain.task.run_task import decode_value, run_partition

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from sparktrain.task.run_context import RunContext


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
    (:mod:`sparktrain.driver.pickling`); ``ctx`` is a
    :class:`~sparktrain.task.run_context.RunContext`. ``data`` (a DataFrame, or under a
    classic session an RDD of ``(features, label)`` pairs; optional) is split over the
    tasks and read with
    ``ctx.batches(epoch)``; ``columns``, ``label_col``, ``validation_data`` and
    ``weight_col`` mean what they mean for :meth:`sparktrain.Trainer.fit`. ``config``
    supplies the strategy (``ring``, ``tree``, ``ps`` or a plug-in with ``supports_run``),
    compression, batch size, epochs, seed, schedule, precision, accumulation, clipping,
    early stopping, checkpoints and restarts; ``num_workers`` overrides its
    ``num_workers``. ``callbacks`` get every
    report on the driver (``on_epoch_end(record, history)`` or a plain function).
    A lost task or executor resubmits the stage (``max_restarts``); ``ctx.restore()``
    then gives the newest checkpoint's state. An exception ``train_fn`` itself raises
    is final: :class:`~sparktrain.errors.UserCodeError` (also the built-in type it
    was, e.g. ``ValueError``), with the rank's traceback. What ``train_fn`` prints
    reaches this process's ``sys.stdout``/``sys.stderr`` as ``[rank r] ...`` lines
    (``stream_output``). ``fault_plan`` is for tests (failure injection).
    """
    started = time.perf_counter()
    cfg = config or TrainConfig()
    if num_workers is not None:
        cfg = cfg.replace(num_workers=num_workers)
    if data is None and (validation_data is not None or weight_col is not None):
        raise ConfigError("validation_data and weight_col need data: pass data= as well")
    opened = open_job(
        cfg,
        data,
        validation_data,
        way="run",
        spark=spark,
        columns=None if data is None else columns,
        label_col=label_col,
    )
    cfg = opened.config
    if data is None:
        prepared = _no_data(opened.session, cfg.num_workers)
    else:
        prepared = opened.prepare(data, validation_data, columns, label_col, weight_col)
    received: dict[str, Any] = {}
    job = FitJob(
        spark=opened.env,
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
    spec = dataclasses.replace(job.job_spec(opened.strategy), train_fn=train_fn)
    value: list[Any] = []

    def finish(records: list[Record], stage_s: float) -> TrainResult:
        result, returned = _assemble(records, cfg, job, stage_s)
        value.append(returned)
        return result

    result = train_in_stage(
        job, opened.strategy, entry=run_partition, assemble_result=finish, spec=spec
    )
    return RunResult(value=value[0], history=result.history, summary=result.summary)


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
    summary: dict[str, Any] = {
        **stats_summary(
            cfg,
            stats,
            world_size=cfg.num_workers,
            wall_s=time.perf_counter() - job.started,
            stage_s=stage_s,
        ),
        # the epochs the function reported (ctx.report(epoch=...)), as a fit's summary counts
        "epochs_run": len(meta["history"]),
        "history": meta["history"],
    }
    if meta.get("early_stopping"):
        summary["early_stopping"] = meta["early_stopping"]
    if job.prepared.label_stats is not None:  # the train_fn saw standardised labels
        mean, std = job.prepared.label_stats
        summary["label_scaling"] = {"mean": mean, "std": std}
    return TrainResult(model=job.model, history=meta["history"], summary=summary), value
