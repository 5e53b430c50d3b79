"""The training loop every barrier task runs.

Order of events on each rank:

1. convert the partition (already done by the caller) and split off validation rows;
2. one ``all_gather`` of (listener address, row counts, error): every rank learns the
   peers, the common number of steps per epoch, and whether any rank found bad data —
   in which case *all* ranks raise before any socket is used, so nobody hangs;
3. epochs of steps: forward/backward, gradients averaged by the allreduce (weighted by
   sample counts, see ``buckets.py``), identical optimizer steps on every rank;
4. after each epoch a tiny allreduce of loss/metric sums gives global figures;
5. every rank returns its communication stats; rank 0 also returns the trained state.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
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
from sparktrain.comm import Mesh, TreeAllreduce, address_of, open_listener
from sparktrain.comm.chunked import chunk_bytes_for
from sparktrain.comm.link import link_from_config
from sparktrain.data.batch import Batch, Collator, forward
from sparktrain.errors import CheckpointError
from sparktrain.metrics import start_reporter
from sparktrain.result import Record
from sparktrain.worker.context import WorkerContext
from sparktrain.worker.data import PartitionData, check_labels, epoch_batches, steps_for
from sparktrain.worker.divergence import check_finite_weights, diverged
from sparktrain.worker.early_stop import EarlyStopping, agree_to_stop
from sparktrain.worker.evaluate import (
    evaluate,
    feed_scores,
    finish_metric,
    finish_scores,
    metric_name,
    target_like,
)
from sparktrain.worker.memory import peak_anon_bytes, peak_rss_bytes, reset_peak_rss, sample_anon
from sparktrain.worker.prefetch import Prefetcher
from sparktrain.worker.probe import needs_auto, resolve_auto
from sparktrain.worker.scores import Scores, metric_key
from sparktrain.worker.state import digest, return_state, start_from_rank0
from sparktrain.worker.stepping import DistributedStep
from sparktrain.worker.sync import make_sync

# torch's global RNG is per process; ranks run as threads (in tests, or several tasks in one
# reused Python worker) must not interleave seeding and initialisation.
_SEEDED_INIT = threading.Lock()
log = logging.getLogger(__name__)


def train_partition(ctx: WorkerContext, data: PartitionData) -> list[Record]:
    """Run the whole training loop for one rank and return its output records."""
    spec, cfg = ctx.job, ctx.job.config
    torch.set_num_threads(max(1, spec.threads))
    reset_peak_rss()  # the summary's peak is this task's, not a reused worker's past
    started = time.perf_counter()
    mesh, infos, train, val = rendezvous(ctx, data)
    try:
        world_train = sum(i["train"] for i in infos)
        world_val = sum(i["val"] for i in infos)
        steps_per_epoch = max(steps_for(i["train"], cfg.batch_size, cfg.drop_last) for i in infos)
        if steps_per_epoch == 0:
            raise errors.DataError(
                f"drop_last=true but no partition holds a full batch of {cfg.batch_size} "
                "rows: lower batch_size or set drop_last=false"
            )
        return _train(
            ctx,
            mesh,
            train,
            val if world_val else train,
            world_val > 0,
            steps_per_epoch,
            world_train,
            started,
        )
    finally:
        mesh.close()


def rendezvous(
    ctx: WorkerContext, data: PartitionData, *, builtin_loop: bool = True
) -> tuple[Mesh, list[dict[str, Any]], PartitionData, PartitionData]:
    """Split off validation rows, check labels, then one ``all_gather`` of (listener
    address, row counts, error): every rank learns its peers, and if any rank found bad
    data *all* ranks raise before a socket is used. Returns the mesh, every rank's info,
    and this rank's train and validation rows. The built-in loop needs training rows and
    (cross-entropy) labels in range; ``sparktrain.run`` leaves both to its train_fn."""
    job, cfg = ctx.job, ctx.job.config
    problem: str | None = None
    train, val = data, data
    try:
        train, val = data.split(cfg.validation_fraction, cfg.seed, ctx.rank)
        if builtin_loop and cfg.loss == "cross_entropy":
            check_labels(data.y, job.num_outputs, ctx.rank)
    except errors.SparkTrainError as exc:
        problem = f"{type(exc).__name__}: {exc}"
    listener = open_listener(ctx.host)
    try:
        mine = {"address": address_of(listener), "train": train.size, "val": val.size}
        infos = [json.loads(s) for s in ctx.all_gather(json.dumps({**mine, "error": problem}))]
        raise_first_error(infos)
        if builtin_loop and sum(i["train"] for i in infos) == 0:
            raise errors.DataError("the training data is empty on every worker")
        mesh = Mesh(
            ctx.rank,
            ctx.world_size,
            listener,
            [i["address"] for i in infos],
            secret=job.secret,
            job_id=job.job_id,
            attempt=job.attempt,
            timeout=cfg.comm_timeout,
            link=link_from_config(cfg),
            security=job.security,
            max_frame_bytes=job.max_frame_bytes,
        )
    except BaseException:
        listener.close()
        raise
    return mesh, infos, train, val


def raise_first_error(infos: list[dict[str, Any]]) -> None:
    """Raise, on every rank alike, the first error any rank reported in the all-gather."""
    for rank, info in enumerate(infos):
        if info["error"]:
            name, _, message = info["error"].partition(": ")
            error_cls = getattr(errors, name, errors.SparkTrainError)
            raise error_cls(message if f"rank {rank}" in message else f"rank {rank}: {message}")


def _train(
    ctx: WorkerContext,
    mesh: Mesh,
    train: PartitionData,
    evaluation: PartitionData,
    has_validation: bool,
    steps_per_epoch: int,
    world_train: int,
    started: float,
) -> list[Record]:
    spec, cfg = ctx.job, ctx.job.config
    metric = metric_name(cfg.loss, has_validation)
    _check_watched(cfg, metric)  # every rank alike, before anything needs closing
    with _SEEDED_INIT:  # same seed on every rank: identical initial weights
        torch.manual_seed(cfg.seed)
        model = build_model(resolve_model_fn(spec.model_fn, spec.model_kwargs))
    params = [p for p in model.parameters() if p.requires_grad]
    loss_fn = build_loss(cfg.loss, dict(cfg.loss_kwargs))
    # one collator per worker: decode/collate hooks are imported once
    collator = Collator(train.layout)
    targets_dtype = label_dtype(cfg.loss)
    # strategy/compression "auto": probe the links (timing one real batch), then build
    # the sync from the choice
    auto = None
    if needs_auto(cfg.strategy, cfg.compression):
        sample = train.batch(np.arange(min(cfg.batch_size, train.size)), collator, ctx.rank)
        assert sample.labels is not None
        labels = sample.labels.to(targets_dtype)
        ctx, auto = resolve_auto(ctx, mesh, model, loss_fn, sample, labels)
    sync = make_sync(ctx, model, mesh)
    device = torch.device("cpu")
    # with a parameter server the optimizer steps in the driver: a local one, never
    # stepped, carries the schedule's rate that every push hands the server
    optimizer = sync.optimizer or build_optimizer(
        cfg.optimizer, params, cfg.lr, dict(cfg.optimizer_kwargs)
    )
    stepper = DistributedStep(sync, optimizer, params, cfg, device, steps_per_epoch=steps_per_epoch)
    precision = stepper.precision
    early = EarlyStopping(cfg.early_stopping)
    best_state: dict[str, torch.Tensor] | None = None
    # epoch figures are a handful of float64 sums: latency-bound, so always the tree
    reduce_sums = TreeAllreduce(mesh)
    if sync.optimizer is not None:  # with a parameter server, the server's model rules
        start_from_rank0(model, mesh, chunk_bytes_for(mesh.max_frame_bytes))

    reporter = None
    if ctx.rank == 0:
        reporter = start_reporter(
            spec,
            steps_per_epoch=steps_per_epoch,
            world_size=ctx.world_size,
            train_samples=world_train,
        )

    # With a parameter server the model lives in the driver and survives a stage restart;
    # the workers' copies are not authoritative (async), so they neither save nor restore.
    store = None
    if cfg.checkpoint_dir and sync.optimizer is not None:
        store = CheckpointStore(cfg.checkpoint_dir, cfg.keep_checkpoints)
    history: list[dict[str, Any]] = []
    global_step = 0
    if store is None and spec.resume_step is not None and sync.optimizer is None:
        # the parameter server kept the model through the failure: continue at its step
        global_step, history = spec.resume_step, list(spec.resume_history)
    elif store is not None and spec.resume_step is not None:
        ckpt = store.load(spec.resume_step)
        if ckpt is None:
            raise CheckpointError(
                f"checkpoint of step {spec.resume_step} vanished from {store.uri}"
            )
        _restore(store, ctx, ckpt, model, stepper, early)
        global_step, history = ckpt.step, ckpt.history
    # checkpoint_every is in epochs; fractions of an epoch are rounded to whole steps
    every = max(1, round(cfg.checkpoint_every * steps_per_epoch))
    prefetch: Prefetcher[Batch] | None = None
    data_wait_s = 0.0  # the training thread's waits for its next batch
    train_started = time.perf_counter()
    try:
        for epoch in range(global_step // steps_per_epoch, cfg.epochs):
            epoch_started = time.perf_counter()
            model.train()
            rng = np.random.default_rng([cfg.seed, ctx.rank, epoch]) if cfg.shuffle else None
            batches = list(
                epoch_batches(train.size, cfg.batch_size, rng, cfg.drop_last, cfg.shuffle_window)
            )
            loss_sum = 0.0
            loss_rows = 0
            # after a mid-epoch resume, the epoch's first steps are already done
            first = global_step - epoch * steps_per_epoch
            prefetch = Prefetcher(
                functools.partial(_batch, train, batches, collator, ctx.rank),
                range(first, len(batches)),
                cfg.prefetch_batches,
            )
            for step in range(first, steps_per_epoch):
                if spec.fault is not None:
                    spec.fault.maybe_fire(ctx.rank, global_step)
                closes = stepper.closes(step, steps_per_epoch)
                if step < len(batches):
                    batch = prefetch.next()
                    assert batch.labels is not None
                    with precision.autocast():
                        out = forward(model, batch)
                        target = target_like(batch.labels.to(targets_dtype), out)
                        # the loss in float32 at least: a half-precision loss loses digits
                        if out.dtype in (torch.float16, torch.bfloat16):
                            out = out.float()
                        loss = loss_fn(out, target, batch.weights)
                    value = float(loss.detach())
                    if not precision.loss_is_finite(value):
                        # before any exchange: the peers stop in this step's exchange
                        raise diverged(
                            f"on rank {ctx.rank}", epoch, step, steps_per_epoch, value, cfg.lr
                        )
                    stepper.add_rows(len(batch))
                    if closes:  # before backward: gradient hooks may start the exchange
                        stepper.arm()
                    precision.scale(loss).backward()
                    if math.isfinite(value):
                        loss_sum += value * len(batch)
                        loss_rows += len(batch)
                stepper.step(force=closes)
                global_step += 1
                # a checkpoint at an epoch's end waits for the epoch's figures (below);
                # none inside an accumulated step, whose gradients it would not hold
                if (
                    store
                    and global_step % every == 0
                    and step + 1 < steps_per_epoch
                    and stepper.micro == 0
                ):
                    _save(store, ctx, global_step, model, stepper, early, history)
                if reporter is not None and reporter.step_due():
                    elapsed = time.perf_counter() - epoch_started
                    reporter.send(
                        {
                            "type": "step",
                            "epoch": epoch,
                            "step": step + 1,
                            "steps_per_epoch": steps_per_epoch,
                            "loss": loss_sum / max(1, loss_rows),
                            "samples_per_s": world_train
                            * (step + 1)
                            / steps_per_epoch
                            / max(elapsed, 1e-9),
                        }
                    )
            prefetch.close()
            data_wait_s += prefetch.wait_s
            sample_anon()
            figures = evaluate(model, evaluation, cfg.loss, collator, ctx.rank)
            sums = np.array([loss_sum, loss_rows, *figures])
            reduce_sums.allreduce_(sums)
            value = finish_metric(sums[2], sums[3], cfg.loss, spec.label_scale)
            record: dict[str, Any] = {
                "type": "epoch",
                "epoch": epoch,
                "loss": float(sums[0] / max(sums[1], 1)),
                "metric_name": metric,
                "metric": value,
                metric: value,  # by name too, for early stopping and schedules
                "seconds": time.perf_counter() - epoch_started,
            }
            if cfg.metrics:
                record.update(
                    _extra_metrics(
                        model, evaluation, collator, ctx.rank, spec, reduce_sums, _prefix(metric)
                    )
                )
            record["lr"] = stepper.lr
            # replicas hold the same weights, so every rank decides alike
            check_finite_weights(params, epoch, cfg.lr)
            stop, _ = agree_to_stop(early, record, ctx.rank, reduce_sums)
            if stop:
                record["early_stop"] = True
            if ctx.rank == 0 and early.active and early.improved and early.restore_best:
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            stepper.end_epoch(record)
            history.append(record)
            if store is not None and (global_step % every == 0 or stop):
                _save(store, ctx, global_step, model, stepper, early, history)
            elif store is not None and ctx.rank == 0 and early.active and early.improved:
                _save(store, ctx, global_step, model, stepper, early, history, best_only=True)
            if reporter is not None:
                reporter.send(record)
            if stop:
                break
    finally:
        if prefetch is not None:
            prefetch.close()  # an epoch cut short by an error
        sync.close()
        if reporter is not None:
            reporter.close()
    train_s = time.perf_counter() - train_started

    stats = {
        "rank": ctx.rank,
        "train_rows": train.size,
        "steps_per_epoch": steps_per_epoch,
        "train_s": train_s,
        "comm_s": stepper.comm_s,
        "task_s": time.perf_counter() - started,
        "data_path": train.path,
        "spilled_bytes": train.spilled_bytes,
        "data_wait_s": data_wait_s,
        "comm": mesh.stats.as_dict(),
        **stepper.stats(),
        **({"auto": auto} if auto is not None else {}),
        "param_digest": digest(params),
    }
    records = []
    if ctx.rank == 0:
        meta: dict[str, Any] = {"history": history, "metric_name": metric}
        if early.active:
            meta["early_stopping"] = early.summary(restored=best_state is not None)
        if best_state is not None:  # early_stopping.restore_best: the best epoch's model
            model.load_state_dict(best_state)
        records += return_state(spec, 0, model.state_dict(), meta)
    # after the state went out: their true peaks
    stats["peak_rss_bytes"] = peak_rss_bytes()
    stats["peak_anon_bytes"] = peak_anon_bytes()
    return [Record(ctx.rank, "stats", 0, json.dumps(stats).encode()), *records]


def _batch(
    data: PartitionData, batches: list[np.ndarray], collator: Collator, rank: int, step: int
) -> Batch:
    return data.batch(batches[step], collator, rank)


def _save(
    store: CheckpointStore,
    ctx: WorkerContext,
    step: int,
    model: nn.Module,
    stepper: DistributedStep,
    early: EarlyStopping,
    history: list[dict[str, Any]],
    *,
    best_only: bool = False,
) -> None:
    """Every rank with state of its own (compression) writes its shard; rank 0 then
    writes the main file, the commit: the checkpoint counts once all shards are there.
    Rank 0 keeps early stopping's best epoch as the best checkpoint too (``best_only``:
    that alone, between regular checkpoints)."""
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
    ckpt = Checkpoint(
        step=step,
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict() if optimizer is not None else {},
        rng_state=torch.get_rng_state(),
        history=history,
        extra=extra,
    )
    if not best_only:
        store.save(ckpt)
    if early.active and early.improved:  # keep-best: survives the pruning of newer ones
        store.save_best(ckpt)


def _restore(
    store: CheckpointStore,
    ctx: WorkerContext,
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
    (see the record in :func:`_train`); else every rank raises the same error now, not
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
    model: nn.Module,
    data: PartitionData,
    collator: Collator,
    rank: int,
    spec: Any,
    tree: TreeAllreduce,
    prefix: str,
) -> dict[str, float]:
    """The config's ``metrics`` over every rank's validation rows, exact; named like
    the run's metric (``train_`` in front when measured on the training rows)."""
    cfg = spec.config
    scores = Scores(cfg.metrics, num_outputs=spec.num_outputs, label_scale=spec.label_scale)
    feed_scores(model, data, scores, collator, rank)
    return {prefix + k: v for k, v in finish_scores(scores, tree).items()}


def _prefix(metric: str) -> str:
    """``train_`` when the run measures its metrics on the training rows, else ``""``."""
    return "train_" if metric.startswith("train_") else ""
