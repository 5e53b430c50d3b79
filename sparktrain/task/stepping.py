"""One optimizer step after ``backward()``, the same for the built-in loop and for
``ctx.distributed`` under :func:`sparktrain.run`.

A step may span ``accumulate_steps`` micro-batches. On the micro-batch that closes it
the loop arms the exchange (:meth:`DistributedStep.arm`, so gradient hooks can start it
during that backward), then :meth:`DistributedStep.step`:

1. average the gradients over the ranks, weighted by rows (the strategy's sync);
2. turn the summed micro-batch means back into one mean (divide by the micro-batches):
   each rank its own sum, before the exchange (with ring or tree, inside it), so ranks
   that filled different numbers of micro-batches in an epoch's last step still receive
   the same average;
3. unscale them (``precision="fp16"``) and clip them to ``clip_grad_norm``: after
   averaging, so every replica clips the same numbers alike;
4. step the optimizer (the fp16 scaler may skip a step whose gradients overflowed: the
   same on every rank, since the averaged gradients are) and the learning-rate schedule.

With the parameter server the optimizer lives in the driver: the averaged step is the
server's. The local optimizer then only carries the learning rate: the schedule moves
it here and every push tells the server the step's rate. Clipping after averaging and
the fp16 scaler would have to run in the server, so the strategy refuses them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError
from sparktrain.sparse.stepper import SparseStepper, clip_grad_norm_
from sparktrain.task.lr_schedule import LrSchedule
from sparktrain.task.precision import Precision
from sparktrain.task.sharded import ShardedSync
from sparktrain.task.step_sync import AllreduceSync, StepSync, load_rank_state, rank_state


class DistributedStep:
    """Accumulation, averaging, unscaling, clipping, the step and the schedule."""

    def __init__(
        self,
        sync: StepSync,
        optimizer: torch.optim.Optimizer,
        params: list[nn.Parameter],
        cfg: TrainConfig,
        device: torch.device,
        *,
        steps_per_epoch: int,
        counts_rows: bool = True,
    ) -> None:
        self.sync = sync
        # weigh each rank by the rows add_rows() announced; False: every step() is one
        # micro-batch of weight 1 (a train_fn feeding batches of its own)
        self.counts_rows = counts_rows
        self.optimizer = optimizer
        # the parameter server steps (sync.optimizer None): the local optimizer's groups
        # only carry the scheduled rate to the server
        self.local = sync.optimizer is not None
        self.params = params
        self.accumulate = cfg.accumulate_steps
        self.clip = float(cfg.clip_grad_norm)
        self.precision = Precision(cfg.precision, device, skip_limit=cfg.fp16_skip_limit)
        self.schedule = LrSchedule(
            optimizer,
            cfg,
            steps_per_epoch=max(1, -(-steps_per_epoch // self.accumulate)),
            epochs=cfg.epochs,
        )
        self.micro = 0  # micro-batches since the last step
        self.filled = 0  # of them, the ones with rows on this rank
        self.rows = 0  # their rows on this rank
        self.armed = False
        # the loop's next step() closes the accumulated step even without an armed
        # exchange (a rank out of rows at the epoch's end still joins it)
        self.closing = False
        self.steps = 0
        self.comm_s = 0.0
        if isinstance(sync, ShardedSync):  # its slices step with this optimizer's class
            sync.attach(optimizer)
        # sparse=True embedding tables on the row path: how this optimizer steps them
        tables = sync.sparse_params if isinstance(sync, AllreduceSync) else []
        self.sparse = SparseStepper(optimizer, tables) if tables else None
        self._tables = {id(p) for p in tables}

    def closes(self, index: int, steps_per_epoch: int) -> bool:
        """Does micro-batch ``index`` of an epoch close an accumulated step (the same
        answer on every rank)?"""
        return (index + 1) % self.accumulate == 0 or index == steps_per_epoch - 1

    def add_rows(self, rows: int) -> None:
        """A micro-batch of ``rows`` rows of this rank is about to go through backward."""
        self.rows += rows
        self.filled += 1

    def arm(self) -> None:
        """Before the closing micro-batch's backward: let gradient hooks start the
        exchange of this step's rows (overlap)."""
        if self.armed:
            return
        if not self.local:
            if self.accumulate > 1:
                return  # pushes start in backward: they would send the sum of the means
            self._send_rate()
        self.armed = True
        if isinstance(self.sync, AllreduceSync):
            self.sync.begin_step(self.rows, self.filled)
        else:
            self.sync.begin_step(self.rows)

    def step(self, closure: Callable[[], float] | None = None, *, force: bool = False) -> bool:
        """One micro-batch's backward is done: exchange and step when it closes the
        accumulated step (armed, ``force``, or the ``accumulate_steps``-th); returns
        whether the parameters changed."""
        if closure is not None:
            raise ConfigError("a distributed optimizer's step() takes no closure")
        self.micro += 1
        if not (self.armed or force or self.closing or self.micro >= self.accumulate):
            return False
        # the gradients hold one mean per micro-batch with rows (a rank out of rows in
        # the epoch's last step has fewer)
        rows, micro = self.rows, self.filled
        if not self.counts_rows:
            rows = micro = self.micro
        self.micro = self.rows = self.filled = 0
        self.armed = self.closing = False
        started = time.perf_counter()
        if not self.local:  # parameter server: push the mean, pull the weights
            self._to_one_mean(micro)
            self._send_rate()
            self.sync.step(rows)
            self.comm_s += time.perf_counter() - started
            self.schedule.after_step()
            self.steps += 1
            return True
        if not isinstance(self.sync, AllreduceSync):
            return self._plugin_step(rows, micro, started)
        if isinstance(self.sync, ShardedSync):
            return self._sharded_step(self.sync, rows, micro, started)
        self.sync.reduce(rows, micro)
        self.comm_s += time.perf_counter() - started
        self.precision.unscale_(self.optimizer)
        if self.clip > 0:
            clip_grad_norm_(self.params, self.clip)  # the tables' rows included
        self.schedule.before_step()
        self.optimizer._sparktrain_inner = True  # type: ignore[attr-defined]
        try:
            if self.sparse is None:
                stepped = self.precision.step(self.optimizer)
            else:
                stepped = self.sparse.step(lambda: self.precision.step(self.optimizer))
        finally:
            self.optimizer._sparktrain_inner = False  # type: ignore[attr-defined]
        self.schedule.after_step()
        self.zero_grad()
        self.steps += 1
        return stepped

    def _sharded_step(self, sync: ShardedSync, rows: int, micro: int, started: float) -> bool:
        """The same steps as the unsharded path on this rank's slices only (ZeRO-1):
        reduce-scatter and divide, one mean, clip by the global norm, step the slices'
        optimizer, all-gather the parameters."""
        sync.reduce(rows, micro)
        self.comm_s += time.perf_counter() - started
        if self.clip > 0:
            sync.clip_grad_norm_(self.clip)
        self.schedule.before_step()
        # through the optimizer's own step(), so a torch LR scheduler sees a step
        self.optimizer._sparktrain_inner = sync.step_owned  # type: ignore[attr-defined]
        try:
            self.optimizer.step()
        finally:
            self.optimizer._sparktrain_inner = False  # type: ignore[attr-defined]
        gathered = time.perf_counter()
        sync.gather()
        self.comm_s += time.perf_counter() - gathered
        self.schedule.after_step()
        self.zero_grad()
        self.steps += 1
        return True

    def _plugin_step(self, rows: int, micro: int, started: float) -> bool:
        """A plug-in strategy's sync averages and steps in one ``step(count)``, with
        ``sync.optimizer``: it steps this step's optimizer (a ``train_fn``'s own under
        ``sparktrain.run``) at the scheduled rate. Clipping and the fp16 scaler need the
        averaged gradients before the step, which such a sync does not expose."""
        if self.clip > 0 or self.precision.precision == "fp16":
            raise ConfigError(
                f"strategy={type(self.sync).__name__} steps in its own sync: clip_grad_norm "
                "and precision='fp16' need strategy='ring' or 'tree'"
            )
        self._to_one_mean(micro)
        self.sync.optimizer = self.optimizer  # type: ignore[misc]
        self.schedule.before_step()
        self.optimizer._sparktrain_inner = True  # type: ignore[attr-defined]
        try:
            self.sync.step(rows)
        finally:
            self.optimizer._sparktrain_inner = False  # type: ignore[attr-defined]
        self.comm_s += time.perf_counter() - started
        self.schedule.after_step()
        self.zero_grad()
        self.steps += 1
        return True

    def _send_rate(self) -> None:
        """The parameter server steps at the rate this rank's schedule gives the step
        (the optimizer's first group: a user's own torch scheduler moves it too)."""
        if hasattr(self.sync, "lr"):
            self.sync.lr = self.schedule.lr

    def _to_one_mean(self, micro: int) -> None:
        """Averaged sums of ``micro`` micro-batch means, back to one mean."""
        if micro <= 1:
            return
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(micro)

    def zero_grad(self) -> None:
        """Zero in place (the gradients are views into the exchange buckets); a sparse
        table's gradient is dropped (the next backward starts it afresh)."""
        for p in self.params:
            if p.grad is not None:
                if id(p) in self._tables or p.grad.is_sparse:
                    p.grad = None
                else:
                    p.grad.zero_()

    def end_epoch(self, record: Mapping[str, Any]) -> None:
        """An epoch (a report, under ``sparktrain.run``) ended: a per-epoch schedule steps."""
        self.schedule.after_epoch(record)

    @property
    def lr(self) -> float:
        """The rate the next step uses."""
        return self.schedule.lr

    def state_dict(self) -> dict[str, Any]:
        """Schedule and scaler state, for checkpoints."""
        return {"precision": self.precision.state_dict(), "schedule": self.schedule.state_dict()}

    def rank_state(self) -> dict[str, Any] | None:
        """This rank's own state (compressor residuals), or None."""
        return rank_state(self.sync)

    def load_state_dict(self, state: Mapping[str, Any], shard: dict[str, Any] | None) -> None:
        """Continue from :meth:`state_dict` and this rank's :meth:`rank_state`."""
        if "precision" in state:
            self.precision.load_state_dict(state["precision"])
        if "schedule" in state:
            self.schedule.load_state_dict(state["schedule"])
        if shard is not None:
            load_rank_state(self.sync, shard)

    def stats(self) -> dict[str, Any]:
        """The sync's figures plus the precision's."""
        return {**self.sync.stats(), **self.precision.describe()}
