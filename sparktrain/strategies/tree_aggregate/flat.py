"""The trainable parameters as one flat float32 vector, and back.

tree_aggregate moves weights, gradients and deltas as flat vectors: the driver flattens
its model's weights for a round and assigns the summed gradient (or delta) back, every
task assigns the round's weights to its cached model and flattens what it computed. The
order is the parameters' order in the list given, which every side takes from
``model.parameters()``. Both sides use this module: nothing here imports pyspark.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


def num_elements(params: Sequence[torch.Tensor]) -> int:
    """The length of the flat vector of ``params``."""
    return sum(p.numel() for p in params)


def flatten(params: Sequence[torch.Tensor], out: np.ndarray | None = None) -> np.ndarray:
    """Parameters (in order) as one contiguous float32 vector."""
    return _gather(params, out, grads=False)


def assign(params: Sequence[torch.Tensor], vec: np.ndarray) -> None:
    """Copy a flat vector (from :func:`flatten`) back into the parameters."""
    if vec.size != num_elements(params):
        raise ValueError(
            f"flat vector has {vec.size} values, the parameters {num_elements(params)}"
        )
    flat = torch.from_numpy(np.ascontiguousarray(vec, dtype=np.float32))
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def flatten_grads(params: Sequence[torch.Tensor], out: np.ndarray | None = None) -> np.ndarray:
    """Gradients as one float32 vector (zeros where a parameter has no gradient)."""
    return _gather(params, out, grads=True)


def _gather(params: Sequence[torch.Tensor], out: np.ndarray | None, grads: bool) -> np.ndarray:
    """The parameters (or their gradients) copied into ``out``, a new float32 vector if None."""
    if out is None:
        out = np.empty(num_elements(params), dtype=np.float32)
    flat = torch.from_numpy(out)
    offset = 0
    for p in params:
        n = p.numel()
        view = flat[offset : offset + n]
        if not grads:
            view.copy_(p.detach().reshape(-1))
        elif p.grad is None:
            view.zero_()
        else:
            view.copy_(p.grad.reshape(-1))
        offset += n
    return out


def assign_grads(params: Sequence[nn.Parameter], vec: np.ndarray) -> None:
    """Set every parameter's ``.grad`` from a flat vector."""
    flat = torch.from_numpy(np.ascontiguousarray(vec, dtype=np.float32))
    offset = 0
    for p in params:
        n = p.numel()
        g = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
        offset += n
