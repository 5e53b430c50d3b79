"""The learning-rate schedule of the training loop: a ``torch.optim.lr_scheduler`` class
by name, plus a linear warm-up.

The loop calls, per optimizer step and per epoch::

    schedule.before_step()
    precision.step(optimizer)     # also when the fp16 scaler then skips the step
    schedule.after_step()
    ...
    schedule.after_epoch(record)  # the epoch's reported figures

Warm-up scales the rate by ``(k + 1) / warmup_steps`` on optimizer step ``k <
warmup_steps``: the first step uses ``lr / warmup_steps``, step ``warmup_steps - 1`` the
full scheduled rate. Many torch schedulers are chainable (CosineAnnealingLR, StepLR, ...:
the next rate is computed from ``group["lr"]``), so the warm-up factor lives in
``group["lr"]`` only while the step runs: :meth:`LrSchedule.before_step` sets
``scheduled * factor`` and :meth:`LrSchedule.after_step` puts ``scheduled`` back before
the torch scheduler steps. The scheduler thus never sees a warmed rate.

A per-step schedule starts after the warm-up: it is not stepped during the warm-up
steps, so its step 0 is the first step after it, and its default length (cosine's
``T_max``, OneCycleLR's ``total_steps``, ...) is the run's steps minus the warm-up. The
schedule's curve is then run whole instead of having its head eaten by the ramp. A
per-epoch schedule steps every epoch from the start; the warm-up factor applies on top.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import lr_scheduler

from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError
from sparktrain.task.early_stop import default_mode

# schedules whose length defaults to the run's: the keyword that sets it
_LENGTH_KEYS = {
    "CosineAnnealingLR": "T_max",
    "LinearLR": "total_iters",
    "PolynomialLR": "total_iters",
}
# schedules that cycle momentum by default and refuse an optimizer without it
_CYCLERS = ("OneCycleLR", "CyclicLR")


class LrSchedule:
    """A named torch scheduler with warm-up, stepped per optimizer step or per epoch.

    ``steps_per_epoch`` counts optimizer steps (after gradient accumulation). With
    ``lr_schedule="none"`` and no warm-up every call is a cheap no-op; the state is still
    saved and loaded.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cfg: TrainConfig,
        *,
        steps_per_epoch: int,
        epochs: int,
    ) -> None:
        self.name = cfg.lr_schedule
        self.interval = cfg.lr_schedule_interval
        self.warmup_steps = cfg.warmup_steps
        self.monitor: str | None = None  # ReduceLROnPlateau's record key
        self._optimizer = optimizer
        self._step = 0  # optimizer steps taken
        self._held: list[Any] | None = None  # the scheduled rates while a warmed step runs
        self._scheduler: lr_scheduler.LRScheduler | None = None
        if self.name != "none":
            total = steps_per_epoch * epochs
            length = max(1, total - self.warmup_steps) if self.interval == "step" else epochs
            self._scheduler = self._build(dict(cfg.lr_schedule_kwargs), length)

    def _build(self, kwargs: dict[str, Any], length: int) -> lr_scheduler.LRScheduler:
        """The torch scheduler, with defaults filled so the bare name spans the run."""
        given = dict(kwargs)
        groups = self._optimizer.param_groups
        if self.name == "ReduceLROnPlateau":
            if self.interval != "epoch":
                raise ConfigError(
                    "lr_schedule='ReduceLROnPlateau' watches a metric reported once an epoch: "
                    "set lr_schedule_interval='epoch'"
                )
            self.monitor = str(kwargs.pop("monitor", "loss"))
            # torch's default mode is "min"; a monitored accuracy would then lower the
            # rate while it rises, so infer it from the name as early stopping does
            kwargs.setdefault("mode", default_mode(self.monitor))
        elif self.name in _LENGTH_KEYS:
            kwargs.setdefault(_LENGTH_KEYS[self.name], length)
        elif self.name == "OneCycleLR":
            if "total_steps" not in kwargs and "epochs" not in kwargs:
                kwargs["total_steps"] = length
            kwargs.setdefault("max_lr", [group["lr"] for group in groups])
        if self.name in _CYCLERS:
            # cycling momentum would switch it on for a plain SGD (and torch refuses
            # an optimizer with neither momentum nor betas), so cycle only existing ones
            kwargs.setdefault("cycle_momentum", _has_momentum(self._optimizer))
        cls = getattr(lr_scheduler, self.name)
        try:
            return cls(self._optimizer, **kwargs)
        except (TypeError, ValueError) as exc:
            filled = {k: v for k, v in kwargs.items() if k not in given}
            extra = f" (with defaults {filled!r})" if filled else ""
            raise ConfigError(
                f"lr_schedule={self.name!r} rejected lr_schedule_kwargs={given!r}{extra}: "
                f"{exc}. See torch.optim.lr_scheduler.{self.name} for its arguments"
            ) from exc

    # ------------------------------------------------------------------ stepping
    def before_step(self) -> None:
        """Right before ``optimizer.step()``: apply the warm-up factor to every group."""
        if self._step >= self.warmup_steps:
            return
        factor = (self._step + 1) / self.warmup_steps
        groups = self._optimizer.param_groups
        self._held = [group["lr"] for group in groups]
        for group, scheduled in zip(groups, self._held, strict=True):
            group["lr"] = scheduled * factor

    def after_step(self) -> None:
        """Right after ``optimizer.step()`` (skipped by the scaler or not): restore the
        scheduled rates, step a per-step schedule once the warm-up is over, count the step."""
        if self._held is not None:
            for group, scheduled in zip(self._optimizer.param_groups, self._held, strict=True):
                group["lr"] = scheduled
            self._held = None
        # a per-step schedule starts after the warm-up (see the module docstring)
        stepping = self.interval == "step" and self._step >= self.warmup_steps
        if self._scheduler is not None and stepping:
            self._scheduler.step()
        self._step += 1

    def after_epoch(self, record: Mapping[str, float]) -> None:
        """At the end of an epoch: step a per-epoch schedule; ReduceLROnPlateau reads
        ``record[monitor]``."""
        scheduler = self._scheduler
        if scheduler is None or self.interval != "epoch":
            return
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            monitor = str(self.monitor)
            if monitor not in record:
                raise ConfigError(
                    f"lr_schedule='ReduceLROnPlateau' monitors {monitor!r}, which the epoch's "
                    f"record lacks; it has: {', '.join(sorted(record)) or '(none)'}. Set "
                    "lr_schedule_kwargs.monitor to one of them"
                )
            scheduler.step(float(record[monitor]))
        else:
            scheduler.step()

    @property
    def lr(self) -> float:
        """The rate the next optimizer step uses (first group), warm-up included."""
        lr = float(self._optimizer.param_groups[0]["lr"])
        if self._held is not None or self._step >= self.warmup_steps:
            return lr  # already warmed by before_step, or past the warm-up
        return lr * ((self._step + 1) / self.warmup_steps)

    @property
    def steps(self) -> int:
        """Optimizer steps counted so far."""
        return self._step

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The step count, the groups' scheduled rates (chainable schedulers compute the
        next rate from them, so a resume with a fresh optimizer needs them) and the torch
        scheduler's state; a snapshot, unaffected by later steps."""
        groups = self._optimizer.param_groups
        scheduled = self._held if self._held is not None else [g["lr"] for g in groups]
        return {
            "name": self.name,
            "step": self._step,
            "lrs": list(scheduled),
            "scheduler": None
            if self._scheduler is None
            else copy.deepcopy(self._scheduler.state_dict()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next steps' rates are those the saved run
        would have used."""
        if state.get("name", self.name) != self.name:
            raise ConfigError(
                f"the checkpoint's learning-rate schedule is {state['name']!r}, the config's "
                f"lr_schedule is {self.name!r}: a schedule cannot continue as another; keep "
                "lr_schedule as it was, or start the run afresh (resume=false)"
            )
        lrs = list(state["lrs"])
        groups = self._optimizer.param_groups
        if len(lrs) != len(groups):
            raise ConfigError(
                f"the checkpoint's schedule has {len(lrs)} parameter groups, the optimizer "
                f"{len(groups)}: the optimizer must be built as in the saved run"
            )
        for group, lr in zip(groups, lrs, strict=True):
            group["lr"] = lr
        self._step = int(state["step"])
        self._held = None
        if self._scheduler is not None and state.get("scheduler") is not None:
            self._scheduler.load_state_dict(copy.deepcopy(dict(state["scheduler"])))


def _has_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer uses momentum (Adam's betas, or SGD's momentum > 0)."""
    return "betas" in optimizer.defaults or any(
        float(group.get("momentum", 0.0) or 0.0) > 0.0 for group in optimizer.param_groups
    )
