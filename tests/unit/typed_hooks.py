"""``decode``/``collate`` hooks and a model for the typed-column unit tests, importable by
``"tests.unit.typed_hooks:<name>"`` (how a job names them)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def decode_pixels(value: bytes) -> np.ndarray:
    """Bytes as a float32 ``(2, len // 2)`` image; a read-only view cast, as decodes do."""
    pixels = np.frombuffer(value, np.uint8)
    return pixels.reshape(2, -1).astype(np.float32)


def decode_view(value: bytes) -> np.ndarray:
    """Bytes as a read-only uint8 view (``np.frombuffer`` without a copy)."""
    return np.frombuffer(value, np.uint8)


def decode_strict(value: bytes) -> np.ndarray:
    """Fails on an empty value."""
    if not value:
        raise ValueError("an empty value")
    return np.frombuffer(value, np.uint8).astype(np.float32)


def collate_lengths(rows: list[np.ndarray]) -> torch.Tensor:
    """Each row's length, as a ``(n, 1)`` float tensor."""
    return torch.tensor([[float(len(r))] for r in rows])


def collate_shift(rows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids shifted by one in place (0 kept for padding), padded, with a mask: a
    collate that writes to the rows it is given."""
    for r in rows:
        r += 1
    longest = max([1, *(len(r) for r in rows)])
    out = torch.zeros(len(rows), longest, dtype=torch.int64)
    mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.from_numpy(r)
        mask[i, : len(r)] = True
    return out, mask


class TypedNet(nn.Module):
    """``forward(ids, x, tokens, tokens_mask, image)``: an id embedding (ids hashed into the
    table), a dense ``(2, 3)`` block, a masked mean of token embeddings and a decoded
    ``(2, 2)`` image, concatenated into a small MLP."""

    def __init__(self, buckets: int = 13, vocab: int = 10, dim: int = 4, out: int = 3) -> None:
        super().__init__()
        self.ids = nn.Embedding(buckets, dim)
        self.tokens = nn.Embedding(vocab, dim)
        self.head = nn.Sequential(nn.Linear(3 * dim + 6 + 4, 8), nn.ReLU(), nn.Linear(8, out))

    def forward(
        self,
        ids: torch.Tensor,
        x: torch.Tensor,
        tokens: torch.Tensor,
        image: torch.Tensor,
        tokens_mask: torch.Tensor,
    ) -> torch.Tensor:
        assert ids.dtype == torch.int64 and tokens.dtype == torch.int64
        hashed = self.ids(torch.remainder(ids, self.ids.num_embeddings))
        weights = tokens_mask.unsqueeze(-1).float()
        bag = (self.tokens(tokens) * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        bag_max = (self.tokens(tokens) * weights).amax(1)
        flat = [hashed, x.reshape(len(x), -1), bag, bag_max, image.reshape(len(image), -1)]
        return self.head(torch.cat(flat, dim=1))


def typed_net() -> TypedNet:
    return TypedNet()
