"""The built-in training loop: a ``train_fn`` over :class:`RunContext`, as a user's
is under :func:`sparktrain.run`. ``Trainer.fit`` with ring, tree or ps runs it in every
task of the barrier stage (:func:`~sparktrain.task.run_task.run_partition`), so both
ways in share the rendezvous, the batches, the distributed step, reports, early
stopping and checkpoints.

What it adds to a user's loop: the model from the job's ``model_fn`` (the same seed on
every rank), ``strategy``/``compression = "auto"`` chosen by timing one real batch, the
config's loss and optimizer, the epoch's figures (loss and the run's metric over every
rank's rows, exact, plus ``metrics``), keep-best models, and its own checkpoint layout
(the model and optimizer state at the top, as saved models and resumes expect).

A rank with fewer rows than the largest idles in the epoch's last steps (it joins each
exchange with no rows), so each row counts once per epoch, as in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain import errors
from sparktrain.builders import (
    build_loss,
    build_model,
    build_optimizer,
    label_dtype,
    resolve_model_fn,
)
from sparktrain.checkpoint import PIPELINE_LAYOUT, RANK_SHARDS, Checkpoint, CheckpointStore
from sparktrain.data.batch import forward
from sparktrain.data.partition_data import PartitionData
from sparktrain.errors import CheckpointError
from sparktrain.task.divergence import check_finite_weights, check_loss_growth
from sparktrain.task.early_stop import EarlyStopping
from sparktrain.task.evaluate import (
    evaluate,
    feed_scores,
    finish_metric,
    finish_scores,
    metric_name,
    target_like,
)
from sparktrain.task.meet import SEEDED_INIT
from sparktrain.task.memory import sample_anon
from sparktrain.task.probe import needs_auto, resolve_auto
from sparktrain.task.run_context import RunContext
from sparktrain.task.scores import Scores, metric_key
from sparktrain.task.sharded import SHARDED_WORLD, check_sharded_resume
from sparktrain.task.state_sender import digest
from sparktrain.task.stepping import DistributedStep

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainedModel:
    """What the built-in loop returns on every rank: the model's state (rank 0's goes
    to the driver as the fit's model), what the fit's result needs besides the
    history, and this rank's figures for the summary."""

    state: dict[str, torch.Tensor]
    meta: dict[str, Any]
    stats: dict[str, Any]


def builtin_loop(ctx: RunContext) -> TrainedModel:
    """The loop of ``Trainer.fit`` (see the module docstring)."""
    spec, cfg = ctx.task.job, ctx.config
    started = time.perf_counter()
    has_validation = sum(ctx.val_rows_per_rank) > 0
    train = ctx.train_partition
    evaluation = ctx.val_partition if has_validation else train
    metric = metric_name(cfg.loss, has_validation)
    _check_watched(cfg, metric)  # every rank alike, before anything needs closing
    with SEEDED_INIT:  # same seed on every rank: identical initial weights
        torch.manual_seed(cfg.seed)
        model = build_model(resolve_model_fn(spec.model_fn, spec.model_kwargs))
    model.to(ctx.device)  # before the optimizer: its state follows the parameters
    params = [p for p in model.parameters() if p.requires_grad]
    loss_fn = build_loss(cfg.loss, dict(cfg.loss_kwargs))
    targets_dtype = label_dtype(cfg.loss)
    # strategy/compression "auto": probe the links (timing one real batch); the step is
    # then built from the choice
    auto = None
    if needs_auto(cfg.strategy, cfg.compression):
        sample = train.batch(np.arange(min(cfg.batch_size, train.size)), ctx.collator, ctx.rank)
        sample = sample.to(ctx.device)
        assert sample.labels is not None
        labels = sample.labels.to(targets_dtype)
        ctx.task, auto = resolve_auto(ctx.task, ctx.mesh, model, loss_fn, sample, labels)
        spec, cfg = ctx.task.job, ctx.config
    # with a parameter server the optimizer steps in the driver: this one, never
    # stepped, carries the schedule's rate that every push hands the server
    optimizer = build_optimizer(cfg.optimizer, params, cfg.lr, dict(cfg.optimizer_kwargs))
    ctx.distributed(model, optimizer)
    stepper = ctx.distributed_step
    assert stepper is not None
    early = ctx.early_stopping
    best_state: dict[str, torch.Tensor] | None = None
    steps_per_epoch = ctx.steps_per_epoch

    # With a parameter server the model lives in the driver and survives a stage restart;
    # the workers' copies are not authoritative (async), so they neither save nor restore.
    store = ctx.store if stepper.local else None
    if spec.resume_step is not None and not stepper.local:
        # the parameter server kept the model through the failure: continue at its step
        ctx.global_step, ctx.history = spec.resume_step, list(spec.resume_history)
    elif store is not None and spec.resume_step is not None:
        ckpt = store.load(spec.resume_step)
        if ckpt is None:
            raise CheckpointError(
                f"checkpoint of step {spec.resume_step} vanished from {store.uri}"
            )
        _restore(store, ctx, ckpt, model, stepper, early)
        ctx.global_step, ctx.history = ckpt.step, list(ckpt.history)
    # checkpoint_every is in epochs; fractions of an epoch are rounded to whole steps
    every = max(1, round(cfg.checkpoint_every * steps_per_epoch))
    for epoch in range(ctx.global_step // steps_per_epoch, cfg.epochs):
        model.train()
        loss_sum = 0.0
        loss_rows = 0
        # after a mid-epoch resume, the epoch's first steps are already done
        first = ctx.global_step - epoch * steps_per_epoch
        batches = ctx.batches(epoch, start=first, uneven="idle")
        with contextlib.closing(batches):
            for step, batch in enumerate(batches, start=first):
                if batch is not None:
                    assert batch.labels is not None
                    with ctx.autocast():
                        out = forward(model, batch)
                        target = target_like(batch.labels.to(targets_dtype), out)
                        # the loss in float32 at least: a half-precision loss loses digits
                        if out.dtype in (torch.float16, torch.bfloat16):
                            out = out.float()
                        loss = loss_fn(out, target, batch.weights)
                    value = ctx.backward(loss)
                    if math.isfinite(value):
                        loss_sum += value * len(batch)
                        loss_rows += len(batch)
                optimizer.step()
                # a checkpoint at an epoch's end waits for the epoch's figures (below);
                # none inside an accumulated step, whose gradients it would not hold
                if (
                    store
                    and ctx.global_step % every == 0
                    and step + 1 < steps_per_epoch
                    and stepper.micro == 0
                ):
                    _save(store, ctx, model, stepper)
                ctx.progress(loss=loss_sum / max(1, loss_rows))
        sample_anon()
        figures = evaluate(model, evaluation, cfg.loss, ctx.collator, ctx.rank)
        sums = np.array([loss_sum, loss_rows, *figures])
        ctx.tree.allreduce_(sums)
        value = finish_metric(sums[2], sums[3], cfg.loss, spec.label_scale)
        record: dict[str, Any] = {
            "type": "epoch",
            "epoch": epoch,
            "loss": float(sums[0] / max(sums[1], 1)),
            "metric_name": metric,
            "metric": value,
            metric: value,  # by name too, for early stopping and schedules
            "seconds": time.perf_counter() - ctx.epoch_started,
        }
        if cfg.metrics:
            record.update(_extra_metrics(model, evaluation, ctx, _prefix(metric)))
        record["lr"] = stepper.lr
        # replicas hold the same weights, and every rank the same reduced loss and
        # history, so every rank decides alike
        check_finite_weights(params, epoch, cfg.lr)
        check_loss_growth(ctx.history, record["loss"], epoch, cfg)
        stop = ctx.conclude(record)
        if ctx.rank == 0 and early.active and ctx.improved and early.restore_best:
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if store is not None and (ctx.global_step % every == 0 or stop):
            _save(store, ctx, model, stepper)
        elif store is not None and ctx.rank == 0 and early.active and ctx.improved:
            _save(store, ctx, model, stepper, best_only=True)
        ctx.send(record)
        if stop:
            break

    cached = {id(p) for p in getattr(stepper.sync, "cached_params", ())}
    stats: dict[str, Any] = {
        "train_s": time.perf_counter() - started,
        # a parameter server's sparse tables are per-rank caches of pulled rows
        "param_digest": digest(p for p in params if id(p) not in cached),
        **({"auto": auto} if auto is not None else {}),
    }
    if ctx.rank != 0:
        return TrainedModel({}, {}, stats)
    meta: dict[str, Any] = {"metric_name": metric}
    if early.active:
        meta["early_stopping"] = early.summary(restored=best_state is not None)
    if best_state is not None:  # early_stopping.restore_best: the best epoch's model
        model.load_state_dict(best_state)
    # the driver's model is a CPU one whatever the device
    return TrainedModel({k: v.cpu() for k, v in model.state_dict().items()}, meta, stats)


def _save(
    store: CheckpointStore,
    ctx: RunContext,
    model: nn.Module,
    stepper: DistributedStep,
    *,
    best_only: bool = False,
) -> None:
    """Every rank with state of its own (compression) writes its shard; rank 0 then
    writes the main file, the commit: the checkpoint counts once all shards are there.
    Rank 0 keeps early stopping's best epoch as the best checkpoint too (``best_only``:
    that alone, between regular checkpoints)."""
    step, early = ctx.global_step, ctx.early_stopping
    mine = None if best_only else stepper.rank_state()
    if mine is not None:
        store.save_shard(step, ctx.rank, ctx.world_size, mine)
    if ctx.rank != 0:
        return
    optimizer = stepper.optimizer if stepper.local else None
    extra: dict[str, Any] = {
        "step_state": stepper.state_dict(),
        "early_stopping": early.state_dict(),
    }
    if mine is not None:
        extra[RANK_SHARDS] = ctx.world_size
    if ctx.config.shard_optimizer:
        extra[SHARDED_WORLD] = ctx.world_size
    ckpt = Checkpoint(
        step=step,
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict() if optimizer is not None else {},
        rng_state=torch.get_rng_state(),
        history=list(ctx.history),
        extra=extra,
    )
    if not best_only:
        store.save(ckpt)
    if early.active and ctx.improved:  # keep-best: survives the pruning of newer ones
        store.save_best(ckpt)


def _restore(
    store: CheckpointStore,
    ctx: RunContext,
    ckpt: Checkpoint,
    model: nn.Module,
    stepper: DistributedStep,
    early: EarlyStopping,
) -> None:
    if PIPELINE_LAYOUT in ckpt.extra:
        raise CheckpointError(
            f"the checkpoint of step {ckpt.step} in {store.uri} was written by a pipeline "
            f"run ({ckpt.extra[PIPELINE_LAYOUT]['stages']} stages): resume it with the same "
            "parallelism.pipeline"
        )
    if "run_state" in ckpt.extra:
        raise CheckpointError(
            f"the checkpoint of step {ckpt.step} in {store.uri} was written by "
            "sparktrain.run, not Trainer.fit: give the fit a checkpoint_dir of its own"
        )
    check_sharded_resume(ckpt.extra, ctx.config.shard_optimizer, ctx.world_size, ckpt.step)
    model.load_state_dict(ckpt.model_state)
    optimizer = stepper.optimizer if stepper.local else None
    if optimizer is not None and ckpt.optimizer_state:
        optimizer.load_state_dict(ckpt.optimizer_state)
    torch.set_rng_state(ckpt.rng_state)
    early.load_state_dict(ckpt.extra.get("early_stopping", {}))
    shards = int(ckpt.extra.get(RANK_SHARDS, 0) or 0)
    shard = None
    if shards == ctx.world_size:
        shard = store.load_shard(ckpt.step, ctx.rank, shards)
    elif stepper.rank_state() is not None:
        log.warning(
            "rank %d: the checkpoint of step %d holds compressor state for %d ranks, this "
            "run has %d: error-feedback residuals and similar state start from zero",
            ctx.rank,
            ckpt.step,
            shards,
            ctx.world_size,
        )
    stepper.load_state_dict(ckpt.extra.get("step_state") or {}, shard)


def _check_watched(cfg: Any, metric: str) -> None:
    """Early stopping and ``ReduceLROnPlateau`` watch a figure every epoch record holds
    (see the record in :func:`builtin_loop`); else every rank raises the same error now, not
    after the first epoch (early stopping: rank 0 alone, its peers then lose it). The
    usual slip: ``accuracy`` (or ``rmse``) without validation data, where the loop
    reports ``train_accuracy``."""
    watched = []
    if cfg.early_stopping:
        watched.append(("early_stopping.metric", cfg.early_stopping.get("metric")))
    if cfg.lr_schedule == "ReduceLROnPlateau":
        monitor = cfg.lr_schedule_kwargs.get("monitor", "loss")
        watched.append(("lr_schedule_kwargs.monitor", monitor))
    prefix = _prefix(metric)
    extra = [prefix + metric_key(m) for m in cfg.metrics]
    keys = ["loss", metric, "metric", "seconds", "lr", *extra]
    for key, name in watched:
        if name in keys:
            continue
        hint = ""
        if prefix and prefix + name in keys:
            hint = (
                f" Without validation data the loop reports {prefix + name!r} on the training "
                "rows: give validation data (Trainer.fit's validation_data, "
                "validation_fraction > 0; the ml estimators' validationFraction) or watch "
                f"{prefix + name!r}."
            )
        raise errors.ConfigError(
            f"{key}={name!r} is not a figure this run reports every epoch; it reports: "
            f"{', '.join(dict.fromkeys(keys))}.{hint}"
        )


def _extra_metrics(
    model: nn.Module, data: PartitionData, ctx: RunContext, prefix: str
) -> dict[str, float]:
    """The config's ``metrics`` over every rank's ``data`` (validation rows, or the
    training rows without them), exact; named like the run's metric (``train_`` in
    front when measured on the training rows)."""
    spec = ctx.task.job
    scores = Scores(spec.config.metrics, num_outputs=spec.num_outputs, label_scale=spec.label_scale)
    feed_scores(model, data, scores, ctx.collator, ctx.rank)
    return {prefix + k: v for k, v in finish_scores(scores, ctx.tree).items()}


def _prefix(metric: str) -> str:
    """``train_`` when the run measures its metrics on the training rows, else ``""``."""
    return "train_" if metric.startswith("train_") else ""
