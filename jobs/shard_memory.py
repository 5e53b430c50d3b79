"""Peak memory and step time of ``shard_optimizer`` (ZeRO-1) against unsharded Adam on a
wide MLP (~100M parameters by default), through ``sparktrain.run`` on Spark.

    python jobs/shard_memory.py --master local[2]
    python jobs/shard_memory.py --master local[2] --width 1024 --layers 4 --steps 5

Each mode runs in its own stage; every worker reports its peak RSS (VmHWM of the task's
Python worker, ``summary["peak_rss_bytes_per_worker"]``) and the mean wall time of its
timed steps (after ``--warmup`` steps). Prints one JSON object per mode.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any


def wide_train_fn(ctx: Any, width: int, layers: int, warmup: int, steps: int) -> dict[str, Any]:
    """Adam on an MLP of ``layers`` square hidden layers; returns the step times only
    (the model stays in the workers: returning it would measure the result's copy)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(width, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=ctx.config.lr)
    model, optimizer = ctx.distributed(model, optimizer)
    times = []
    epoch = 0
    while len(times) < warmup + steps:
        for batch in ctx.batches(epoch):
            started = time.perf_counter()
            ctx.backward(F.cross_entropy(model(batch.x), batch.y.long()))
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - started)
            if len(times) == warmup + steps:
                break
        epoch += 1
    timed = times[warmup:]
    step = ctx.distributed_step
    return {
        "comm_s_per_step": step.comm_s / max(1, step.steps),
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": sum(timed) / len(timed),
        "step_s_min": min(timed),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--master", default="local[2]")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=["unsharded", "sharded"])
    args = p.parse_args(argv)

    import numpy as np

    import sparktrain
    from sparktrain import TrainConfig
    from sparktrain.session import get_or_create_session

    spark = get_or_create_session(args.master, app_name="sparktrain-shard-memory")
    rng = np.random.default_rng(0)
    rows = [(rng.standard_normal(16).tolist(), float(i % 4)) for i in range(64 * args.workers)]
    data = spark.createDataFrame(rows, "features array<float>, label double").repartition(
        args.workers
    )
    for mode in args.modes:
        cfg = TrainConfig(
            epochs=1,
            batch_size=8,
            lr=1e-4,
            optimizer="sgd",
            num_workers=args.workers,
            progress=False,
            comm_timeout=300.0,
            shard_optimizer=mode == "sharded",
        )
        train_fn = functools.partial(
            wide_train_fn,
            width=args.width,
            layers=args.layers,
            warmup=args.warmup,
            steps=args.steps,
        )
        result = sparktrain.run(train_fn, data, config=cfg, spark=spark)
        peaks = result.summary["peak_rss_bytes_per_worker"]
        out = {
            "mode": mode,
            "world": args.workers,
            **result.value,
            "peak_rss_mib_per_worker": [round(b / 2**20) for b in peaks],
        }
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
