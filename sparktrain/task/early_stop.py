"""Early stopping on a reported metric, as the config's ``early_stopping`` table describes.

The loop feeds one record per epoch (or per report under ``sparktrain.run``) to
:meth:`EarlyStopping.update`; it says when to stop, and :attr:`EarlyStopping.improved`
tells a keep-best checkpoint when the record was a new best. Improvement follows Keras:
in ``min`` mode a value must be below ``best - min_delta``, in ``max`` mode above
``best + min_delta``; the first finite value always sets the best. Decided on rank 0;
the loop makes every rank agree on the step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from sparktrain.errors import ConfigError
from sparktrain.wire import TreeAllreduce

# Metric names that are errors to minimise, as the config docstring lists them.
_MIN_HINTS = ("loss", "rmse", "mae", "error")
# The documented defaults ({metric = "accuracy", mode = "max", patience = 3, ...}).
DEFAULT_PATIENCE = 3


def default_mode(metric: str) -> str:
    """``"min"`` for names containing ``loss``, ``rmse``, ``mae`` or ``error``, else
    ``"max"`` (accuracy, f1, auc, r2, ...)."""
    name = metric.lower()
    return "min" if any(hint in name for hint in _MIN_HINTS) else "max"


class EarlyStopping:
    """Stop when ``metric`` has not improved by more than ``min_delta`` for ``patience``
    consecutive records. An empty table is inactive: :meth:`update` never stops.

    A NaN or infinite value counts as no improvement (it never becomes the best, so
    :attr:`best` stays finite and the state JSON-able).
    """

    def __init__(self, table: Mapping[str, Any]) -> None:
        self.active: bool = bool(table)
        self.metric: str = str(table.get("metric", ""))
        self.mode: str = str(table.get("mode") or default_mode(self.metric))
        self.patience: int = int(table.get("patience", DEFAULT_PATIENCE))
        self.min_delta: float = float(table.get("min_delta", 0.0))
        self.restore_best: bool = bool(table.get("restore_best", False))
        self.best: float | None = None
        self.best_index: int | None = None
        self.stopped_at: int | None = None
        self._seen = 0  # records fed so far
        self._wait = 0  # consecutive records without improvement
        self._improved = False

    @property
    def improved(self) -> bool:
        """Whether the last :meth:`update` set a new best."""
        return self._improved

    def summary(self, *, restored: bool = False) -> dict[str, Any]:
        """Where it stood at the end of the run, for the run summary (``restored``: the
        returned model is the best record's)."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "patience": self.patience,
            "best": self.best,
            "best_epoch": self.best_index,
            "stopped_at": self.stopped_at,
            "restored_best": restored,
        }

    def update(self, record: Mapping[str, Any]) -> bool:
        """Feed one record; True when the run should stop now (and on every later call)."""
        if not self.active:
            return False
        value = self._value(record)
        index = self._seen
        self._seen += 1
        self._improved = math.isfinite(value) and self._better(value)
        if self._improved:
            self.best, self.best_index, self._wait = value, index, 0
        else:
            self._wait += 1
        if self.stopped_at is None and self._wait >= self.patience:
            self.stopped_at = index
        return self.stopped_at is not None

    def _better(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _value(self, record: Mapping[str, Any]) -> float:
        raw = record.get(self.metric)
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return float(raw)
        numeric = sorted(
            k for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)
        )
        what = "is missing from" if self.metric not in record else f"is {raw!r} in"
        raise ConfigError(
            f"early_stopping.metric={self.metric!r} {what} the reported record; its numeric "
            f"keys are: {', '.join(numeric) or '(none)'}. Set early_stopping.metric to one of "
            "them (or add the metric to `metrics`)"
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The progress so far, JSON-able (for checkpoints)."""
        return {
            "metric": self.metric,
            "mode": self.mode,
            "best": self.best,
            "best_index": self.best_index,
            "stopped_at": self.stopped_at,
            "seen": self._seen,
            "wait": self._wait,
            "improved": self._improved,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`. A state kept for another metric or mode (the
        config changed between runs) is ignored: its best says nothing about this one."""
        if state.get("metric") != self.metric or state.get("mode") != self.mode:
            return
        best = state.get("best")
        self.best = None if best is None else float(best)
        self.best_index = state.get("best_index")
        self.stopped_at = state.get("stopped_at")
        self._seen = int(state.get("seen", 0))
        self._wait = int(state.get("wait", 0))
        self._improved = bool(state.get("improved", False))


def agree_to_stop(
    early: EarlyStopping, record: dict[str, Any], rank: int, tree: TreeAllreduce
) -> tuple[bool, bool]:
    """Early stopping: rank 0 decides on the epoch's figures, every rank learns in the
    same epoch whether to stop and whether this record is the new best (one tiny
    allreduce; none without early stopping). Returns (stop, improved)."""
    if not early.active:
        return False, False
    flags = np.zeros(2)
    if rank == 0:
        flags[0] = float(early.update(record))
        flags[1] = float(early.improved)
    tree.allreduce_(flags)
    return bool(flags[0]), bool(flags[1])
