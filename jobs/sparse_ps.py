"""Sparse embedding rows through the parameter server against whole tables, on Spark.

    python jobs/sparse_ps.py --master local[2]
    python jobs/sparse_ps.py --master local[2] --rows 200000 --dim 64 --steps 8 --repeats 3

A two-tower model (a user table and an item table, ``sparse=True``, and a linear head)
on Zipf(1.1) ids, ``strategy="ps"`` sync, 2 shards: ``sparse_embeddings="auto"`` (rows)
and ``"off"`` (the tables in the flat vector, whole) fit the same data one after the
other, interleaved, ``--repeats`` times. Prints one JSON object per fit and, last, the
medians and their ratios (off / auto): seconds per step of the second epoch (its
``seconds`` over its steps: the first epoch pays the connections and the first pull)
and wire bytes per step over the run (every byte the workers sent and the server sent
back).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch
from torch import nn


class TwoTower(nn.Module):
    """A user id and an item id, each through its own ``sparse=True`` table, then a
    linear head over both rows (two classes)."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.users = nn.Embedding(rows, dim, sparse=True)
        self.items = nn.Embedding(rows, dim, sparse=True)
        self.head = nn.Linear(2 * dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.users(x[:, 0]), self.items(x[:, 1])], 1))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--master", default="local[2]")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import functools

    import numpy as np

    from sparktrain import TrainConfig, Trainer
    from sparktrain.session import get_or_create_session

    spark = get_or_create_session(args.master, app_name="sparktrain-sparse-ps")
    rng = np.random.default_rng(0)
    n = args.workers * args.batch * args.steps
    ids = np.minimum(rng.zipf(1.1, (n, 2)) - 1, args.rows - 1)
    labels = rng.integers(0, 2, n)
    data = spark.createDataFrame(
        [([int(a), int(b)], float(y)) for (a, b), y in zip(ids, labels, strict=True)],
        "features array<long>, label double",
    ).repartition(args.workers)
    model_fn = functools.partial(TwoTower, args.rows, args.dim)
    figures: dict[str, list[dict[str, Any]]] = {"auto": [], "off": []}
    for _ in range(args.repeats):
        for mode in ("auto", "off"):
            cfg = TrainConfig(
                strategy="ps",
                ps_shards=2,
                sparse_embeddings=mode,
                epochs=2,
                batch_size=args.batch,
                lr=0.05,
                optimizer="sgd",
                num_workers=args.workers,
                progress=False,
                comm_timeout=300.0,
            )
            s = Trainer(model_fn, cfg, spark=spark).fit(data).summary
            steps = s["steps_per_epoch"]
            total = steps * cfg.epochs
            out = {
                "sparse_embeddings": mode,
                "rows": args.rows,
                "dim": args.dim,
                "steps": steps,
                "s_per_step": s["history"][-1]["seconds"] / steps,
                "wire_bytes_per_step": s["wire_bytes"] / total,
                "final_loss": s["final_loss"],
                "rows_pushed": s["ps"]["rows_pushed"],
                "loadavg": os.getloadavg()[0],
            }
            figures[mode].append(out)
            print(json.dumps(out), flush=True)
    med = {
        mode: {
            k: statistics.median(f[k] for f in runs) for k in ("s_per_step", "wire_bytes_per_step")
        }
        for mode, runs in figures.items()
    }
    print(
        json.dumps(
            {
                "median": med,
                "time_ratio_off_over_auto": med["off"]["s_per_step"] / med["auto"]["s_per_step"],
                "bytes_ratio_off_over_auto": med["off"]["wire_bytes_per_step"]
                / med["auto"]["wire_bytes_per_step"],
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
