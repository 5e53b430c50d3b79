"""Parameter-server bench: the digits MLP under ``ps_mode`` async and ssp, with and
without ``staleness_lr``, in one run (sync and the ring as references).

    sparktrain bench ps --world 2 --epochs 10 --json runs/bench_ps.json

Records are ``{strategy, mode, staleness_lr, world, accuracy, mean_staleness,
max_staleness, wall_s, wire_bytes, ps_wait_s}``; ``accuracy`` is the test accuracy of
the model returned by the run (the server's parameters).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from sparktrain.errors import ConfigError

MODES = ("async", "ssp")
DIGITS_MODEL = "sparktrain.models:digits_mlp"


def run_one(spark: Any, frames: tuple[Any, Any], split: Any, **overrides: Any) -> dict[str, Any]:
    """Train once and return its record."""
    import torch

    from sparktrain import TrainConfig, Trainer

    cfg = TrainConfig(
        **{
            "epochs": 10,
            "batch_size": 32,
            "lr": 0.1,
            "optimizer": "sgd",
            "optimizer_kwargs": {"momentum": 0.9},
            "progress": False,
            "comm_timeout": 60.0,
            **overrides,
        }
    )
    result = Trainer(DIGITS_MODEL, cfg, spark=spark).fit(frames[0], validation_data=frames[1])
    with torch.no_grad():
        pred = result.model(torch.from_numpy(split.x_test)).argmax(1).numpy()
    s = result.summary
    ps = s.get("ps", {})
    return {
        "strategy": cfg.strategy,
        "mode": cfg.ps_mode if cfg.strategy == "ps" else "-",
        "staleness": cfg.staleness if cfg.ps_mode == "ssp" and cfg.strategy == "ps" else None,
        "staleness_lr": cfg.staleness_lr if cfg.strategy == "ps" else None,
        "world": cfg.num_workers,
        "epochs": cfg.epochs,
        "accuracy": float((pred == split.y_test).mean()),
        "mean_staleness": ps.get("mean_staleness", 0.0),
        "max_staleness": ps.get("max_staleness", 0),
        "wall_s": s["wall_s"],
        "wire_bytes": s["wire_bytes"],
        "ps_wait_s": ps.get("wait_s_total", 0.0),
    }


def table(records: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per configuration, averaged over its seeds."""
    lines = [
        "| strategy | mode | staleness_lr | world | seeds | accuracy mean (min–max) "
        "| mean staleness | wall | wire bytes |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        key = (r["strategy"], r["mode"], r["staleness"], r["staleness_lr"], r["world"])
        groups.setdefault(key, []).append(r)
    for (strategy, mode, staleness, slr, world), rs in groups.items():
        acc = [r["accuracy"] for r in rs]
        label = mode + (f" (s={staleness})" if staleness is not None else "")
        flag = "-" if slr is None else str(slr).lower()
        lines.append(
            f"| {strategy} | {label} | {flag} | {world} | {len(rs)} "
            f"| {statistics.mean(acc):.4f} ({min(acc):.4f}–{max(acc):.4f}) "
            f"| {statistics.mean(r['mean_staleness'] for r in rs):.2f} "
            f"| {statistics.mean(r['wall_s'] for r in rs):.1f} s "
            f"| {statistics.mean(r['wire_bytes'] for r in rs) / 1e6:.1f} MB |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="workers (default 2)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--staleness", type=int, default=2, help="the ssp bound s")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the sync-PS and ring reference runs"
    )
    parser.add_argument("--json", metavar="PATH", help="write the records here")
    parser.add_argument("--master", help="Spark master (default local[world])")


def main(args: argparse.Namespace) -> int:
    from sparktrain import datasets
    from sparktrain.session import get_or_create_session

    if args.world < 1 or args.epochs < 1:
        raise ConfigError("--world and --epochs must be >= 1")
    spark = get_or_create_session(
        args.master or f"local[{args.world}]", app_name="sparktrain-bench-ps"
    )
    split = datasets.digits()
    frames = (
        datasets.to_dataframe(spark, split.x_train, split.y_train, args.world),
        datasets.to_dataframe(spark, split.x_test, split.y_test, args.world),
    )
    common = {"num_workers": args.world, "epochs": args.epochs}
    ps = {"strategy": "ps", "ps_shards": args.shards, "staleness": args.staleness}
    runs: list[dict[str, Any]] = []
    if not args.no_reference:
        runs += [{"strategy": "ring"}, {**ps, "ps_mode": "sync"}]
    runs += [
        {**ps, "ps_mode": mode, "staleness_lr": slr} for mode in args.modes for slr in (False, True)
    ]
    # warm-up: the first stage pays for starting Python workers and importing torch
    run_one(spark, frames, split, num_workers=args.world, strategy="ring", epochs=1)
    records = []
    for overrides in runs:
        for seed in args.seeds:
            records.append(
                {**run_one(spark, frames, split, **common, **overrides, seed=seed), "seed": seed}
            )
            print(json.dumps(records[-1]), flush=True)
    print(table(records))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1) + "\n")
        print(f"records written to {path}")
    return 0
