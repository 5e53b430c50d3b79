"""A user's model module for the model-loading tests: not under ``sparktrain.models``, so a
saved model naming it loads only once it is allowed.

A module of its own, not part of :mod:`tests.unit.fixtures`: saved models name it by path
(``tests.unit.user_models:tiny``) and the allowlist tests allow exactly this module, so it
must hold nothing but user models."""

from collections import OrderedDict  # re-exported name: not defined here, so never allowed

import torch
from torch import nn

__all__ = ["OrderedDict", "UserContext", "tiny", "user_context"]


def tiny(in_features: int = 4, out_features: int = 3) -> nn.Module:
    """A single linear layer."""
    return nn.Linear(in_features, out_features)


class UserContext(nn.Module):
    """Keyword inputs ``forward(user, context)``: an int64 id of any size (hashed into the
    table by ``id % num_embeddings``) and a float context vector, to class logits."""

    def __init__(self, num_embeddings: int, dim: int, context_features: int, out_features: int):
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, dim)
        self.head = nn.Linear(dim + context_features, out_features)

    def forward(self, user: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        if user.dtype != torch.int64:
            raise TypeError(f"user ids must arrive as int64, got {user.dtype}")
        rows = self.embedding(torch.remainder(user, self.embedding.num_embeddings))
        return self.head(torch.cat([rows, context], dim=1))


def user_context(
    num_embeddings: int = 1000, dim: int = 8, context_features: int = 4, out_features: int = 2
) -> UserContext:
    """A :class:`UserContext` model."""
    return UserContext(num_embeddings, dim, context_features, out_features)
