"""``ctx``: what a user's ``train_fn`` sees in every task of :func:`sparktrain.run`.

One :class:`RunContext` per rank gives the rank's place in the world, its partition's
batches, collectives between the ranks, reports that reach the driver, checkpoints that
survive a restarted stage, and :meth:`RunContext.distributed`, which turns a model and an
optimizer into data-parallel ones whose ``optimizer.step()`` averages gradients through
the configured strategy.

Every collective (``allreduce``, ``broadcast``, ``barrier``, ``report``,
``checkpoint``, the distributed ``step``) must be called by every rank, in the same
order: they are the same collectives the built-in loop uses, and a rank that skips one
leaves its peers waiting until ``comm_timeout``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
import zlib
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, overload

import numpy as np
import torch
from torch import nn

from sparktrain.checkpoint import RANK_SHARDS, Checkpoint, CheckpointStore
from sparktrain.config import TrainConfig
from sparktrain.data.batch import Batch, Collator, forward
from sparktrain.data.partition_data import PartitionData, epoch_batches
from sparktrain.data.prefetch import Prefetcher
from sparktrain.errors import CheckpointError, ConfigError
from sparktrain.task.context import WorkerContext
from sparktrain.task.device import Placement
from sparktrain.task.divergence import diverged
from sparktrain.task.early_stop import EarlyStopping, agree_to_stop
from sparktrain.task.evaluate import feed_scores, finish_scores
from sparktrain.task.metrics_client import MetricsClient
from sparktrain.task.precision import Precision
from sparktrain.task.scores import Scores
from sparktrain.task.sharded import SHARDED_WORLD, check_sharded_resume
from sparktrain.task.state_sender import byte_view, start_from_rank0
from sparktrain.task.step_sync import make_sync
from sparktrain.task.stepping import DistributedStep
from sparktrain.wire import Mesh, TreeAllreduce, make_allreduce
from sparktrain.wire.chunked import broadcast_, chunk_bytes_for
from sparktrain.wire.ring import DEFAULT_CHUNK_BYTES

REDUCE_OPS = ("mean", "sum", "max", "min")
ModelT = TypeVar("ModelT", bound=nn.Module)
OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)
_SMALL_BYTES = 1 << 16  # below this an allreduce is latency-bound: the tree


class RunContext:
    """One rank's handle on the run (see the module docstring).

    Attributes
    ----------
    rank, world_size:
        This task's rank and the number of tasks.
    device:
        Where the model and batches belong (``cpu`` on CPU executors).
    config:
        The run's :class:`~sparktrain.config.TrainConfig`.
    steps_per_epoch:
        Batches :meth:`batches` yields per epoch, the same on every rank.
    rows_per_rank, val_rows_per_rank:
        Every rank's training and validation rows, by rank.
    history:
        The reports so far (reduced across ranks), as the driver records them.
    global_step:
        Batches :meth:`batches` yielded so far, over all epochs (restored by
        :meth:`restore`).
    task:
        The task's :class:`~sparktrain.task.context.WorkerContext`: the job's spec
        and the task's services. The built-in loop and advanced ``train_fn`` s read it.
    """

    def __init__(
        self,
        task: WorkerContext,
        mesh: Mesh,
        train: PartitionData,
        val: PartitionData,
        *,
        steps_per_epoch: int,
        rows_per_rank: Sequence[int] | None = None,
        val_rows_per_rank: Sequence[int] | None = None,
        reporter: MetricsClient | None = None,
        store: CheckpointStore | None = None,
        placement: Placement | None = None,
    ) -> None:
        self.rank = task.rank
        self.world_size = task.world_size
        self.placement = placement
        self.device = placement.device if placement is not None else torch.device("cpu")
        self.steps_per_epoch = steps_per_epoch
        self.rows_per_rank = list(rows_per_rank if rows_per_rank is not None else [train.size])
        self.val_rows_per_rank = list(
            val_rows_per_rank if val_rows_per_rank is not None else [val.size]
        )
        self.history: list[dict[str, Any]] = []
        self.global_step = 0  # batches yielded by batches(), over all epochs
        self.task = task
        self._mesh = mesh
        self._train = train
        self._val = val
        self._collator = Collator(train.layout)
        self._reporter = reporter
        self._store = store
        self._tree = TreeAllreduce(mesh)
        self._ring = make_allreduce(
            "ring", mesh, chunk_bytes=max(8, min(DEFAULT_CHUNK_BYTES, mesh.max_frame_bytes))
        )
        self._early = EarlyStopping(self.config.early_stopping)
        self.should_stop = False
        self._improved = False
        self._distributed: DistributedStep | None = None
        self._restored: Checkpoint | None = None
        self._last_ckpt_step = 0
        self._started = time.perf_counter()
        self._last_report = self._started
        self._epoch = 0  # of the latest batches() call, and when it started
        self._epoch_started = self._started
        self.comm_s = 0.0
        self.data_wait_s = 0.0

    @property
    def config(self) -> TrainConfig:
        """The run's configuration."""
        return self.task.job.config

    # ------------------------------------------------------------------ the parts
    # The built-in loop is a train_fn too; it reads these parts directly.
    @property
    def mesh(self) -> Mesh:
        """The connections between the ranks."""
        return self._mesh

    @property
    def tree(self) -> TreeAllreduce:
        """The latency-bound allreduce of small figures (float64 sums)."""
        return self._tree

    @property
    def train_partition(self) -> PartitionData:
        """This rank's training rows as loaded (columns decoded on demand)."""
        return self._train

    @property
    def val_partition(self) -> PartitionData:
        """This rank's validation rows."""
        return self._val

    @property
    def collator(self) -> Collator:
        """Turns gathered rows into a :class:`~sparktrain.data.batch.Batch`."""
        return self._collator

    @property
    def store(self) -> CheckpointStore | None:
        """The checkpoint store of ``config.checkpoint_dir`` (None without one)."""
        return self._store

    @property
    def epoch_started(self) -> float:
        """``time.perf_counter()`` when the latest :meth:`batches` call began."""
        return self._epoch_started

    @property
    def distributed_step(self) -> DistributedStep | None:
        """The step :meth:`distributed` installed on the optimizer (None before)."""
        return self._distributed

    # ------------------------------------------------------------------ data
    @property
    def train_rows(self) -> int:
        """This rank's training rows."""
        return self._train.size

    @property
    def val_rows(self) -> int:
        """This rank's validation rows."""
        return self._val.size

    @overload
    def batches(
        self, epoch: int, *, start: int = 0, uneven: Literal["repeat"] = "repeat"
    ) -> Generator[Batch, None, None]: ...

    @overload
    def batches(
        self, epoch: int, *, start: int = 0, uneven: Literal["idle"]
    ) -> Generator[Batch | None, None, None]: ...

    def batches(
        self, epoch: int, *, start: int = 0, uneven: Literal["repeat", "idle"] = "repeat"
    ) -> Generator[Batch | None, None, None]:
        """This rank's training batches of ``epoch``: shuffled by ``(seed, rank,
        epoch)``, ``config.batch_size`` rows each, gathered (and decoded) on a
        background thread, from step ``start`` of the epoch on (a resume in the middle
        of an epoch). Every rank yields :attr:`steps_per_epoch` ``- start`` items. A rank
        with fewer rows than the largest either starts over from the beginning of its
        epoch's order (``uneven="repeat"``) or yields ``None`` for the steps it has no
        rows for (``uneven="idle"``; call ``optimizer.step()`` anyway: it joins the
        exchange with no rows, so every row of the epoch counts exactly once). With
        :meth:`distributed`, the batch that closes an accumulated step arms the
        gradient exchange to overlap with its backward."""
        cfg = self.config
        if uneven not in ("repeat", "idle"):
            raise ConfigError(f"batches(uneven={uneven!r}): use 'repeat' or 'idle'")
        if not 0 <= start <= self.steps_per_epoch:
            raise ConfigError(f"batches(start={start}): an epoch has {self.steps_per_epoch} steps")
        if self._train.size == 0 and uneven == "repeat":
            raise ConfigError(
                f"rank {self.rank} has no training rows: call batches() only with data "
                "(sparktrain.run(train_fn, data=...))"
            )
        rng = np.random.default_rng([cfg.seed, self.rank, epoch]) if cfg.shuffle else None
        order = list(
            epoch_batches(self._train.size, cfg.batch_size, rng, cfg.drop_last, cfg.shuffle_window)
        )
        plan: list[np.ndarray | None]
        if uneven == "idle":
            plan = [order[i] if i < len(order) else None for i in range(self.steps_per_epoch)]
        else:
            if not order:  # drop_last on a partition smaller than a batch
                order = list(epoch_batches(self._train.size, cfg.batch_size, rng))
            plan = [order[i % len(order)] for i in range(self.steps_per_epoch)]
        make = functools.partial(_gather, self._train, plan, self._collator, self.rank)
        if self.device.type != "cpu":  # the copy to the device on the prefetch thread too
            make = functools.partial(_on_device, make, self.device)
        wanted = [i for i in range(start, len(plan)) if plan[i] is not None]
        prefetch = Prefetcher(make, wanted, cfg.prefetch_batches)
        fault = self.task.job.fault
        self._epoch, self._epoch_started = epoch, time.perf_counter()
        step = self._distributed
        if step is not None:
            step.counts_rows = True
        try:
            for i in range(start, len(plan)):
                if fault is not None:
                    fault.maybe_fire(self.rank, self.global_step)
                batch = None if plan[i] is None else prefetch.next()
                self.global_step += 1
                step = self._distributed
                if step is not None:
                    step.counts_rows = True
                    step.closing = step.closes(i, len(plan))
                    if batch is not None:
                        step.add_rows(len(batch))
                        if step.closing:
                            step.arm()
                yield batch
        finally:
            prefetch.close()
            self.data_wait_s += prefetch.wait_s

    def val_batches(self, batch_size: int | None = None) -> Iterator[Batch]:
        """This rank's validation rows in order (a held-out ``validation_fraction``, or
        the rows of ``validation_data``); no collective, so ranks may hold different
        numbers of them."""
        size = batch_size or max(self.config.batch_size, 256)
        for start in range(0, self._val.size, size):
            idx = np.arange(start, min(start + size, self._val.size))
            yield self._val.batch(idx, self._collator, self.rank).to(self.device)

    def evaluate(
        self, model: nn.Module, metrics: Sequence[str | Callable[..., float]] | None = None
    ) -> dict[str, float]:
        """``metrics`` (default ``config.metrics``: ``accuracy``, ``top_k:K``,
        ``macro_f1``, ``auc``, ``log_loss``, ``rmse``, ``mae``, ``r2`` or callables) of
        ``model`` over every rank's validation rows, exact (a collective)."""
        chosen = list(metrics if metrics is not None else self.config.metrics)
        if not chosen:
            raise ConfigError(
                "ctx.evaluate needs metrics: ctx.evaluate(model, ['accuracy']) or "
                "config.metrics = ['accuracy', ...]"
            )
        width = np.zeros(1)
        if self._val.size:
            probe = self._val.batch(np.arange(1), self._collator, self.rank).to(self.device)
            with torch.no_grad(), self.autocast():
                out = forward(model, probe)
            width[0] = out.shape[1] if out.ndim == 2 else 1
        self._tree.allreduce_(width, add=_maximum)
        scores = Scores(
            chosen, num_outputs=max(1, int(width[0])), label_scale=self.task.job.label_scale
        )
        feed_scores(model, self._val, scores, self._collator, self.rank, self.autocast)
        return finish_scores(scores, self._tree)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over the ranks in place (``sum``, ``mean``, ``max``,
        ``min``) and return it; every rank gets bitwise the same result."""
        if op not in REDUCE_OPS:
            raise ConfigError(f"allreduce op={op!r}: use one of {', '.join(REDUCE_OPS)}")
        if tensor.device.type != "cpu":  # the wire reads host memory: through a copy
            host = self.allreduce(tensor.detach().cpu(), op)
            with torch.no_grad():
                tensor.copy_(host)
            return tensor
        started = time.perf_counter()
        if tensor.dtype in (torch.float32, torch.float64) and tensor.is_contiguous():
            buf = tensor.detach().reshape(-1).numpy()
            self._reduce_array(buf, op)
        else:  # integers, halves, strided: through a float64 copy
            flat = tensor.detach().to(torch.float64).contiguous().reshape(-1)
            self._reduce_array(flat.numpy(), op)
            with torch.no_grad():
                tensor.copy_(flat.reshape(tensor.shape).to(tensor.dtype))
        self.comm_s += time.perf_counter() - started
        return tensor

    def _reduce_array(self, buf: np.ndarray, op: str) -> None:
        if op in ("max", "min"):
            self._tree.allreduce_(buf, add=_maximum if op == "max" else _minimum)
            return
        if buf.nbytes <= _SMALL_BYTES:
            self._tree.allreduce_(buf)
        else:
            self._ring.allreduce_(buf)
        if op == "mean":
            buf /= self.world_size

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s, bitwise, and return it."""
        if not 0 <= src < self.world_size:
            raise ConfigError(f"broadcast src={src} is not a rank of a world of {self.world_size}")
        started = time.perf_counter()
        on_host = tensor.is_contiguous() and tensor.device.type == "cpu"
        target = tensor if on_host else tensor.detach().cpu().contiguous()
        view = byte_view(target)
        if src == 0:
            broadcast_(self._mesh, [view], chunk_bytes_for(self._mesh.max_frame_bytes))
        else:
            blobs = self._tree.allgather(view.copy(), max_bytes=view.nbytes)
            view[:] = blobs[src]
        if target is not tensor:
            with torch.no_grad():
                tensor.copy_(target)
        self.comm_s += time.perf_counter() - started
        return tensor

    def barrier(self) -> None:
        """Wait until every rank got here."""
        self._tree.allreduce_(np.zeros(1))

    # ------------------------------------------------------------------ reports
    def report(
        self,
        figures: Mapping[str, float] | None = None,
        /,
        *,
        reduce: Mapping[str, str] | None = None,
        **more: float,
    ) -> dict[str, Any]:
        """Record figures of this point of the run, as a mapping and/or keywords (every
        rank, the same names): each is reduced across ranks (``mean`` unless ``reduce``
        names ``sum``, ``max`` or ``min`` for it), added to :attr:`history`, sent to the
        driver (progress, ``metrics_jsonl``, callbacks, loggers), fed to early stopping
        (read :attr:`should_stop` and :attr:`improved` afterwards) and to a per-epoch
        learning-rate schedule. Returns the reduced record."""
        metrics = {**(figures or {}), **more}
        reduce = dict(reduce or {})
        names = sorted(metrics)
        for name, op in reduce.items():
            if name not in metrics or op not in REDUCE_OPS:
                raise ConfigError(
                    f"report reduce={{{name!r}: {op!r}}}: name a reported figure and one of "
                    f"{', '.join(REDUCE_OPS)}"
                )
        values = {}
        for name in names:
            value = metrics[name]
            if isinstance(value, torch.Tensor):
                value = value.item()
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ConfigError(f"report {name}={value!r}: report numbers only")
            values[name] = float(value)
        self._check_same_names(names, reduce)
        record: dict[str, Any] = {"epoch": len(self.history)}
        for op in REDUCE_OPS:
            group = [n for n in names if reduce.get(n, "mean") == op]
            if group:
                buf = np.array([values[n] for n in group], dtype=np.float64)
                self._reduce_array(buf, op)
                record.update(zip(group, buf.tolist(), strict=True))
        now = time.perf_counter()
        record["seconds"] = now - self._last_report
        self._last_report = now
        self.conclude(record)
        self.send({"type": "report", **record})
        return record

    def conclude(self, record: dict[str, Any]) -> bool:
        """Take ``record``, figures already the same on every rank, as the end of an
        epoch (every rank, a collective): early stopping decides (marking the record
        ``early_stop``), a per-epoch schedule steps, and the record joins
        :attr:`history`. Returns :attr:`should_stop`. :meth:`report` is this after
        reducing; the built-in loop reduces its own sums and calls it, then
        :meth:`send`."""
        self._decide_stop(record)
        if self._distributed is not None:
            self._distributed.end_epoch(record)  # a per-epoch schedule
        self.history.append(record)
        return self.should_stop

    def send(self, message: Mapping[str, Any]) -> None:
        """Hand ``message`` to the driver's metrics channel (rank 0 alone has one)."""
        if self._reporter is not None:
            self._reporter.send(dict(message))

    def progress(self, **figures: float) -> None:
        """A live update of the current epoch for the driver's progress display (e.g. the
        running loss): rank 0's figures as they are, no collective, at most a few times
        a second; other ranks' calls do nothing."""
        reporter = self._reporter
        if reporter is None or not reporter.step_due():
            return
        done = self.global_step - self._epoch * self.steps_per_epoch
        elapsed = max(time.perf_counter() - self._epoch_started, 1e-9)
        rows = sum(self.rows_per_rank)
        reporter.send(
            {
                "type": "step",
                "epoch": self._epoch,
                "step": done,
                "steps_per_epoch": self.steps_per_epoch,
                "samples_per_s": rows * done / max(1, self.steps_per_epoch) / elapsed,
                **figures,
            }
        )

    def _check_same_names(self, names: list[str], reduce: Mapping[str, str]) -> None:
        """Two tiny rounds so that ranks reporting different figures fail with an error
        instead of mismatched collectives."""
        key = json.dumps([names, sorted(reduce.items())]).encode()
        if not self._same_everywhere([float(zlib.crc32(key)), float(len(names))]):
            raise ConfigError(
                f"rank {self.rank} reported {names}, another rank other figures: every rank "
                "must call report() with the same names at the same points"
            )

    def _decide_stop(self, record: dict[str, Any]) -> None:
        """Rank 0 decides (early stopping), every rank learns it in the same call."""
        self.should_stop, self._improved = agree_to_stop(self._early, record, self.rank, self._tree)
        if self.should_stop:
            record["early_stop"] = True

    @property
    def improved(self) -> bool:
        """Did the last report set a new best for ``early_stopping.metric``? The same
        answer on every rank (keep-best checkpoints and models use it)."""
        return self._improved

    @property
    def early_stopping(self) -> EarlyStopping:
        """The early-stopping tracker (inactive without ``config.early_stopping``)."""
        return self._early

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, state: Mapping[str, Any], *, step: int | None = None) -> None:
        """Save ``state`` (tensors, state dicts, numbers, strings, lists, dicts) as a
        checkpoint in ``config.checkpoint_dir``, with the history so far. Call it on
        every rank at the same point: rank 0 writes the file, the other ranks their own
        compressor state when they have any. A restarted stage resumes from the newest
        one (:meth:`restore`). When the last report set early stopping's best, the
        checkpoint is also kept as the best (``CheckpointStore.load_best``), which pruning
        never removes. Without ``checkpoint_dir`` it does nothing."""
        store = self._store
        if store is None:
            return
        step = self._checkpoint_step(step)
        mine = self._distributed.rank_state() if self._distributed is not None else None
        if mine is not None:
            store.save_shard(step, self.rank, self.world_size, mine)
        extra: dict[str, Any] = {
            "run_state": dict(state),
            "global_step": self.global_step,
            "early_stopping": self._early.state_dict(),
        }
        if self._distributed is not None:
            extra["step_state"] = self._distributed.state_dict()
        if mine is not None:
            extra[RANK_SHARDS] = self.world_size
        if self.config.shard_optimizer and self._distributed is not None:
            extra[SHARDED_WORLD] = self.world_size
        if self.rank == 0:
            ckpt = Checkpoint(step, {}, {}, torch.get_rng_state(), list(self.history), extra)
            store.save(ckpt)
            if self.improved:  # keep-best: the state of early stopping's best report
                store.save_best(ckpt)
        self.barrier()  # a restart never finds a checkpoint some rank has not reached

    def _checkpoint_step(self, step: int | None) -> int:
        last = self._restored.step if self._restored is not None else 0
        last = max(last, self._last_ckpt_step)
        chosen = step if step is not None else max(self.global_step, last + 1)
        if chosen <= last:
            raise CheckpointError(
                f"checkpoint step {chosen} is not after the previous one ({last}): steps "
                "must increase"
            )
        self._last_ckpt_step = chosen
        return chosen

    def restore(self) -> dict[str, Any] | None:
        """The state of the checkpoint this stage resumes from (after a failure, or with
        ``config.resume``), or None when the run starts from scratch. Restores the
        history, the batch counter, early stopping and the distributed step's state
        (learning-rate schedule, gradient scaler, compressor state) as well."""
        ckpt = self._load_resume_checkpoint()
        if ckpt is None:
            return None
        self.history = list(ckpt.history)
        self.global_step = int(ckpt.extra.get("global_step", 0))
        self._early.load_state_dict(ckpt.extra.get("early_stopping", {}))
        if self._distributed is not None:
            self._load_step_state(ckpt)
        return dict(ckpt.extra["run_state"])

    def _load_step_state(self, ckpt: Checkpoint) -> None:
        assert self._distributed is not None
        check_sharded_resume(ckpt.extra, self.config.shard_optimizer, self.world_size, ckpt.step)
        shard = None
        if int(ckpt.extra.get(RANK_SHARDS, 0) or 0) == self.world_size and self._store is not None:
            shard = self._store.load_shard(ckpt.step, self.rank, self.world_size)
        self._distributed.load_state_dict(ckpt.extra.get("step_state") or {}, shard)

    def _load_resume_checkpoint(self) -> Checkpoint | None:
        step = self.task.job.resume_step
        if step is None or self._store is None:
            return None
        if self._restored is None:
            ckpt = self._store.load(step)
            if ckpt is None:
                raise CheckpointError(f"checkpoint of step {step} vanished from {self._store.uri}")
            if "run_state" not in ckpt.extra:
                raise CheckpointError(
                    f"the checkpoint of step {step} in {self._store.uri} was written by "
                    "Trainer.fit, not sparktrain.run: give run() a checkpoint_dir of its own"
                )
            self._restored = ckpt
        return self._restored

    # ------------------------------------------------------------------ data parallel
    def distributed(self, model: ModelT, optimizer: OptimizerT) -> tuple[ModelT, OptimizerT]:
        """Make ``model`` and ``optimizer`` data parallel: every replica starts from
        rank 0's weights, and ``optimizer.step()`` (after ``loss.backward()``) first
        averages the gradients over the ranks through the configured strategy (with its
        compression and overlap, weighted by each rank's batch rows), then applies the
        config's ``accumulate_steps``, gradient unscaling (``precision="fp16"``),
        ``clip_grad_norm`` and learning-rate schedule with warm-up. Returns the same two
        objects; ``optimizer`` keeps its class's behaviour otherwise (schedulers accept
        it). Use :meth:`backward` for the loss under ``precision="fp16"``."""
        if self._distributed is not None:
            raise ConfigError("ctx.distributed() was already called in this run")
        params = [p for p in model.parameters() if p.requires_grad]
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if {id(p) for p in params} != mine:
            raise ConfigError(
                "ctx.distributed(model, optimizer): the optimizer must hold exactly the "
                "model's trainable parameters (build it from model.parameters())"
            )
        task = self.task
        if task.job.ps_bootstrap:  # the parameter server starts from rank 0's model
            addresses, done = self._start_parameter_server(model, optimizer)
            spec = dataclasses.replace(task.job, ps_addresses=tuple(addresses), resume_step=done)
            task = dataclasses.replace(task, spec=spec)
        sync = make_sync(task, model, self._mesh)
        if not self._replicas_agree(model):  # e.g. built without a common seed
            start_from_rank0(model, self._mesh, chunk_bytes_for(self._mesh.max_frame_bytes))
        # the class first: the schedule's torch scheduler wraps the step it finds
        _make_distributed(optimizer)
        step = DistributedStep(
            sync,
            optimizer,
            params,
            self.config,
            self.device,
            steps_per_epoch=self.steps_per_epoch,
            counts_rows=False,  # until batches() announces rows
        )
        optimizer._sparktrain_step = step  # type: ignore[attr-defined]
        self._distributed = step
        if self._restored is not None:
            self._load_step_state(self._restored)
        return model, optimizer

    def _replicas_agree(self, model: nn.Module) -> bool:
        """Do all ranks hold bitwise the same parameters and buffers (same seed, same
        build)? Two tiny rounds of a checksum instead of broadcasting the whole model."""
        crc = 0
        for t in (*model.parameters(), *model.buffers()):
            crc = zlib.crc32(byte_view(t.detach().cpu().contiguous()).data, crc)
        return self._same_everywhere([float(crc)])

    def _same_everywhere(self, values: list[float]) -> bool:
        """Does every rank hold these values? (Their minimum and maximum over the ranks.)"""
        low, high = np.array(values), np.array(values)
        self._tree.allreduce_(low, add=_minimum)
        self._tree.allreduce_(high, add=_maximum)
        return bool(np.array_equal(low, high))

    def _start_parameter_server(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[list[str], int | None]:
        """Rank 0 describes the model and optimizer to the driver, which starts (or
        already runs) the server; every rank learns the shards' addresses and the
        server's completed step, or rank 0's error. The ``sparse=True`` tables go
        apart from the flat vector: the server holds them by rows, as the built-in
        loop's (the clients pick the same tables, :func:`served_tables`)."""
        from sparktrain.strategies.ps.bootstrap import optimizer_spec, request_server
        from sparktrain.strategies.ps.layout import dense_params, served_tables

        reply: dict[str, Any] = {}
        if self.rank == 0:
            spec = self.task.job
            try:
                named = served_tables(model, self.config.sparse_embeddings)
                params = dense_params(model, named)
                dtypes = {p.dtype for p in params} | {p.dtype for _, p in named}
                if dtypes - {torch.float32, torch.float64} or len(dtypes) != 1:
                    raise ConfigError(
                        f"strategy='ps' shards one float32 or float64 vector; the model's "
                        f"trainable parameters are {sorted(map(str, dtypes))}"
                    )
                dtype = next(iter(dtypes))
                flat = torch.cat(
                    [p.detach().reshape(-1) for p in params] or [torch.empty(0, dtype=dtype)]
                ).numpy()
                tables = [(name, p.detach().cpu().numpy()) for name, p in named]
                assert spec.ps_bootstrap is not None
                addresses, step = request_server(
                    spec.ps_bootstrap,
                    flat,
                    optimizer_spec(optimizer),
                    tables=tables,
                    secret=spec.secret,
                    job_id=spec.job_id,
                    attempt=spec.attempt,
                    timeout=self.config.comm_timeout,
                    security=spec.security,
                )
                reply = {"addresses": addresses, "step": step}
            except Exception as exc:  # every rank raises it, none waits for addresses
                reply = {"error": f"{type(exc).__name__}: {exc}"}
        mine = np.frombuffer(json.dumps(reply).encode(), dtype=np.uint8)
        got = json.loads(self._tree.allgather(mine, max_bytes=1 << 20)[0].tobytes())
        if "error" in got:
            raise ConfigError(f"the parameter server did not start: {got['error']}")
        return list(got["addresses"]), got["step"]

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The forward pass's autocast context for ``config.precision`` (a no-op for fp32)."""
        if self._distributed is not None:
            return self._distributed.precision.autocast()
        return Precision(self.config.precision, self.device).autocast()

    def backward(self, loss: torch.Tensor) -> float:
        """``loss.backward()``, scaled under ``precision="fp16"``; stops the run (on
        every rank, in the next exchange) when the loss is not finite. Returns the
        loss's value."""
        value = float(loss.detach())
        step = self._distributed
        precision = step.precision if step is not None else None
        finite = math.isfinite(value)
        if precision is not None:
            finite = precision.loss_is_finite(value)
        if not finite:
            done = max(0, self.global_step - 1)  # the batch of this loss
            raise diverged(
                f"on rank {self.rank}",
                done // max(1, self.steps_per_epoch),
                done % max(1, self.steps_per_epoch),
                self.steps_per_epoch,
                value,
                self.config.lr,
            )
        (precision.scale(loss) if precision is not None else loss).backward()
        return value

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Release the distributed step's threads; idempotent."""
        if self._distributed is not None:
            self._distributed.sync.close()

    def pull_returned_tables(self, value: Any) -> int:
        """Rank 0, its train_fn done: under ``strategy="ps"`` with row-served tables,
        pull the server's tables into the model when ``value`` (what rank 0 returns)
        holds one of their tensors (``model.state_dict()``): the local table only
        caches the rows this rank read. A value without them (figures, losses) costs
        nothing. Returns the rows pulled."""
        step = self._distributed
        sync = step.sync if step is not None else None
        refresh = getattr(sync, "refresh_tables", None)
        if refresh is None or not self.task.job.ps_bootstrap:
            return 0  # the built-in loop's driver takes the server's tables itself
        tables = {p.untyped_storage().data_ptr() for p in getattr(sync, "tables", [])}
        if not tables & _storages(value):
            return 0
        return int(refresh())

    def stats(self) -> dict[str, Any]:
        """This rank's figures for the run summary."""
        step = self._distributed
        out: dict[str, Any] = {
            "rank": self.rank,
            "train_rows": self._train.size,
            "steps_per_epoch": self.steps_per_epoch,
            "data_path": self._train.path,
            "spilled_bytes": self._train.spilled_bytes,
            "comm_s": self.comm_s + (step.comm_s if step is not None else 0.0),
            "data_wait_s": self.data_wait_s,
            "comm": self._mesh.stats.as_dict(),
        }
        if self._distributed is not None:
            out.update(self._distributed.stats())
        if self.placement is not None:
            out.update(self.placement.stats())
        return out


_DISTRIBUTED_CLASSES: dict[type, type] = {}


def _make_distributed(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` a subclass of its own class whose ``step()`` and
    ``zero_grad()`` go through its ``_sparktrain_step`` (a :class:`DistributedStep`):
    the object stays an instance of its class (LR schedulers and ``isinstance`` checks
    accept it) and keeps its state and groups."""
    base = type(optimizer)
    cls: Any = _DISTRIBUTED_CLASSES.get(base)
    if cls is None:

        def step_(self: Any, closure: Callable[[], float] | None = None) -> Any:
            inner = self._sparktrain_inner
            if callable(inner):  # a sharded step: the slices' optimizer steps instead
                return inner()
            if inner:  # the real step, from DistributedStep (or a scaler)
                return base.step(self, closure)
            self._sparktrain_step.step(closure)
            return None

        def zero_grad_(self: Any, set_to_none: bool = True) -> None:
            # set_to_none would unbind the gradients from the exchange buckets; within an
            # accumulated step the gradients must add up, so only a finished step zeroes
            if self._sparktrain_step.micro == 0:
                self._sparktrain_step.zero_grad()

        cls = type(
            f"Distributed{base.__name__}",
            (base,),
            # _sparktrain_base: the class a sharded step builds its slices' optimizer of
            {"step": step_, "zero_grad": zero_grad_, "_sparktrain_base": base},
        )
        _DISTRIBUTED_CLASSES[base] = cls
    optimizer._sparktrain_inner = False  # type: ignore[attr-defined]
    optimizer.__class__ = cls
    if "step" in vars(optimizer):
        # a torch LR scheduler made before distributed() bound the class's old step to
        # the instance: route it through the distributed one, still telling it a step ran
        def counted_step(*args: Any, **kwargs: Any) -> Any:
            optimizer._opt_called = True  # type: ignore[attr-defined]
            return cls.step(optimizer, *args, **kwargs)

        counted_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        optimizer.step = counted_step  # type: ignore[method-assign]


def _on_device(make: Callable[[int], Batch], device: torch.device, index: int) -> Batch:
    return make(index).to(device)


def _maximum(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.maximum(a, b, out=out)


def _minimum(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.minimum(a, b, out=out)


def _gather(
    data: PartitionData,
    plan: list[np.ndarray | None],
    collator: Collator,
    rank: int,
    index: int,
) -> Batch:
    rows = plan[index]
    assert rows is not None  # only steps with rows are gathered
    return data.batch(rows, collator, rank)


def _storages(value: Any, depth: int = 0) -> set[int]:
    """The storages of the tensors in ``value`` (dicts, lists, tuples of them), as far
    as :func:`~sparktrain.task.run_task.encode_value` walks (bounded depth)."""
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()}
    found: set[int] = set()
    if depth < 64 and isinstance(value, Mapping | list | tuple):
        for sub in value.values() if isinstance(value, Mapping) else value:
            found |= _storages(sub, depth + 1)
    return found
