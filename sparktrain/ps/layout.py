"""The flat parameter vector and how it is split into shards.

Workers and the server see the model's trainable parameters, in ``model.parameters()``
order, as one flat vector. Shard ``i`` owns the contiguous range ``ranges[i]`` of it.
The split is at element granularity, so the shards are balanced by bytes to within one
element whatever the layer sizes (a split at parameter boundaries would leave one shard
with most of an MLP's weights). That is exact for the element-wise optimizers we name
(SGD with momentum/nesterov/weight decay, Adam, AdamW): an optimizer step on a slice of
the flat vector equals the same step on the parameters. An optimizer callable that
mixes elements across a parameter (LARS, LAMB, L-BFGS...) would see different slices
than on the ring.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from sparktrain.errors import ConfigError

NUMPY_DTYPES: dict[torch.dtype, type[np.floating]] = {
    torch.float32: np.float32,
    torch.float64: np.float64,
}


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the PS owns, in the order every process agrees on."""
    return [p for p in model.parameters() if p.requires_grad]


def flat_dtype(params: list[nn.Parameter]) -> torch.dtype:
    """The one dtype of the flat vector (float32 or float64; mixed dtypes are refused)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or next(iter(dtypes)) not in NUMPY_DTYPES:
        raise ConfigError(
            f"strategy='ps' needs all trainable parameters in one dtype, float32 or float64; "
            f"this model has {sorted(str(d) for d in dtypes)}"
        )
    return next(iter(dtypes))


def shard_ranges(num_elements: int, shards: int) -> list[tuple[int, int]]:
    """Split ``num_elements`` into ``shards`` contiguous ``(lo, hi)`` ranges whose sizes
    differ by at most one element (equal bytes, as the dtype is uniform)."""
    if shards < 1:
        raise ConfigError(f"ps_shards={shards} must be an integer >= 1")
    if shards > num_elements:
        raise ConfigError(
            f"ps_shards={shards} is more than the model's {num_elements} parameter elements; "
            f"use at most {num_elements} shards"
        )
    base, extra = divmod(num_elements, shards)
    ranges, lo = [], 0
    for i in range(shards):
        hi = lo + base + (1 if i < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def flatten(params: list[nn.Parameter], out: np.ndarray, grads: bool = False) -> None:
    """Copy the parameters (or their gradients; a missing gradient is zeros) into ``out``."""
    flat = torch.from_numpy(out)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            view = flat[offset : offset + n]
            if grads:
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.reshape(-1))
            else:
                view.copy_(p.detach().reshape(-1))
            offset += n


def unflatten(flat: np.ndarray, params: list[nn.Parameter]) -> None:
    """Copy the flat vector back into the parameters."""
    source = torch.from_numpy(flat)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(source[offset : offset + n].view_as(p))
            offset += n
