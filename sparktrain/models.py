"""Ready-made model factories, importable as ``"sparktrain.models:NAME"``."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import nn


def mlp(
    in_features: int = 64,
    hidden: Sequence[int] | int = (128,),
    out_features: int = 10,
    dropout: float = 0.0,
) -> nn.Sequential:
    """A ReLU multi-layer perceptron; the default is the digits 64-128-10 MLP."""
    sizes = [in_features, *([hidden] if isinstance(hidden, int) else hidden)]
    layers: list[nn.Module] = []
    for a, b in pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(sizes[-1], out_features))
    return nn.Sequential(*layers)


def digits_mlp() -> nn.Sequential:
    """The main job's model: 64 inputs (8x8 digits), 128 hidden, 10 classes."""
    return mlp(64, (128,), 10)


def digits_cnn() -> nn.Sequential:
    """A small CNN on digits as 1x8x8 images: two 3x3 convolutions (16, 32 channels), a
    2x2 max-pool and a linear layer; 9,930 parameters."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


class EmbeddingRegressor(nn.Module):
    """Ids in, one value out: the recommender shape (a large embedding table, a small
    head). Each row's features are ids stored as floats (exact below 2**24); a row of
    several ids averages their embeddings."""

    def __init__(self, num_embeddings: int, dim: int, out_features: int = 1) -> None:
        super().__init__()
        if not 0 < num_embeddings <= 1 << 24:
            raise ValueError(
                f"num_embeddings must be in [1, 2**24] (ids travel as float32), "
                f"got {num_embeddings}"
            )
        self.embedding = nn.Embedding(num_embeddings, dim)
        self.head = nn.Linear(dim, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = x.reshape(x.shape[0], -1).long()
        return self.head(self.embedding(ids).mean(dim=1))


def embedding_regressor(
    num_embeddings: int = 1000, dim: int = 16, out_features: int = 1
) -> EmbeddingRegressor:
    """An :class:`EmbeddingRegressor`: ``num_embeddings * dim + dim + 1`` parameters
    (e.g. ``embedding_regressor(10_000_000, 16)`` is a 160M-parameter model)."""
    return EmbeddingRegressor(num_embeddings, dim, out_features)
