"""The loop every pipeline-stage task runs (executor side: no Spark types here).

Layout. World rank ``r`` is stage ``r % P`` of pipeline row (data replica) ``r // P``:
row ``d`` is ranks ``d*P .. d*P + P - 1``; stage ``s``'s replicas are ``s, P + s, ...``.

Data placement. Every task still reads its own Spark partition (``num_workers = P x D``
partitions) and splits off its validation rows as in data parallel. Once, before
training, the tasks of a row send their rows over the wire: features to the row's first
stage, labels to its last stage (in row order, so every stage of a row agrees on the
row's sample order; training labels travel with their sample weights, NaN when unweighted).
Only the first stage then reads features, only the last stage reads labels (and weights);
nothing but activations and activation gradients cross the stage boundaries
during training.

Batches. Each row is one data replica: per step it takes ``batch_size`` rows of its
data (shuffled per epoch with ``default_rng([seed, row, epoch])``, or in order), splits
them into ``micro_batches`` nearly equal micro-batches (``np.array_split``; empty ones
are dropped), and runs the micro-batches through the stages in the configured schedule.
Micro-batch ``i`` contributes ``loss_fn(out_i, y_i) * n_i / n`` so that the accumulated
gradient is that of the mean loss over the row's ``n`` rows of the step. With ``D > 1``
the replicas of each stage then average their gradients sample-weighted over the stage's
group (``task/buckets.py`` rule): the step's gradient is exactly that of the mean loss
over the concatenation of every row's batch. Every stage steps its own optimizer on its
own parameters (element-wise optimizers: the same as one optimizer on the whole model).
A row whose data ran out contributes 0 samples to the group, as in data parallel.

Start. With ``D > 1`` every replica of a stage takes its replica 0's parameters and
buffers, bitwise, right after building its stage (a chunked broadcast over the stage's
group, :func:`~sparktrain.task.state_sender.start_from_rank0`), as data parallel does.

Checkpoints (``checkpoint_dir``; every ``checkpoint_every`` epochs, rounded to whole
steps as in data parallel): every rank writes a shard, the last stage's replica 0 the
main file (:mod:`sparktrain.parallel.checkpoints`). A run with ``resume_step``
restores every stage and goes on at that step: same batches, same optimizer state, so
it ends with the weights of an uninterrupted run.

State return. Each stage's replica 0 returns its part of the trained state under the
whole model's key names: streamed to the driver's state receiver when the job has one
(:func:`state_senders` says which rank sends which keys), else as chunked task results.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain import errors
from sparktrain.builders import build_loss, build_optimizer, label_dtype, resolve_model_fn
from sparktrain.checkpoint import CheckpointStore
from sparktrain.compress import registry as compress_registry
from sparktrain.config import single_spec
from sparktrain.data.partition_data import (
    PartitionData,
    epoch_batches,
    split_labels_weights,
    steps_for,
    weights_at,
)
from sparktrain.parallel.checkpoints import StageCheckpoints, StagePart, stage_state
from sparktrain.parallel.group import GroupGradientSync, GroupMesh, group_allreduce
from sparktrain.parallel.partition import Partition, as_sequential
from sparktrain.parallel.schedule import make_schedule
from sparktrain.result import Record
from sparktrain.task.context import JobSpec, WorkerContext
from sparktrain.task.divergence import check_finite_weights
from sparktrain.task.evaluate import EVAL_SLICE, finish_metric, metric_name, target_like
from sparktrain.task.meet import SEEDED_INIT, rendezvous
from sparktrain.task.metrics_client import MetricsClient, start_reporter
from sparktrain.task.state_sender import digest, return_state, start_from_rank0
from sparktrain.wire import KIND_USER_MIN, Mesh, RingAllreduce
from sparktrain.wire.chunked import chunk_bytes_for, put_chunked, recv_chunked_into
from sparktrain.wire.frames import KIND_DATA

KIND_ROWS = KIND_USER_MIN + 1
"""Frames of the one-off row gather (features to the first stage, labels to the last)."""

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NUMPY_WIRE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}


@dataclass(frozen=True)
class PipelineSpec:
    """What a stage task needs beyond the JobSpec; picklable, made once on the driver
    (the partition is measured there, so every task agrees on it)."""

    job: JobSpec
    partition: Partition
    replicas: int
    micro_batches: int = 4
    schedule: str = "1f1b"
    activation_dtype: str = "float32"

    @property
    def stages(self) -> int:
        return self.partition.num_stages

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage


def state_senders(spec: PipelineSpec, model: nn.Module) -> dict[int, list[str]]:
    """For the driver's :class:`~sparktrain.driver.services.state_receiver.StateReceiver`: which
    world rank streams which keys of ``model`` (the driver's whole model). Each stage's
    replica 0 sends its stage's keys; a stage without state sends an empty part."""
    full = as_sequential(model)
    return {
        spec.rank_of(s, 0): list(stage_state((i, full[i]) for i in spec.partition.owned(s)))
        for s in range(spec.stages)
    }


def micro_batches(idx: np.ndarray, micro: int) -> list[np.ndarray]:
    """A step's row indices split into at most ``micro`` non-empty micro-batches."""
    return [m for m in np.array_split(idx, micro) if len(m)]


@dataclass
class _Counters:
    busy_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    stage_bytes: int = 0
    steps: int = 0
    peak_in_flight: int = 0
    peak_activation_bytes: int = 0
    step_s: list[float] = field(default_factory=list)


def train_stage(ctx: WorkerContext, data: PartitionData, spec: PipelineSpec) -> list[Record]:
    """Run the whole training loop of one stage task and return its output records."""
    job = spec.job
    compress_registry.install(job.compressors)  # the driver's plug-ins, before any is built
    torch.set_num_threads(max(1, job.threads))
    if ctx.world_size != spec.stages * spec.replicas:
        raise errors.ConfigError(
            f"the stage has {ctx.world_size} tasks but the pipeline needs "
            f"{spec.stages} x {spec.replicas}"
        )
    mesh, infos, train, val = rendezvous(ctx, data)
    # a task that could not reach the driver met through Spark and forgot its addresses
    spec = replace(spec, job=ctx.job)
    try:
        return _StageRunner(ctx, spec, mesh, infos, train, val).run()
    finally:
        mesh.close()


def stage_entry(template: PipelineSpec, ctx: WorkerContext, data: PartitionData) -> list[Record]:
    """The stage runner's per-task entry: :func:`train_stage` with this attempt's job
    (``ctx.job``) in the pipeline ``template``."""
    return train_stage(ctx, data, replace(template, job=ctx.job))


class _StageRunner:
    def __init__(
        self,
        ctx: WorkerContext,
        spec: PipelineSpec,
        mesh: Mesh,
        infos: list[dict[str, Any]],
        train: PartitionData,
        val: PartitionData,
    ) -> None:
        self.ctx, self.spec, self.mesh = ctx, spec, mesh
        self.cfg = spec.job.config
        self.P, self.D = spec.stages, spec.replicas
        self.stage = spec.stage_of(ctx.rank)
        self.replica = spec.replica_of(ctx.rank)
        self.first = self.stage == 0
        self.last = self.stage == self.P - 1
        self.row = [spec.rank_of(s, self.replica) for s in range(self.P)]
        self.infos = infos
        self.has_validation = sum(i["val"] for i in infos) > 0
        self.train_part, self.val_part = train, val
        self.n_train = sum(infos[r]["train"] for r in self.row)
        self.world_train = sum(i["train"] for i in infos)
        self.n_eval = sum(infos[r]["val" if self.has_validation else "train"] for r in self.row)
        self.steps_per_epoch = max(
            steps_for(
                sum(infos[spec.rank_of(s, d)]["train"] for s in range(self.P)),
                self.cfg.batch_size,
                self.cfg.drop_last,
            )
            for d in range(self.D)
        )
        self.in_shape = spec.partition.shapes[self.stage]
        self.out_shape = spec.partition.shapes[self.stage + 1]
        self.wire = spec.activation_dtype
        if self.wire not in WIRE_DTYPES:
            raise errors.ConfigError(
                f"pipeline activation dtype {self.wire!r} unknown: use one of "
                f"{', '.join(WIRE_DTYPES)}"
            )
        self.prev = spec.rank_of(self.stage - 1, self.replica) if not self.first else None
        self.next = spec.rank_of(self.stage + 1, self.replica) if not self.last else None
        self.counters = _Counters()
        self.w_train: np.ndarray | None = None  # the row's sample weights (last stage)
        # activations and rows travel in pieces under the frame cap, whatever their size
        self.chunk_bytes = chunk_bytes_for(mesh.max_frame_bytes)
        self.replica_group = [spec.rank_of(self.stage, d) for d in range(self.D)]
        self.checkpoints = (
            StageCheckpoints(
                CheckpointStore(self.cfg.checkpoint_dir, self.cfg.keep_checkpoints),
                rank=ctx.rank,
                world_size=ctx.world_size,
                stage=self.stage,
                replica=self.replica,
                last=self.last,
                layout={"stages": self.P, "replicas": self.D, "bounds": [*spec.partition.bounds]},
            )
            if self.cfg.checkpoint_dir
            else None
        )
        # checkpoint_every is in epochs; fractions of an epoch are rounded to whole steps
        self.every = max(1, round(self.cfg.checkpoint_every * self.steps_per_epoch))

    # ----------------------------------------------------------------- setup
    def _gather_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(x_train, x_eval) on the first stage, (y_train, y_eval) on the last (empty
        arrays elsewhere): the row's rows in row order (see the module docstring)."""
        mesh, me = self.mesh, self.ctx.rank
        width = self.spec.job.feature_width
        ev = self.val_part if self.has_validation else self.train_part
        first, last = self.row[0], self.row[-1]
        if not self.first:
            for arr in (self.train_part.x, ev.x):
                if arr.size:
                    rows = np.ascontiguousarray(arr, dtype=np.float32)
                    put_chunked(mesh.sender(first), rows, self.chunk_bytes, KIND_ROWS)
        if not self.last:
            for arr in (self.train_part.labels_with_weights(), ev.y):
                if arr.size:
                    labels = np.ascontiguousarray(arr, dtype=np.float64)
                    put_chunked(mesh.sender(last), labels, self.chunk_bytes, KIND_ROWS)
        empty_x = np.zeros((0, width), np.float32)
        empty_y = np.zeros(0, np.float64)
        key = "val" if self.has_validation else "train"

        def collect(features: bool) -> tuple[np.ndarray, np.ndarray]:
            parts: dict[str, list[np.ndarray]] = {"train": [], "eval": []}
            for r in self.row:
                for which, n in (("train", self.infos[r]["train"]), ("eval", self.infos[r][key])):
                    if r == me:
                        local = self.train_part if which == "train" else ev
                        labels = local.labels_with_weights() if which == "train" else local.y
                        parts[which].append(local.x if features else labels)
                    elif n:
                        buf = (
                            np.empty((n, width), np.float32)
                            if features
                            else np.empty((n, 2) if which == "train" else n, np.float64)
                        )
                        recv_chunked_into(mesh.connection(r), buf, self.chunk_bytes, KIND_ROWS)
                        parts[which].append(buf)
            cat = np.concatenate
            if features:
                return cat([empty_x, *parts["train"]]), cat([empty_x, *parts["eval"]])
            empty_yw = np.zeros((0, 2), np.float64)
            return cat([empty_yw, *parts["train"]]), cat([empty_y, *parts["eval"]])

        x_train, x_eval = collect(True) if self.first else (empty_x, empty_x)
        y_train, y_eval = collect(False) if self.last else (empty_y, empty_y)
        if self.last:
            y_train, self.w_train = split_labels_weights(y_train)
        for peer in {first, last} - {me}:
            mesh.sender(peer).flush()
        return x_train, x_eval, y_train, y_eval

    def _build(self) -> tuple[list[int], nn.Sequential]:
        job = self.spec.job
        with SEEDED_INIT:  # same seed as the driver: identical initial weights
            torch.manual_seed(self.cfg.seed)
            full = as_sequential(resolve_model_fn(job.model_fn, job.model_kwargs)())
        owned = list(self.spec.partition.owned(self.stage))
        if len(full) != self.spec.partition.bounds[-1]:
            raise errors.ConfigError(
                f"model_fn built {len(full)} layers on rank {self.ctx.rank}, the driver's "
                f"model had {self.spec.partition.bounds[-1]}: model_fn must be deterministic"
            )
        module = nn.Sequential(*[full[i] for i in owned])
        del full  # the other stages' layers are dropped here
        return owned, module

    # ----------------------------------------------------------------- wire
    def _send(self, peer: int, tensor: torch.Tensor) -> None:
        t = tensor.detach().to(WIRE_DTYPES[self.wire]).contiguous()
        if self.wire == "bfloat16":
            t = t.view(torch.int16)
        arr = t.numpy().copy() if t.dtype == torch.float32 else t.numpy()
        self.counters.stage_bytes += arr.nbytes
        put_chunked(self.mesh.sender(peer), arr, self.chunk_bytes, KIND_DATA)

    def _recv(self, peer: int, rows: int, shape: tuple[int, ...]) -> torch.Tensor:
        buf = np.empty((rows, *shape), dtype=_NUMPY_WIRE[self.wire])
        t = time.perf_counter()
        recv_chunked_into(self.mesh.connection(peer), buf, self.chunk_bytes, KIND_DATA)
        self.counters.wait_s += time.perf_counter() - t
        out = torch.from_numpy(buf)
        if self.wire == "bfloat16":
            out = out.view(torch.bfloat16)
        return out.float() if out.dtype != torch.float32 else out

    def _from_prev(self, rows: int) -> torch.Tensor:
        assert self.prev is not None
        return self._recv(self.prev, rows, self.in_shape)

    def _from_next(self, rows: int) -> torch.Tensor:
        assert self.next is not None
        return self._recv(self.next, rows, self.out_shape)

    def _flush(self) -> None:
        for peer in (self.prev, self.next):
            if peer is not None:
                self.mesh.sender(peer).flush()

    # ----------------------------------------------------------------- the step
    def _step(
        self,
        module: nn.Sequential,
        micro: list[np.ndarray],
        count: int,
        x_all: torch.Tensor,
        y_all: torch.Tensor,
        loss_fn: Any,
        param_ptrs: set[int],
    ) -> tuple[float, int]:
        """Forwards and backwards of one step's micro-batches; returns (loss sum, rows)
        on the last stage (zeros elsewhere)."""
        c = self.counters
        stash: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        live_bytes = 0
        loss_sum = 0.0
        rows = 0
        for kind, i in make_schedule(self.spec.schedule, self.stage, self.P, len(micro)):
            n = len(micro[i])
            if kind == "F":
                inp = (
                    x_all[torch.from_numpy(micro[i])]
                    if self.first
                    else self._from_prev(n).requires_grad_(True)
                )
                t = time.perf_counter()
                saved: dict[int, int] = {}

                def pack(x: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
                    ptr = x.untyped_storage().data_ptr()
                    if ptr not in param_ptrs:
                        saved[ptr] = x.untyped_storage().nbytes()
                    return x

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                    out = module(inp)
                    if self.last:
                        target = target_like(y_all[torch.from_numpy(micro[i])], out)
                        raw = loss_fn(out, target, weights_at(self.w_train, micro[i]))
                        loss_sum += float(raw.detach()) * n
                        rows += n
                        out = raw * (n / count)
                for tensor in (inp, out):
                    saved.setdefault(
                        tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
                    )
                nbytes = sum(saved.values())
                c.busy_s += time.perf_counter() - t
                stash[i] = (inp, out, nbytes)
                live_bytes += nbytes
                c.peak_in_flight = max(c.peak_in_flight, len(stash))
                c.peak_activation_bytes = max(c.peak_activation_bytes, live_bytes)
                if self.next is not None:
                    self._send(self.next, out)
            else:
                inp, out, nbytes = stash.pop(i)
                grad = None if self.last else self._from_next(n)
                t = time.perf_counter()
                if out.requires_grad:
                    out.backward(grad)
                c.busy_s += time.perf_counter() - t
                live_bytes -= nbytes
                if self.prev is not None:
                    g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                    self._send(self.prev, g)
                del inp, out
        self._flush()
        return loss_sum, rows

    def _evaluate(
        self, module: nn.Sequential, x_eval: torch.Tensor, y_eval: torch.Tensor
    ) -> tuple[float, float]:
        """Forward-only pass over the row's evaluation rows; (total, rows) on the last stage."""
        loss = self.cfg.loss
        total = 0.0
        module.eval()
        with torch.no_grad():
            for start in range(0, self.n_eval, EVAL_SLICE):
                n = min(EVAL_SLICE, self.n_eval - start)
                inp = x_eval[start : start + n] if self.first else self._from_prev(n)
                out = module(inp)
                if self.next is not None:
                    self._send(self.next, out)
                    continue
                y = y_eval[start : start + n]
                if loss == "cross_entropy":
                    total += float((out.argmax(dim=1) == y.long()).sum())
                elif loss == "bce_with_logits":
                    total += float(((out.reshape(-1) > 0).double() == y).sum())
                else:
                    diff = out.double().reshape(n, -1) - y.reshape(-1, 1)
                    total += float((diff**2).sum())
        module.train()
        self._flush()
        return total, float(self.n_eval if self.last else 0)

    # ----------------------------------------------------------------- the loop

    def _reporter(self) -> MetricsClient | None:
        """Progress goes to the driver from the last stage of row 0 (it has the loss)."""
        job = self.spec.job
        if not (self.last and self.replica == 0):
            return None
        return start_reporter(
            job,
            steps_per_epoch=self.steps_per_epoch,
            world_size=self.ctx.world_size,
            train_samples=self.world_train,
        )

    def _epochs(
        self,
        trained: StagePart,
        sums_reduce: RingAllreduce | None,
        loss_fn: Any,
        tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        history: list[dict[str, Any]],
        reporter: MetricsClient | None,
        metric: str,
        global_step: int,
    ) -> None:
        """Train from ``global_step`` (0, or a resumed checkpoint's) to the last epoch."""
        spec, cfg, c = self.spec, self.cfg, self.counters
        x_all, y_all, xe, ye = tensors
        module, optimizer, sync = trained.module, trained.optimizer, trained.sync
        param_ptrs = {p.untyped_storage().data_ptr() for p in module.parameters()}
        fault = spec.job.fault
        first_epoch = global_step // self.steps_per_epoch if self.steps_per_epoch else 0
        for epoch in range(first_epoch, cfg.epochs):
            epoch_started = time.perf_counter()
            rng = np.random.default_rng([cfg.seed, self.replica, epoch]) if cfg.shuffle else None
            batches = list(epoch_batches(self.n_train, cfg.batch_size, rng, cfg.drop_last))
            loss_sum = 0.0
            loss_rows = 0
            # after a mid-epoch resume, the epoch's first steps are already done
            for step in range(global_step - epoch * self.steps_per_epoch, self.steps_per_epoch):
                if fault is not None:
                    fault.maybe_fire(self.ctx.rank, global_step)
                step_started = time.perf_counter()
                idx = batches[step] if step < len(batches) else np.zeros(0, np.int64)
                micro = micro_batches(idx, spec.micro_batches)
                got_sum, got_rows = self._step(
                    module, micro, len(idx), x_all, y_all, loss_fn, param_ptrs
                )
                loss_sum += got_sum
                loss_rows += got_rows
                t = time.perf_counter()
                if sync is not None:
                    sync.average_(len(idx))
                c.sync_s += time.perf_counter() - t
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=False)
                c.steps += 1
                c.step_s.append(time.perf_counter() - step_started)
                global_step += 1
                # a checkpoint at an epoch's end waits for the epoch's figures (below)
                ckpts = self.checkpoints
                if ckpts and global_step % self.every == 0 and step + 1 < self.steps_per_epoch:
                    ckpts.save(global_step, trained, history)
                if reporter is not None and reporter.step_due():
                    reporter.send(
                        {
                            "type": "step",
                            "epoch": epoch,
                            "step": step + 1,
                            "steps_per_epoch": self.steps_per_epoch,
                            "loss": loss_sum / max(1, loss_rows),
                            "samples_per_s": self.n_train
                            * self.D
                            * (step + 1)
                            / self.steps_per_epoch
                            / max(time.perf_counter() - epoch_started, 1e-9),
                        }
                    )
            total, rows = self._evaluate(module, xe, ye)
            sums = np.array([loss_sum, loss_rows, total, rows], dtype=np.float64)
            if sums_reduce is not None:
                sums_reduce.allreduce_(sums)
            record = {
                "type": "epoch",
                "epoch": epoch,
                "loss": float(sums[0] / max(sums[1], 1)),
                "metric_name": metric,
                "metric": finish_metric(sums[2], sums[3], cfg.loss, self.spec.job.label_scale),
                "seconds": time.perf_counter() - epoch_started,
            }
            # a non-finite loss on the last stage sends non-finite gradients back through
            # every stage, so every stage stops here in the same epoch
            check_finite_weights([p for p in module.parameters() if p.requires_grad], epoch, cfg.lr)
            history.append(record)
            if self.checkpoints is not None and global_step % self.every == 0:
                self.checkpoints.save(global_step, trained, history)
            if reporter is not None:
                reporter.send(record)

    def run(self) -> list[Record]:
        spec, cfg, c = self.spec, self.cfg, self.counters
        started = time.perf_counter()
        peers = [p for p in (self.prev, self.next) if p is not None]
        self.mesh.connect_all(peers)
        x_train, x_eval, y_train, y_eval = self._gather_rows()
        owned, module = self._build()
        if self.D > 1:  # every replica of the stage starts from its replica 0's weights
            group = GroupMesh(self.mesh, self.replica_group).as_mesh()
            start_from_rank0(module, group, self.chunk_bytes)
        start_digest = digest([*module.parameters(), *module.buffers()])
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = (
            build_optimizer(cfg.optimizer, params, cfg.lr, dict(cfg.optimizer_kwargs))
            if params
            else None
        )
        sync = None
        if self.D > 1 and params:
            sync = GroupGradientSync(
                self.mesh,
                self.replica_group,
                params,
                int(cfg.bucket_mb * (1 << 20)),
                single_spec(cfg.compression, "pipeline"),
                seed=cfg.seed,
                compression_path=cfg.compression_path,
            )
        trained = StagePart(module, owned, optimizer, sync)
        sums_reduce = None
        if self.last and self.D > 1:
            sums_reduce = group_allreduce(self.mesh, self.replica_group)
        loss_fn = build_loss(cfg.loss, dict(cfg.loss_kwargs))
        x_all = torch.from_numpy(x_train)
        y_all = torch.from_numpy(y_train).to(label_dtype(cfg.loss))
        xe = torch.from_numpy(x_eval)
        ye = torch.from_numpy(y_eval)
        metric = metric_name(cfg.loss, self.has_validation)
        history: list[dict[str, Any]] = []
        global_step = 0
        resume = spec.job.resume_step
        if resume is not None:
            if self.checkpoints is None:
                raise errors.CheckpointError(
                    f"resume_step={resume} without a checkpoint_dir: a pipeline resumes "
                    "only from its checkpoints"
                )
            history = list(self.checkpoints.restore(resume, trained))
            global_step = resume
        reporter = self._reporter()
        module.train()
        train_started = time.perf_counter()
        try:
            self._epochs(
                trained,
                sums_reduce,
                loss_fn,
                (x_all, y_all, xe, ye),
                history,
                reporter,
                metric,
                global_step,
            )
        finally:
            if reporter is not None:
                reporter.close()
        train_s = time.perf_counter() - train_started
        stats = {
            "rank": self.ctx.rank,
            "stage": self.stage,
            "replica": self.replica,
            "train_rows": self.train_part.size,
            "steps_per_epoch": self.steps_per_epoch,
            "train_s": train_s,
            "comm_s": c.wait_s + c.sync_s,
            "busy_s": c.busy_s,
            "step_s_total": sum(c.step_s),
            "step_s_median": float(np.median(c.step_s)) if c.step_s else 0.0,
            "steps": c.steps,
            "stage_bytes_sent": c.stage_bytes,
            "peak_in_flight": c.peak_in_flight,
            "peak_activation_bytes": c.peak_activation_bytes,
            "task_s": time.perf_counter() - started,
            "comm": self.mesh.stats.as_dict(),
            "start_digest": start_digest,
            "param_digest": digest(params),
            "param_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
        }
        records = [Record(self.ctx.rank, "stats", 0, json.dumps(stats).encode())]
        if self.replica == 0:
            meta = {
                "stage": self.stage,
                "history": history if self.last else [],
                "metric_name": metric,
            }
            records += return_state(spec.job, self.ctx.rank, trained.state(), meta)
        return records
