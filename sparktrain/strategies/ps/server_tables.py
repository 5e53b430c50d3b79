"""A shard's rows of a sparse embedding table and the optimizer that updates them.

With ``sparse_embeddings="auto"`` every ``sparse=True`` embedding table is split by rows
over the shards (:func:`~sparktrain.strategies.ps.layout.row_ranges`); each shard holds its rows in
a :class:`RowTable`. A step updates only the rows some rank touched: the job's own
``torch.optim`` optimizer (built as for the dense slice) steps a parameter that holds
just those rows, with the rows of its per-element state (momentum buffer, Adagrad's
sum, Adam's moments) gathered beside them, and both are scattered back. Scalar state
(Adam's and Adagrad's step count) is the table's and counts every step.

What that means per optimizer (docs/sparse_ps.md): plain SGD and Adagrad are exactly the
dense update (an untouched row's dense update is zero: ``lr * 0``, ``0 / (sqrt(sum) +
eps)``). Momentum, weight decay, Adam and AdamW become their *lazy* per-row variants: a
row's buffer decays, and decay applies, only in the steps that touch the row (as
TensorFlow's LazyAdam and torch's ``SparseAdam``); Adam's bias correction uses the
table's step count, so a row first touched late gets the late, small correction.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.builders import build_optimizer
from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError


class RowTable:
    """Rows ``[lo, hi)`` of the table ``name`` (``values`` is their ``[rows, dim]``
    copy), their optimizer and, in sync mode, the step's sample-weighted row sums."""

    def __init__(self, name: str, lo: int, hi: int, values: np.ndarray, cfg: TrainConfig):
        self.name = name
        self.lo, self.hi = lo, hi
        self.param = nn.Parameter(torch.from_numpy(np.ascontiguousarray(values).copy()))
        self.values: torch.Tensor = self.param.data  # the rows; the parameter swaps .data
        self.optimizer = build_optimizer(
            cfg.optimizer, [self.param], cfg.lr, dict(cfg.optimizer_kwargs)
        )
        self._acc: list[tuple[torch.Tensor, torch.Tensor]] = []  # sync: (ids, n_r * rows)

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """A copy of the rows ``ids`` (shard-local); the caller holds the shard's lock."""
        return self.values.index_select(0, ids)

    def accumulate(self, ids: torch.Tensor, rows: torch.Tensor, count: int) -> None:
        """Sync mode: add ``count * rows`` (one rank's mean gradient rows) to the step."""
        if ids.numel():
            self._acc.append((ids, rows * count))  # float ops as the dense ``_acc += g * n``

    def apply_accumulated(self, count: float, lrs: list[float]) -> None:
        """Sync mode: step with the sample-weighted mean of the step's rows (the sum of
        every rank's ``n_r * rows``, duplicates added, divided by the step's samples)."""
        parts, self._acc = self._acc, []
        if not parts:
            ids = torch.empty(0, dtype=torch.int64)
            grad = self.values.new_empty((0, self.dim))
        elif len(parts) == 1:
            ids, grad = parts[0][0], parts[0][1] / count
        else:
            summed = torch.sparse_coo_tensor(
                torch.cat([i for i, _ in parts]).unsqueeze(0),
                torch.cat([r for _, r in parts]),
                (self.rows, self.dim),
                check_invariants=False,  # the ids were checked in range on receipt
            ).coalesce()
            ids, grad = summed.indices()[0], summed.values() / count
        self.apply(ids, grad, lrs)

    def clear(self) -> None:
        """Drop the unfinished step's sums (a new stage attempt pushes it again)."""
        self._acc = []

    def apply(self, ids: torch.Tensor, grad: torch.Tensor, lrs: list[float]) -> None:
        """One optimizer step on the rows ``ids`` (ascending, each once) with gradient
        rows ``grad``, at the rates ``lrs`` (one per parameter group)."""
        p, opt = self.param, self.optimizer
        full = self.values
        state = opt.state.get(p, {})
        rowwise = {k for k, v in state.items() if _is_rows(v, full)}
        opt.state[p] = {k: v.index_select(0, ids) if k in rowwise else v for k, v in state.items()}
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = lr
        p.grad = None  # a gradient must match the data's shape, which changes here
        p.data = full.index_select(0, ids)
        try:
            p.grad = grad.to(full.dtype)
            opt.step()
            full.index_copy_(0, ids, p.data)
            merged: dict[str, Any] = {}
            for k, v in opt.state[p].items():
                if k in rowwise:
                    merged[k] = state[k].index_copy_(0, ids, v)
                elif isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == p.data.shape:
                    # state the optimizer creates on its first step (momentum buffer, Adam's
                    # moments): zeros for the rows never touched yet
                    merged[k] = torch.zeros_like(full).index_copy_(0, ids, v)
                else:
                    merged[k] = v
            opt.state[p] = merged
        finally:
            p.grad = None
            p.data = full

    def state(self) -> dict[str, Any]:
        """A copy of the rows and the optimizer's state (the caller holds the lock)."""
        optimizer = clone_state(self.optimizer.state_dict())
        return {"values": self.values.clone(), "optimizer": optimizer}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` (the same table and row range)."""
        values = state["values"]
        if tuple(values.shape) != tuple(self.values.shape) or values.dtype != self.values.dtype:
            raise ConfigError(
                f"the checkpoint's rows of table {self.name!r} have shape {tuple(values.shape)} "
                f"{values.dtype}, this server's {tuple(self.values.shape)} {self.values.dtype}: "
                "resume with the same model and ps_shards"
            )
        self.values.copy_(values)
        self.optimizer.load_state_dict(state["optimizer"])
        self._acc = []


def _is_rows(value: Any, full: torch.Tensor) -> bool:
    """Is ``value`` per-row state of the table (shaped like it)?"""
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == full.shape


def clone_state(value: Any) -> Any:
    """A deep copy of an optimizer state dict's tensors (the live ones keep changing)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clone_state(v) for v in value]
    return value
