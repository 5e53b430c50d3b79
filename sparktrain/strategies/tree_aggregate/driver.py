"""``strategy="tree_aggregate"``: the MLlib way. The driver holds the model and the
optimizer; every round is one ordinary Spark job.

This module is the driver's loop (:func:`run_rounds`: size, train epochs of rounds,
checkpoint, summarise). The Spark mechanics of caching the data and running one round are
:mod:`.driver_round` (under Spark Connect :mod:`.driver_frames`), Spark's traffic counts
:mod:`.driver_volume`, the ``delta+`` weights mirror :mod:`.driver_weights`; what a
partition does in a round is executor code, :mod:`.task`, with the contribution's codecs
and combOp in :mod:`.codec`.

1. **Cache** (once): each partition is converted to numpy (Arrow -> numpy for a
   DataFrame, tuples -> numpy for an RDD, with the same checks as the barrier path),
   validation rows split off, and kept as one :class:`~.task.Block` per partition with
   ``persist(MEMORY_AND_DISK)``. No round converts or validates again. There is no job of
   its own for this: the first round materialises the cache and also reports every
   partition's row counts (the *sizing round*, ``RoundSpec.size_slots``), from which the
   driver learns ``rounds_per_epoch``; that round is round 0 of epoch 0 whatever
   ``rounds_per_epoch`` turns out to be. (Resuming from a checkpoint needs
   ``rounds_per_epoch`` before the first training round, so there the sizing round trains
   nothing.)
2. **Round** (many): the weights travel as one flat float32 numpy buffer — inside the
   round's task closure when they are at most ``CLOSURE_WEIGHTS_MAX_BYTES`` (a broadcast
   costs a driver-side file, a block-manager registration and a destroy: measured ~30 ms a
   round here, about a quarter of a small model's round), else as a broadcast; each
   partition computes its contribution (``local_steps=1``: ``n_p`` times its mean-loss
   gradient over one mini-batch of ``batch_size``; ``local_steps=k``: ``n_p`` times its
   model delta after ``k`` local optimizer steps); ``RDD.treeAggregate(depth=
   aggregation_depth)`` sums them; the driver divides by ``N = sum(n_p)`` and either steps
   its optimizer with the gradient of the mean loss over the round's global mini-batch (the
   ring's semantics) or adds the sample-weighted mean delta to the weights (FedAvg, server
   learning rate 1). A round's broadcast is destroyed after its round.

An **epoch** is one pass of every partition over its own training rows: each partition
shuffles its rows with the seed ``(seed, partition, epoch)`` (as a ring rank does) and
consumes ``local_steps`` mini-batches per round, so an epoch is
``rounds_per_epoch = ceil(max partition train rows / (batch_size * local_steps))`` rounds;
a partition that runs out early contributes nothing (its weight is 0) to the epoch's last
rounds.

The epoch's metric is measured on the weights after the epoch; to save a Spark job per
epoch, that evaluation rides on the first round of the next epoch (which starts from the
same broadcast weights), and only the last epoch's needs a job of its own.

The model reaches the executors once per job: its factory (``model_fn``) travels in the
round's closure (Spark's own closure serialization, so models defined in a notebook work
too) and the driver model's state_dict in a broadcast, as weights-only ``torch.save``
bytes; every Python worker builds the model once and caches it by job id. After that
only flat weights travel.

Tasks are ordinary (non-barrier): rounds run with fewer free slots than partitions, under
dynamic allocation, and a failed task is simply retried by Spark. A retried task
recomputes exactly the same contribution (its batches come from the seeded order, its
local optimizer starts fresh each round), so the round's result does not change.

Spark's own view of the traffic (shuffle write/read and task result bytes per stage) is
read from the driver's ``AppStatusStore`` through Py4J; it works with the UI disabled.

Compression (``config.compression``): each partition encodes its contribution
(``codec.CompressedCodec``), combOp merges payloads and the driver decodes the sum. A
``delta+`` prefix also compresses the weights sent down, as deltas on a mirror the tasks
hold (:mod:`.driver_weights`). ``bytes_sent`` counts both directions uncompressed (the
partitions' vectors, and one copy of the weights per task), ``wire_bytes`` what was
encoded and received (merged payloads of a deeper tree are in Spark's shuffle figures);
``upload_*`` / ``download_*`` split them, and ``spark_result_bytes`` /
``spark_shuffle_bytes`` are Spark's own count of what it shipped.

Under Spark Connect (no RDDs, no broadcasts, no status store) the same loop runs over
:class:`~.driver_frames.ConnectBackend`: the encoded rows are a cached DataFrame, a round
is ``mapInArrow`` partials plus ``groupBy().applyInArrow`` levels with
``treeAggregate``'s arithmetic, the model state and small weights travel in the closure,
larger weights come from the weights server (``served_weight_bytes``), and the
``spark_*`` figures are ``None``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.builders import build_optimizer
from sparktrain.checkpoint import Checkpoint, open_for_run
from sparktrain.compress import registry as compress_registry
from sparktrain.config import TrainConfig
from sparktrain.data.partition_data import steps_for
from sparktrain.driver.pickling import shippable
from sparktrain.driver.prepare import PreparedData, unscale_result
from sparktrain.driver.resources import check_transport_security
from sparktrain.driver.services.loggers import make_listeners
from sparktrain.driver.services.metrics_server import ProgressDisplay
from sparktrain.driver.spark_env import ClassicEnv, SparkEnv, spark_env
from sparktrain.driver.stage_runner import driver_host
from sparktrain.errors import ConfigError, DataError, SparkTrainError, WorkerError
from sparktrain.result import TrainResult, state_to_bytes
from sparktrain.strategies.tree_aggregate.codec import (
    COMPUTE_S,
    DOWN_BYTES,
    EVAL_ROWS,
    EVAL_TOTAL,
    LOSS_SUM,
    NUM_STATS,
    RAW_BYTES,
    SAMPLES,
    WIRE_BYTES,
    download_compressor,
    make_codec,
)
from sparktrain.strategies.tree_aggregate.driver_frames import ConnectBackend, closure_budget
from sparktrain.strategies.tree_aggregate.driver_round import (
    ClassicBackend,
    RoundBackend,
    RoundRunner,
    cache_blocks,
)
from sparktrain.strategies.tree_aggregate.driver_volume import SparkVolume
from sparktrain.strategies.tree_aggregate.driver_weights import DownloadEncoder, WeightsServer
from sparktrain.strategies.tree_aggregate.flat import assign, assign_grads, flatten, num_elements
from sparktrain.strategies.tree_aggregate.task import RoundSpec
from sparktrain.task.divergence import check_finite_weights, diverged
from sparktrain.task.evaluate import finish_metric, metric_name
from sparktrain.task.metrics_client import STEP_REPORT_INTERVAL_S
from sparktrain.wire.security import WireSecurity

log = logging.getLogger(__name__)

# Spark's status store keeps the last spark.ui.retainedStages (1000) stages: read it often.
VOLUME_POLL_ROUNDS = 100


# ---------------------------------------------------------------------- the driver loop
def run_rounds(
    prepared: PreparedData,
    model: nn.Module,
    cfg: TrainConfig,
    *,
    model_fn: Any,
    model_kwargs: dict[str, Any] | None = None,
    num_outputs: int,
    started: float,
    task_hook: Callable[[int, int], None] | None = None,
    callbacks: Sequence[Any] = (),
    env: SparkEnv | None = None,
) -> TrainResult:
    """Train ``model`` (built and seeded on the driver from ``model_fn`` and
    ``model_kwargs``, which the executors build it from too) with one Spark job per round;
    ``callbacks`` and the config's loggers get every epoch's record on the driver.
    ``env``: the session's Spark (default: the data's); under Spark Connect the rounds
    are DataFrame operations (:mod:`.driver_frames`)."""
    listeners = make_listeners(cfg, callbacks)  # a missing logger package fails first
    try:  # fail on the driver, before any Spark job, for a spec the rounds cannot use
        make_codec(cfg.compression)
        download_compressor(cfg.compression)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    env = env if env is not None else _spark_env(prepared)
    job_id = uuid.uuid4().hex[:12]
    group = f"sparktrain-{job_id}"
    display = ProgressDisplay(cfg.progress, cfg.metrics_jsonl, listeners, config=cfg.to_dict())
    launched = time.perf_counter()
    state = state_to_bytes(model.state_dict())
    params = [p for p in model.parameters() if p.requires_grad]
    first_weights = flatten(params)
    backend = _backend(env, prepared, cfg, num_outputs, len(state))
    downloads: WeightsServer | None = None
    try:
        # Without broadcasts (Spark Connect) weights too large for the closure are
        # fetched from the weights server, which delta+ specs start anyway.
        served = not backend.can_broadcast and first_weights.nbytes > backend.closure_max_bytes
        if served:  # a socket the fit's encryption gate could not foresee: gate it now
            cfg = check_transport_security(env, cfg, served_weights=True)
        partitions = backend.partitions
        sizing = RoundSpec(
            job_id=job_id,
            config=cfg,
            initial_state=backend.share(state),
            model_fn=model_fn,
            model_kwargs=dict(model_kwargs or {}),
            rounds_per_epoch=0,  # not known until this round reports the row counts
            evaluate_on_validation=False,
            threads=cfg.threads_per_worker or env.task_cpus(),
            task_hook=task_hook,
            size_slots=partitions,
            partitions=partitions,
            compressors=compress_registry.plugins(),
        )
        comp = download_compressor(cfg.compression)
        if comp is not None or served:
            secret = secrets.token_bytes(32)
            security = WireSecurity.for_job(cfg.encryption, cfg.frame_integrity)
            downloads = WeightsServer(
                driver_host(env, cfg),
                DownloadEncoder(comp, cfg.seed),
                secret=secret,
                job_id=job_id,
                security=security,
            )
            sizing = dataclasses.replace(
                sizing, weights_address=downloads.address, secret=secret, security=security
            )
        # functions of a script or notebook (model_fn, hooks) travel as users write them
        runner = RoundRunner(backend, shippable(sizing), downloads=downloads)
        # The first round converts and caches the data, reports every partition's row
        # counts and (unless resuming, which must know rounds_per_epoch first) trains:
        # one Spark job where a separate sizing job used to cost one more job overhead.
        # It runs in a group of its own: its shuffle is the input's repartition, not ours.
        resuming = bool(cfg.resume and cfg.checkpoint_dir)
        first_volume = backend.volume(f"{group}-cache")
        t = time.perf_counter()
        with env.job_group(f"{group}-cache", "sparktrain tree_aggregate: cache the data, round 0"):
            try:
                first_vec, first_stats = runner.run(first_weights, 0, train=not resuming)
            except SparkTrainError:
                raise
            except Exception as exc:
                raise WorkerError.from_spark(exc) from exc
        first_s = time.perf_counter() - t
        log.debug("tree_aggregate: first round (cache + sizing) took %.2f s", first_s)
        cache_s = time.perf_counter() - launched
        sized = first_stats[NUM_STATS:]
        train_rows = [int(n) for n in sized[:partitions]]
        val_rows = [int(n) for n in sized[partitions : 2 * partitions]]
        first_stats = first_stats[:NUM_STATS]
        world_train, world_val = sum(train_rows), sum(val_rows)
        if world_train == 0:
            raise DataError("the training data is empty on every partition")
        k = cfg.local_steps
        steps = steps_for(max(train_rows), cfg.batch_size, cfg.drop_last)
        if steps == 0:
            raise DataError(
                f"drop_last=true but no partition holds a full batch of {cfg.batch_size} "
                "rows: lower batch_size or set drop_last=false"
            )
        rounds_per_epoch = max(1, math.ceil(steps / k))
        runner.spec = shippable(
            dataclasses.replace(
                sizing,
                rounds_per_epoch=rounds_per_epoch,
                evaluate_on_validation=world_val > 0,
                size_slots=0,
            )
        )
        volume = backend.volume(group)
        loop = _Loop(
            model, cfg, runner, display, volume, world_train, partitions, world_val > 0, started
        )
        loop.label_scale = prepared.label_scale
        if not resuming:
            loop.first_round = (first_weights, first_vec, first_stats)
        with env.job_group(group, f"sparktrain tree_aggregate {job_id}: rounds"):
            train_s = loop.train()
        volume.poll(final=True)
        first_volume.poll(final=True)
        # the first round's payloads are task results like every other round's
        volume.result_bytes += first_volume.result_bytes
    except BaseException as exc:
        display.fail(exc)
        raise
    finally:
        display.close()
        backend.release()
        if downloads is not None:
            downloads.stop()

    history = loop.history
    last = history[-1]
    rounds = runner.rounds
    timed_rounds = max(1, rounds - 1)  # the first round's time is in cache_s, not train_s
    summary: dict[str, Any] = {
        "strategy": cfg.strategy,
        "compression": cfg.compression,
        "world_size": partitions,
        "epochs": cfg.epochs,
        "train_samples": world_train,
        "train_rows_per_worker": train_rows,
        "steps_per_epoch": rounds_per_epoch * k,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": last["loss"],
        "metric_name": last["metric_name"],
        "metric_value": last["metric"],
        "wall_s": time.perf_counter() - started,
        "stage_s": time.perf_counter() - launched,
        "train_s": train_s,
        "comm_s": loop.overhead_s,
        "samples_per_s": world_train * cfg.epochs / train_s if train_s > 0 else 0.0,
        # both directions, as the parameter server counts pushes and pulls
        "bytes_sent": int(loop.raw_bytes + loop.down_raw),
        "wire_bytes": int(loop.wire_bytes + loop.down_wire),
        "upload_bytes": int(loop.raw_bytes),
        "upload_wire_bytes": int(loop.wire_bytes),
        "download_bytes": int(loop.down_raw),
        "download_wire_bytes": int(loop.down_wire),
        "mirror_fetches": downloads.fetches if downloads is not None else 0,
        "restarts": 0,
        "replicas_in_sync": True,  # one model, on the driver
        "history": [{k: h[k] for k in ("epoch", "loss", "metric", "seconds")} for h in history],
        "config": cfg.to_dict(),
        # tree_aggregate's own figures
        "rounds": rounds,
        "rounds_per_epoch": rounds_per_epoch,
        "local_steps": k,
        "aggregation_depth": cfg.aggregation_depth,
        "rounds_per_s": timed_rounds / train_s if train_s > 0 else 0.0,
        "round_overhead_s": loop.overhead_s / timed_rounds,
        "broadcast_bytes": runner.broadcast_bytes,
        "closure_weight_bytes": runner.closure_bytes,
        "served_weight_bytes": runner.served_bytes,  # Connect: fetched from the server
        "cache_s": cache_s,  # conversion + caching, within the first round's job
        **volume.as_dict(),
    }
    summary["compression_ratio"] = (
        summary["bytes_sent"] / summary["wire_bytes"] if summary["wire_bytes"] else 1.0
    )
    result = TrainResult(model=model, history=summary["history"], summary=summary)
    unscale_result(result, prepared)
    display.finish(result.summary, result.model)
    return result


def _spark_env(prepared: PreparedData) -> SparkEnv:
    """The session behind the data (for callers that do not pass one)."""
    if prepared.rdd is not None:
        return ClassicEnv(prepared.rdd.context)
    assert prepared.frame is not None
    return spark_env(prepared.frame.sparkSession)


def _backend(
    env: SparkEnv, prepared: PreparedData, cfg: TrainConfig, num_outputs: int, state_bytes: int
) -> RoundBackend:
    """RDDs, broadcasts and treeAggregate in a classic session; DataFrame operations and
    closures under Spark Connect (:mod:`.driver_frames`)."""
    if env.connect:
        budget = closure_budget(env, state_bytes)
        return ConnectBackend(prepared, cfg, num_outputs, budget)
    sc = env.spark_context("strategy='tree_aggregate'")
    return ClassicBackend(sc, cache_blocks(prepared, cfg, num_outputs))


class _Loop:
    """Epochs of rounds on the driver: optimizer steps, progress, per-epoch history."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        runner: RoundRunner,
        display: ProgressDisplay,
        volume: SparkVolume,
        world_train: int,
        world_size: int,
        has_validation: bool,
        started: float | None = None,
    ) -> None:
        self.started = time.perf_counter() if started is None else started
        self.model, self.cfg, self.runner = model, cfg, runner
        self.display, self.volume = display, volume
        self.world_train, self.world_size = world_train, world_size
        self.metric = metric_name(cfg.loss, has_validation)
        self.label_scale = 1.0  # label_scaling's std: RMSE back in label units
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = (
            build_optimizer(cfg.optimizer, self.params, cfg.lr, dict(cfg.optimizer_kwargs))
            if cfg.local_steps == 1
            else None
        )
        self.weights = np.empty(num_elements(self.params), dtype=np.float32)
        self.history: list[dict[str, Any]] = []
        self.overhead_s = 0.0
        self.raw_bytes = 0.0  # uploads: the partitions' vectors, uncompressed
        self.wire_bytes = 0.0  # uploads, encoded
        self.down_raw = 0.0  # weight downloads, uncompressed (one copy per task)
        self.down_wire = 0.0  # what the tasks received (delta+: deltas, fetched mirrors)
        self._pending: dict[str, Any] | None = None  # last epoch, waiting for its metric
        # round 0, already run by the sizing job: (weights, vector, stats)
        self.first_round: tuple[np.ndarray, np.ndarray | None, np.ndarray] | None = None
        self._last_step_report = 0.0
        self.store = (
            open_for_run(cfg.checkpoint_dir, cfg.keep_checkpoints, resume=cfg.resume)
            if cfg.checkpoint_dir
            else None
        )
        # The driver holds model and optimizer, so it checkpoints at epoch boundaries:
        # every checkpoint_every epochs, rounded to whole epochs (at least one).
        self.every_epochs = max(1, round(cfg.checkpoint_every))

    def _resume(self) -> int:
        """Load the newest checkpoint when resume=true; returns the first epoch to run.
        A checkpoint's step counts whole epochs here."""
        if self.store is None or not self.cfg.resume:
            return 0
        ckpt = self.store.load()
        if ckpt is None:
            log.info("no checkpoint in %s yet: starting from scratch", self.store.uri)
            return 0
        self.model.load_state_dict(ckpt.model_state)
        if self.optimizer is not None and ckpt.optimizer_state:
            self.optimizer.load_state_dict(ckpt.optimizer_state)
        done = [dict(h) for h in ckpt.history]
        # the last epoch's metric is measured by the next epoch's first round: it travels
        # in the checkpoint as pending and is completed after the resume
        if done and done[-1].get("pending"):
            self._pending = {k: v for k, v in done.pop().items() if k != "pending"}
        self.history = done
        log.info("resuming tree_aggregate from the checkpoint after epoch %d", ckpt.step)
        return int(ckpt.step)

    def _save(self, epochs_done: int) -> None:
        assert self.store is not None
        history = [*self.history, {**(self._pending or {}), "pending": True}]
        self.store.save(
            Checkpoint(
                step=epochs_done,
                model_state=self.model.state_dict(),
                optimizer_state=self.optimizer.state_dict() if self.optimizer else {},
                rng_state=torch.get_rng_state(),
                history=history,
            )
        )

    def _round(self, index: int, train: bool, evaluate: bool) -> tuple[np.ndarray | None, Any]:
        if index == 0 and self.first_round is not None:  # run already, by the sizing job
            weights, vec, stats = self.first_round
            self.first_round = None
            self.weights[:] = weights
            # its time is mostly conversion and caching (summary's cache_s), not overhead
            return self._account(vec, stats, float(stats[COMPUTE_S]), evaluate)
        flatten(self.params, self.weights)
        t = time.perf_counter()
        try:
            vec, stats = self.runner.run(self.weights, index, train=train, evaluate=evaluate)
        except SparkTrainError:
            raise
        except Exception as exc:
            raise WorkerError.from_spark(exc) from exc
        return self._account(vec, stats, time.perf_counter() - t, evaluate)

    def _account(
        self, vec: np.ndarray | None, stats: np.ndarray, seconds: float, evaluate: bool
    ) -> tuple[np.ndarray | None, Any]:
        self.overhead_s += max(0.0, seconds - float(stats[COMPUTE_S]))
        self.raw_bytes += float(stats[RAW_BYTES])
        self.wire_bytes += float(stats[WIRE_BYTES])
        self.down_raw += self.weights.nbytes * self.world_size  # one copy per task
        self.down_wire += float(stats[DOWN_BYTES])
        if self.runner.rounds % VOLUME_POLL_ROUNDS == 0:
            self.volume.poll()
        if evaluate:
            self._finish_epoch(float(stats[EVAL_TOTAL]), float(stats[EVAL_ROWS]))
        return vec, stats

    def _apply(self, vec: np.ndarray, samples: float) -> None:
        if samples <= 0:
            raise WorkerError("no partition contributed samples to a round; this is a bug")
        vec /= samples
        if self.optimizer is not None:  # the mean-loss gradient of the global mini-batch
            assign_grads(self.params, vec)
            self.optimizer.step()
        else:  # FedAvg: add the sample-weighted mean delta
            assign(self.params, self.weights + vec)

    def train(self) -> float:
        cfg = self.cfg
        rpe = self.runner.spec.rounds_per_epoch
        self.display(
            {
                "type": "start",
                "epochs": cfg.epochs,
                "steps_per_epoch": rpe,
                "world_size": self.world_size,
                "train_samples": self.world_train,
            }
        )
        started = time.perf_counter()
        first = self._resume()
        index = first * rpe  # rounds pick their batches by index: a resumed run is identical
        self.model.train()
        for epoch in range(first, cfg.epochs):
            epoch_started = time.perf_counter()
            loss_sum = samples = 0.0
            for r in range(rpe):
                vec, stats = self._round(index, train=True, evaluate=epoch > 0 and r == 0)
                index += 1
                assert vec is not None
                round_loss = float(stats[LOSS_SUM])
                if not math.isfinite(round_loss):
                    where = "summed over the partitions"
                    raise diverged(where, epoch, r, rpe, round_loss, cfg.lr)
                self._apply(vec, float(stats[SAMPLES]))
                loss_sum += round_loss
                samples += float(stats[SAMPLES])
                self._report_step(epoch, r + 1, rpe, loss_sum, samples, epoch_started)
            self._pending = {
                "type": "epoch",
                "epoch": epoch,
                "loss": loss_sum / max(samples, 1.0),
                "metric_name": self.metric,
                "seconds": time.perf_counter() - epoch_started,
            }
            check_finite_weights(self.params, epoch, cfg.lr)
            if self.store is not None and (epoch + 1) % self.every_epochs == 0:
                self._save(epoch + 1)
        self._round(index, train=False, evaluate=True)  # the last epoch's metric
        return time.perf_counter() - started

    def _finish_epoch(self, total: float, rows: float) -> None:
        assert self._pending is not None
        metric = finish_metric(total, rows, self.cfg.loss, self.label_scale)
        record = {**self._pending, "metric": metric}
        keys = ("type", "epoch", "loss", "metric_name", "metric", "seconds")
        record = {k: record[k] for k in keys}
        # seconds since fit() started, when this metric was known (time-to-accuracy)
        record["elapsed_s"] = time.perf_counter() - self.started
        self._pending = None
        self.history.append(record)
        self.display(record)

    def _report_step(
        self, epoch: int, step: int, rpe: int, loss_sum: float, samples: float, since: float
    ) -> None:
        now = time.monotonic()
        if step != rpe and now - self._last_step_report < STEP_REPORT_INTERVAL_S:
            return
        self._last_step_report = now
        elapsed = time.perf_counter() - since
        self.display(
            {
                "type": "step",
                "epoch": epoch,
                "step": step,
                "steps_per_epoch": rpe,
                "loss": loss_sum / max(samples, 1.0),
                "samples_per_s": samples / max(elapsed, 1e-9),
            }
        )


__all__ = ["run_rounds"]
