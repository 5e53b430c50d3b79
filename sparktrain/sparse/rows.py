"""Embedding tables whose gradients are rows: which parameters they are, and a gradient
as (indices, rows).

An ``nn.Embedding``/``nn.EmbeddingBag`` built with ``sparse=True`` gives its weight a
sparse COO gradient that holds only the rows the step's ids touched. The strategies
exchange those rows instead of the whole table (docs/sparse.md); this module is what
their worker halves share.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def sparse_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable weights of ``model``'s embeddings built with ``sparse=True``, as
    ``(name, parameter)`` in ``named_parameters`` order (a tied weight once)."""
    sparse_ids = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse
    }
    return [
        (name, p) for name, p in model.named_parameters() if p.requires_grad and id(p) in sparse_ids
    ]


def rows_of(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse COO gradient of an embedding table as coalesced ``(indices, rows)``:
    int64 row ids in ascending order, each once, and their summed gradient rows
    (``[k, dim]``). A dense gradient is refused: the caller decides what a dense one
    means."""
    if not grad.is_sparse:
        raise TypeError("rows_of takes a sparse COO gradient (an embedding with sparse=True)")
    g = grad.coalesce()
    indices = g.indices()
    if indices.shape[0] != 1:
        raise ValueError(
            f"an embedding gradient is sparse in its first dimension only, got {indices.shape[0]}"
        )
    return indices[0].to(torch.int64), g.values()


def encode_rows(tables: list[tuple[torch.Tensor, torch.Tensor]], count: float) -> np.ndarray:
    """Pack several tables' ``(indices, rows)`` and the sender's sample count into one
    byte blob (1-D uint8) for an allgather: a float64 count, then per table an int64
    row count ``k``, ``k`` int64 indices and ``k`` rows in the table's dtype. Tensors
    are copied once into the blob (no Python loop over rows)."""
    parts: list[np.ndarray] = [np.array([count], dtype=np.float64).view(np.uint8)]
    for indices, rows in tables:
        idx = indices.detach().cpu().to(torch.int64).contiguous().numpy()
        parts.append(np.array([idx.size], dtype=np.int64).view(np.uint8))
        parts.append(idx.view(np.uint8))
        # as bytes, so bfloat16 rows travel too (numpy has no such dtype)
        parts.append(rows.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return np.concatenate(parts)


def decode_rows(
    blob: np.ndarray, shapes: list[tuple[int, int]], dtypes: list[torch.dtype]
) -> tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Inverse of :func:`encode_rows` for tables of ``shapes`` (``(rows, dim)``) and
    ``dtypes``: the count and per table ``(indices, rows)``. A blob that does not
    match (truncated, an index out of the table) raises ValueError."""
    offset = 8
    if blob.size < offset:
        raise ValueError(f"a sparse-rows message of {blob.size} bytes has no header")
    if not blob.flags.writeable:  # received bytes: torch views need writable memory
        blob = blob.copy()
    count = float(blob[:8].view(np.float64)[0])
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for (num_rows, dim), dtype in zip(shapes, dtypes, strict=True):
        if blob.size < offset + 8:
            raise ValueError("a sparse-rows message ends inside a table header")
        k = int(blob[offset : offset + 8].view(np.int64)[0])
        itemsize = torch.empty((), dtype=dtype).element_size()
        end = offset + 8 + 8 * k + k * dim * itemsize
        if k < 0 or end > blob.size:
            raise ValueError(f"a sparse-rows message announces {k} rows it does not hold")
        idx = torch.from_numpy(blob[offset + 8 : offset + 8 + 8 * k].view(np.int64))
        if k * dim == 0:
            rows = torch.zeros((k, dim), dtype=dtype)
        else:
            rows = torch.frombuffer(
                blob[offset + 8 + 8 * k : end].data, dtype=dtype, count=k * dim
            ).view(k, dim)
        if k and (int(idx.min()) < 0 or int(idx.max()) >= num_rows):
            raise ValueError(f"a sparse-rows message holds a row id outside [0, {num_rows})")
        out.append((idx, rows))
        offset = end
    if offset != blob.size:
        raise ValueError(f"a sparse-rows message has {blob.size - offset} bytes too many")
    return count, out


def sum_rows(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum several ``(indices, rows)`` of one table: the union of the ids, ascending,
    and each id's rows added up (torch ops only: ``unique`` plus ``index_add_``)."""
    indices = torch.cat([i for i, _ in parts])
    rows = torch.cat([r for _, r in parts])
    union, where = torch.unique(indices, sorted=True, return_inverse=True)
    summed = torch.zeros((union.numel(), rows.shape[1]), dtype=rows.dtype)
    summed.index_add_(0, where, rows)
    return union, summed
