"""Embedding tables whose gradients are rows: which parameters they are, and a gradient
as (indices, rows).

An ``nn.Embedding``/``nn.EmbeddingBag`` built with ``sparse=True`` gives its weight a
sparse COO gradient that holds only the rows the step's ids touched. The strategies
exchange those rows instead of the whole table (docs/sparse.md); this module is what
their worker halves share.
"""

from __future__ import annotations

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
