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
    return row_ranges(num_elements, shards)


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


def served_tables(model: nn.Module, sparse_embeddings: str) -> list[tuple[str, nn.Parameter]]:
    """The embedding tables the server holds by rows (``sparse_embeddings="auto"``: the
    ``sparse=True`` ones, :func:`~sparktrain.sparse.rows.sparse_parameters`),
    ``(name, weight)`` in ``named_parameters`` order; none with ``"off"`` (they stay in
    the flat vector, whole)."""
    if sparse_embeddings == "off":
        return []
    from sparktrain.sparse.rows import sparse_parameters

    for m in model.modules():
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse and m.max_norm is not None:
            raise ConfigError(
                f"a sparse=True embedding with max_norm={m.max_norm} renormalises the rows it "
                "reads inside its forward, on this rank's copy only: strategy='ps' keeps the "
                "table on the server, so drop max_norm or set sparse_embeddings='off'"
            )
    tables = sparse_parameters(model)
    for name, p in tables:
        if p.dim() != 2:
            raise ConfigError(f"the sparse embedding {name!r} has shape {tuple(p.shape)}, not 2-D")
    return tables


def dense_params(model: nn.Module, tables: list[tuple[str, nn.Parameter]]) -> list[nn.Parameter]:
    """The flat vector's parameters: :func:`trainable` without the row-served tables."""
    served = {id(p) for _, p in tables}
    return [p for p in trainable(model) if id(p) not in served]


def row_ranges(rows: int, shards: int) -> list[tuple[int, int]]:
    """Split a table's ``rows`` into ``shards`` contiguous ``(lo, hi)`` row ranges whose
    sizes differ by at most one (a shard may own none of a small table's rows)."""
    base, extra = divmod(rows, shards)
    ranges, lo = [], 0
    for i in range(shards):
        hi = lo + base + (1 if i < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def dense_ranges(num_elements: int, shards: int, has_tables: bool) -> list[tuple[int, int]]:
    """The shards' ranges of the flat (dense) vector: :func:`shard_ranges`, except that
    with row-served tables every shard also holds table rows, so a shard may own no
    dense element (a model of embeddings alone has an empty flat vector)."""
    if has_tables and shards >= 1:
        return row_ranges(num_elements, shards)
    return shard_ranges(num_elements, shards)
