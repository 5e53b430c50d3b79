"""What an optimizer does with the averaged rows of a ``sparse=True`` embedding table
(docs/sparse.md, "Optimizers").

After the exchange (``exchange.py``) a table's ``.grad`` is a coalesced sparse
COO tensor of the rows some rank touched, averaged exactly as a dense gradient would
be. Per optimizer:

- ``torch.optim.SGD`` without momentum and weight decay, ``torch.optim.Adagrad``
  (without weight decay, which torch refuses for sparse gradients too) and
  ``torch.optim.SparseAdam`` step the sparse gradient themselves: the numbers are
  torch's single-process ones;
- ``torch.optim.SGD`` with momentum or weight decay (torch cannot add weight decay to a
  sparse gradient, and its sparse momentum buffer grows without bound) steps a table
  **lazily**: only the touched rows ``I`` change, with the hyperparameters of the
  table's parameter group::

      g = grad[I] (negated with maximize) + weight_decay * w[I]
      buf[I] = momentum * buf[I] + (1 - dampening) * g     # buf starts at zero
      d = g + momentum * buf[I] if nesterov else buf[I]    # g without momentum
      w[I] -= lr * d

  ``buf`` is the table's ``momentum_buffer`` in the optimizer's state (dense, so it
  checkpoints like torch's). With every row touched and ``dampening=0`` this is torch's
  dense SGD; a row not touched keeps its weight and its buffer (torch's dense momentum
  would keep moving it);
- any other optimizer (Adam, AdamW, RMSprop, ...) takes dense gradients only: the
  averaged rows are scattered into a dense gradient and the optimizer steps the whole
  table, as it would in one process with ``sparse=False`` (the wire still carries rows).

``SparseAdam`` holding a dense parameter, and ``Adagrad`` with ``weight_decay`` on a
table, are refused when the step is built (:func:`check_optimizer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from sparktrain.errors import ConfigError

TORCH = "torch"
LAZY = "lazy"
DENSE = "dense"


def mode_of(group: dict[str, Any], optimizer: torch.optim.Optimizer) -> str:
    """How ``optimizer`` steps a table in parameter ``group``: ``"torch"`` (its own
    sparse step), ``"lazy"`` (momentum/weight-decay SGD, here) or ``"dense"``."""
    if isinstance(optimizer, torch.optim.SparseAdam | torch.optim.Adagrad):
        return TORCH
    if isinstance(optimizer, torch.optim.SGD):
        plain = group.get("momentum", 0) == 0 and group.get("weight_decay", 0) == 0
        return TORCH if plain else LAZY
    return DENSE


def check_optimizer(optimizer: torch.optim.Optimizer, tables: Sequence[nn.Parameter]) -> None:
    """Refuse the combinations torch leaves undefined for sparse tables, with what to do."""
    ids = {id(p) for p in tables}
    if not ids:
        return
    for group in optimizer.param_groups:
        mine = [p for p in group["params"] if id(p) in ids]
        if isinstance(optimizer, torch.optim.SparseAdam) and len(mine) != len(group["params"]):
            raise ConfigError(
                "SparseAdam steps sparse=True embedding tables only, and this optimizer also "
                "holds dense parameters: use Adagrad or SGD for the whole model, Adam (the "
                "tables' rows are then stepped densely), or sparse_embeddings='off'"
            )
        if isinstance(optimizer, torch.optim.Adagrad) and mine and group["weight_decay"]:
            raise ConfigError(
                "Adagrad's weight_decay is not defined for sparse gradients (torch refuses "
                "it too): set weight_decay=0, or build the embeddings with sparse=False"
            )


class SparseStepper:
    """Takes an optimizer step (``step_fn``) over a model with sparse tables according
    to each table's :func:`mode_of`; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, tables: Sequence[nn.Parameter]) -> None:
        check_optimizer(optimizer, tables)
        self.optimizer = optimizer
        ids = {id(p) for p in tables}
        self.modes: list[tuple[nn.Parameter, str, dict[str, Any]]] = [
            (p, mode_of(g, optimizer), g)
            for g in optimizer.param_groups
            for p in g["params"]
            if id(p) in ids
        ]

    def step(self, step_fn: Callable[[], bool | None]) -> bool:
        """Run ``step_fn`` (the optimizer's step, perhaps through the fp16 scaler:
        False = skipped) with the tables prepared per mode, then the lazy rows.
        Returns whether the step was taken."""
        held: list[tuple[nn.Parameter, torch.Tensor, dict[str, Any]]] = []
        for p, mode, group in self.modes:
            if p.grad is None:
                continue
            if mode == DENSE and p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            elif mode == LAZY:  # hidden from torch's step, which would step it densely
                held.append((p, p.grad, group))
                p.grad = None
        try:
            stepped = step_fn() is not False
        finally:
            for p, grad, _ in held:
                p.grad = grad
        if stepped:
            for p, grad, group in held:
                self._lazy_sgd(p, grad, group)
        return stepped

    def _lazy_sgd(self, p: nn.Parameter, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """The lazy SGD step of the touched rows (module docstring)."""
        if grad.is_sparse:
            g = grad.coalesce()
            idx, rows = g.indices()[0], g.values()
        else:  # a dense gradient on a table: its nonzero rows
            idx = torch.nonzero(grad.ne(0).any(dim=1)).reshape(-1)
            rows = grad[idx]
        if group.get("maximize", False):
            rows = -rows
        with torch.no_grad():
            weight = p.index_select(0, idx)
            wd = group.get("weight_decay", 0)
            if wd:
                rows = rows + wd * weight
            momentum = group.get("momentum", 0)
            if momentum:
                state = self.optimizer.state[p]
                buf = state.get("momentum_buffer")
                if buf is None or buf.is_sparse or buf.shape != p.shape:
                    buf = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["momentum_buffer"] = buf
                b = buf.index_select(0, idx).mul_(momentum)
                b.add_(rows, alpha=1 - group.get("dampening", 0))
                buf.index_copy_(0, idx, b)
                rows = rows.add(b, alpha=momentum) if group.get("nesterov", False) else b
            p.index_add_(0, idx, rows, alpha=-group["lr"])


def clip_grad_norm_(params: Sequence[nn.Parameter], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` (L2) over dense and sparse gradients alike
    (torch's has no kernel for a sparse COO gradient): the norm of a coalesced sparse
    gradient is that of its rows. Returns the total norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(g.is_sparse for g in grads):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    squares = 0.0
    for g in grads:
        if g.is_sparse:
            g = g.coalesce()  # duplicate ids would count twice
            squares += float(torch.linalg.vector_norm(g.values(), dtype=torch.float64)) ** 2
        else:
            squares += float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2
    total = math.sqrt(squares)
    coef = max_norm / (total + 1e-6)  # torch's epsilon
    if coef < 1:
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
    return total
