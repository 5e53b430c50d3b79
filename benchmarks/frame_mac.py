"""What frame MACs cost a training step: conf/synthetic_throughput.toml's MLP, worlds 2
and 4, fits with ``frame_integrity`` on and off taking turns in one session.

    python -m benchmarks.frame_mac --json docs/results/frame_mac_step.json

Each fit's step time is the median over its epochs but the first (Spark's warm-up) of
the epoch's seconds over its steps; the figure per world is the median of the on/off
ratios of the pairs. Loopback connections skip MACs under the default ``"auto"``, so
``true`` and ``false`` are set explicitly here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from sparktrain import datasets
from sparktrain.cli import split_job_keys
from sparktrain.config import TrainConfig, apply_overrides, load_toml
from sparktrain.session import get_or_create_session
from sparktrain.trainer import Trainer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=3, help="on/off pairs per world")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", metavar="PATH", help="write the records and ratios here")
    args = parser.parse_args(argv)
    values = apply_overrides(
        load_toml("conf/synthetic_throughput.toml"), [f"epochs={args.epochs}", "progress=false"]
    )
    job, rest = split_job_keys(values)
    split = datasets.load(job["dataset"], **{**job["dataset_kwargs"], "n": args.rows})
    spark = get_or_create_session(f"local[{max(args.worlds)}]", app_name="bench-frame-mac")
    records: list[dict[str, Any]] = []
    for world in args.worlds:
        frame = datasets.to_dataframe(spark, split.x_train, split.y_train, world).cache()
        frame.count()
        steps = math.ceil(len(split.y_train) / world / int(rest["batch_size"]))
        for pair in range(args.pairs):
            # the first of each pair alternates, so drifting load hits both alike
            for mac in (False, True) if pair % 2 == 0 else (True, False):
                cfg = TrainConfig.from_dict({**rest, "num_workers": world, "frame_integrity": mac})
                fit = Trainer(job["model"], cfg, model_kwargs=job["model_kwargs"], spark=spark)
                history = fit.fit(frame).history
                seconds = [r["seconds"] for r in history]
                record = {
                    "world": world,
                    "mac": mac,
                    "pair": pair,
                    "ms_per_step": statistics.median(seconds[1:]) / steps * 1000,
                    "epoch_s": seconds,
                    "load_avg_1m": os.getloadavg()[0],
                }
                records.append(record)
                print(json.dumps(record), flush=True)
        frame.unpersist()
    spark.stop()

    def step_ms(world: int, pair: int, mac: bool) -> float:
        key = (world, pair, mac)
        return next(r["ms_per_step"] for r in records if (r["world"], r["pair"], r["mac"]) == key)

    ratios = {}
    for world in args.worlds:
        by_pair = [step_ms(world, p, True) / step_ms(world, p, False) for p in range(args.pairs)]
        ratios[str(world)] = {"pairs": by_pair, "median": statistics.median(by_pair)}
        print(f"world {world}: MAC on/off step time {statistics.median(by_pair):.3f} ({by_pair})")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "records": records, "ratios": ratios}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
