"""Time per step and bytes per step of a sparse=True embedding table on the ring: the
row path (``sparse_embeddings="auto"``) against the dense path (``"off"``), interleaved
in one run, two ranks as two processes over loopback (docs/sparse.md).

Each rank trains ``Embedding(rows, dim, sparse=True)`` (mean of ``ids`` Zipf ids per
sample, a linear head) with plain SGD on ``batch`` samples per step; both paths share
the mesh and alternate in blocks of ``--steps`` steps, ``--repeats`` times. Reports the
median step time of each path, their ratio, and the wire bytes per step.

    PYTHONPATH=. python jobs/sparse_ring_step.py --rows 1000000 --dim 64 --batch 512
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from sparktrain.config import TrainConfig
from sparktrain.task.context import JobSpec, WorkerContext
from sparktrain.task.step_sync import AllreduceSync
from sparktrain.wire import Mesh, address_of, open_listener

SECRET = bytes(range(32))


class Net(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.EmbeddingBag(rows, dim, mode="mean", sparse=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(1)


def _rank(rank: int, args: dict[str, Any], conn: Any) -> None:
    torch.set_num_threads(1)  # as a Spark task does (JobSpec.threads)
    listener = open_listener("127.0.0.1")
    conn.send(address_of(listener))
    addresses = conn.recv()
    rng = np.random.default_rng(rank)
    times: dict[str, list[float]] = {"auto": [], "off": []}
    wire: dict[str, list[int]] = {"auto": [], "off": []}
    with Mesh(rank, 2, listener, addresses, SECRET, "bench", 0, 60.0) as mesh:
        syncs = {}
        models = {}
        for mode in ("auto", "off"):
            cfg = TrainConfig(
                strategy="ring",
                lr=0.1,
                optimizer="sgd",
                sparse_embeddings=mode,
                overlap=False,
                num_workers=2,
            )
            spec = JobSpec("bench", 0, SECRET, cfg, None, {}, 0, 1)
            ctx = WorkerContext(rank, 2, "127.0.0.1", lambda s: [s], lambda: None, spec)
            models[mode] = Net(args["rows"], args["dim"])
            syncs[mode] = AllreduceSync(ctx, models[mode], mesh)
        for _ in range(args["repeats"]):
            for mode in ("auto", "off"):
                model, sync = models[mode], syncs[mode]
                for _ in range(args["steps"]):
                    ids = torch.from_numpy(
                        np.minimum(rng.zipf(1.2, (args["batch"], args["ids"])), args["rows"]) - 1
                    )
                    y = torch.from_numpy(rng.standard_normal(args["batch"]).astype(np.float32))
                    before = mesh.stats.as_dict()["wire_bytes_sent"]
                    started = time.perf_counter()
                    loss = nn.functional.mse_loss(model(ids), y)
                    loss.backward()
                    sync.step(args["batch"])
                    times[mode].append(time.perf_counter() - started)
                    wire[mode].append(mesh.stats.as_dict()["wire_bytes_sent"] - before)
        for sync in syncs.values():
            sync.close()
    conn.send((times, wire))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--ids", type=int, default=8, help="ids per sample")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--repeats", type=int, default=4, help="blocks per path")
    args = vars(parser.parse_args())
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, args, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    addresses = [pipes[r][0].recv() for r in range(2)]
    for r in range(2):
        pipes[r][0].send(addresses)
    results = []
    for r in range(2):
        if not pipes[r][0].poll(1800):
            raise TimeoutError(f"rank {r} sent nothing in 30 min")
        results.append(pipes[r][0].recv())
    for p in procs:
        p.join(60)
    times, wire = results[0]
    out: dict[str, Any] = {"args": args}
    for mode in ("auto", "off"):
        # the first block of each path warms up (allocations, connections)
        steady = times[mode][args["steps"] :]
        out[mode] = {
            "median_step_s": statistics.median(steady),
            "wire_bytes_per_step_rank0": statistics.median(wire[mode][args["steps"] :]),
        }
    out["time_ratio_off_over_auto"] = out["off"]["median_step_s"] / out["auto"]["median_step_s"]
    out["bytes_ratio_off_over_auto"] = (
        out["off"]["wire_bytes_per_step_rank0"] / out["auto"]["wire_bytes_per_step_rank0"]
    )
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
