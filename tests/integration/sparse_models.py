"""Models with ``sparse=True`` embedding tables for the Spark tests, named by path
(``tests.integration.sparse_models:id_bag``) so the executors import them."""

from torch import nn


def id_bag(rows: int = 1000, dim: int = 8, out_features: int = 2) -> nn.Module:
    """A bag of int64 ids through a ``sparse=True`` table (mean), then a linear head."""
    return nn.Sequential(
        nn.EmbeddingBag(rows, dim, mode="mean", sparse=True), nn.Linear(dim, out_features)
    )
