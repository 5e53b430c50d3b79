"""A mixed sparse + dense model, its data and config for the sparse parameter-server
tests (tests/unit/test_ps_sparse.py: the built-in loop; test_run_sparse_ps.py:
``sparktrain.run``)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from sparktrain.config import TrainConfig
from sparktrain.data.partition_data import PartitionData
from sparktrain.task.context import JobSpec

from .fixtures import SECRET

WIDTH, CLASSES = 5, 3  # features: 3 user ids (a bag), 1 item id, 1 float


class TwoTables(nn.Module):
    """A bag of user ids and an item id, each through its own table, and a dense head:
    a mixed sparse + dense model whose float features carry integer ids."""

    def __init__(self, rows: int = 40, dim: int = 3, sparse: bool = True) -> None:
        super().__init__()
        self.users = nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse)
        self.items = nn.Embedding(rows, dim, sparse=sparse)
        self.head = nn.Linear(2 * dim + 1, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.users(x[:, :3].long())
        b = self.items(x[:, 3].long())
        return self.head(torch.cat([a, b, x[:, 4:5].to(a.dtype)], 1))


def build(rows: int = 40, sparse: bool = True, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return TwoTables(rows, sparse=sparse).to(dtype)


def parts(sizes: list[int], rows: int = 40, seed: int = 0) -> list[PartitionData]:
    """Ids from a small range (many duplicates within and across ranks)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        x = np.empty((n, WIDTH), np.float32)
        x[:, :4] = np.minimum(rng.zipf(1.5, (n, 4)) - 1, rows - 1)
        x[:, 4] = rng.standard_normal(n)
        out.append(
            PartitionData(x, rng.integers(0, CLASSES, n).astype(np.float64), np.zeros(n, bool))
        )
    return out


def cfg(**kw: object) -> TrainConfig:
    base: dict[str, object] = {
        "strategy": "ps",
        "epochs": 2,
        "batch_size": 4,
        "lr": 0.3,
        "optimizer": "sgd",
        "shuffle": False,
        "progress": False,
        "comm_timeout": 10.0,
        "num_workers": 2,
        "ps_shards": 2,
    }
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


def spec(c: TrainConfig, addresses: tuple[str, ...], model_fn: object) -> JobSpec:
    return JobSpec(
        job_id="job",
        attempt=0,
        secret=SECRET,
        config=c,
        model_fn=model_fn,  # type: ignore[arg-type]
        model_kwargs={},
        feature_width=WIDTH,
        num_outputs=CLASSES,
        ps_addresses=addresses,
    )


def torch_reference(c: TrainConfig, data: list[PartitionData]) -> nn.Module:
    """One process, dense gradients: each step on the union of the ranks' next batches
    (their rows in order, shuffle off), as the sync server's sample-weighted mean."""
    model = build(sparse=False)
    opt = {"sgd": torch.optim.SGD}.get(c.optimizer, c.optimizer)(  # type: ignore[call-overload]
        model.parameters(), lr=c.lr
    )
    b = c.batch_size
    steps = max(math.ceil(p.size / b) for p in data)
    for _ in range(c.epochs):
        for s in range(steps):
            x = torch.from_numpy(np.concatenate([p.x[s * b : (s + 1) * b] for p in data]))
            y = torch.from_numpy(np.concatenate([p.y[s * b : (s + 1) * b] for p in data]))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y.long()).backward()
            opt.step()
    return model
