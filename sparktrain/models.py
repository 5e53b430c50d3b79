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


def digits_cnn_shaped() -> nn.Sequential:
    """:func:`digits_cnn` for inputs that arrive as ``(batch, 1, 8, 8)`` images (a
    ``feature_shapes = {"features" = [1, 8, 8]}`` column), so without an ``Unflatten``."""
    return nn.Sequential(*list(digits_cnn())[1:])


class EmbeddingRegressor(nn.Module):
    """Ids in, one value out: the recommender shape (a large embedding table, a small
    head). A row's ids arrive as an int64 column (exact at any size) or as floats (exact
    below 2**24 only); a row of several ids averages their embeddings."""

    def __init__(self, num_embeddings: int, dim: int, out_features: int = 1) -> None:
        super().__init__()
        if num_embeddings <= 0:
            raise ValueError(f"num_embeddings must be >= 1, got {num_embeddings}")
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


class IdsAndDense(nn.Module):
    """An id column and a dense float column in, class logits out: ``forward(ids,
    dense)``, for ``features_col={"ids": ..., "dense": ...}``. Ids are int64 of any
    size, hashed into the table by ``id % num_embeddings``."""

    def __init__(
        self, num_embeddings: int, dim: int, dense_features: int, hidden: int, out_features: int
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, dim)
        self.head = mlp(dim + dense_features, (hidden,), out_features)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        if ids.dtype.is_floating_point:
            raise TypeError("ids must arrive as int64: an id column of integers, not floats")
        rows = self.embedding(torch.remainder(ids, self.embedding.num_embeddings))
        rows = rows.reshape(ids.shape[0], -1, rows.shape[-1]).mean(dim=1)
        return self.head(torch.cat([rows, dense.reshape(dense.shape[0], -1)], dim=1))


def ids_and_dense(
    num_embeddings: int = 1000,
    dim: int = 8,
    dense_features: int = 4,
    hidden: int = 32,
    out_features: int = 2,
) -> IdsAndDense:
    """An :class:`IdsAndDense` model."""
    return IdsAndDense(num_embeddings, dim, dense_features, hidden, out_features)


class TokenBag(nn.Module):
    """A variable-length token sequence in, class logits out: the masked mean of the
    tokens' embeddings, then a linear layer. ``forward(tokens, tokens_mask)`` takes the
    padded ``(batch, longest)`` int64 tokens and the mask sparktrain passes with them
    (``feature_shapes = {"tokens" = [-1]}``)."""

    def __init__(self, vocab: int, dim: int, out_features: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, out_features)

    def forward(self, tokens: torch.Tensor, tokens_mask: torch.Tensor) -> torch.Tensor:
        weights = tokens_mask.unsqueeze(-1).to(self.embedding.weight.dtype)
        summed = (self.embedding(tokens) * weights).sum(dim=1)
        return self.head(summed / weights.sum(dim=1).clamp(min=1.0))


def token_bag(vocab: int = 100, dim: int = 16, out_features: int = 2) -> TokenBag:
    """A :class:`TokenBag` model."""
    return TokenBag(vocab, dim, out_features)


class TokenGRU(nn.Module):
    """A GRU over a variable-length token sequence: embeddings packed by the mask's
    lengths (padding never enters the recurrence), the last hidden state to logits."""

    def __init__(self, vocab: int, dim: int, hidden: int, out_features: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, out_features)

    def forward(self, tokens: torch.Tensor, tokens_mask: torch.Tensor) -> torch.Tensor:
        lengths = tokens_mask.sum(dim=1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(
            self.embedding(tokens), lengths, batch_first=True, enforce_sorted=False
        )
        _, last = self.gru(packed)
        return self.head(last[-1])


def token_gru(vocab: int = 100, dim: int = 16, hidden: int = 32, out_features: int = 2) -> TokenGRU:
    """A :class:`TokenGRU` model."""
    return TokenGRU(vocab, dim, hidden, out_features)


class SequenceTransformer(nn.Module):
    """A small transformer encoder classifier over a variable-length token column:
    token plus learned position embeddings, ``layers`` encoder layers that ignore the
    padding (``tokens_mask`` False), a mean over the real positions, logits."""

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, max_len: int, out_features: int
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, out_features)

    def forward(self, tokens: torch.Tensor, tokens_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding(tokens) + self.position(positions)
        x = self.encoder(x, src_key_padding_mask=~tokens_mask)
        keep = tokens_mask.unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0))


def sequence_transformer(
    vocab: int = 16,
    dim: int = 32,
    heads: int = 4,
    layers: int = 2,
    max_len: int = 64,
    out_features: int = 2,
) -> SequenceTransformer:
    """A :class:`SequenceTransformer` model."""
    return SequenceTransformer(vocab, dim, heads, layers, max_len, out_features)


class TwoTower(nn.Module):
    """A two-tower recommender with a dot-product head: ``forward(user, item)`` takes
    int64 id tensors of shape ``(batch,)`` and returns one click logit per row,
    ``(batch,)`` (train it with ``bce_with_logits``). Each tower is an embedding table
    (``dim`` wide) and a one-wide bias table; the logit is the two rows' dot product plus
    both biases plus a global bias. Every per-id parameter lives in a table, so a step
    touches only the rows of its batch's ids.

    ``sparse=True`` builds the tables with ``nn.Embedding(..., sparse=True)``: their
    gradients are sparse COO tensors holding only the touched rows, which the strategies
    exchange as rows (``sparse_embeddings``); ``sparse=False`` gives the same model (the
    same weights for a seed) with dense gradients."""

    def __init__(self, num_users: int, num_items: int, dim: int, sparse: bool) -> None:
        super().__init__()
        for name, n in (("num_users", num_users), ("num_items", num_items), ("dim", dim)):
            if n < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
        self.user = nn.Embedding(num_users, dim, sparse=sparse)
        self.item = nn.Embedding(num_items, dim, sparse=sparse)
        self.user_bias = nn.Embedding(num_users, 1, sparse=sparse)
        self.item_bias = nn.Embedding(num_items, 1, sparse=sparse)
        # small rows, zero biases: the first logits are near 0 and the loss near log 2
        # (torch's standard normal rows would start with logits of several units)
        nn.init.normal_(self.user.weight, std=0.1)
        nn.init.normal_(self.item.weight, std=0.1)
        nn.init.zeros_(self.user_bias.weight)
        nn.init.zeros_(self.item_bias.weight)
        self.bias = nn.Parameter(torch.zeros(()))

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        if user.dtype.is_floating_point or item.dtype.is_floating_point:
            raise TypeError("user and item ids must arrive as int64 columns, not floats")
        user, item = user.reshape(-1), item.reshape(-1)
        dot = (self.user(user) * self.item(item)).sum(dim=1)
        return dot + self.user_bias(user)[:, 0] + self.item_bias(item)[:, 0] + self.bias


def two_tower(
    num_users: int = 100_000, num_items: int = 1_000_000, dim: int = 64, sparse: bool = True
) -> TwoTower:
    """A :class:`TwoTower` recommender; the default is the sparse bench's model (a
    1M x 64 item table, a 100k x 64 user table and their bias tables: 71.5M parameters)."""
    return TwoTower(num_users, num_items, dim, sparse)
