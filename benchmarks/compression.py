"""Compression speed benchmark: compress + decompress throughput of each spec.

    sparktrain bench compression --specs fp16 bf16 int8 topk:0.01 topk:0.01,sampled \
        --elements 16M --threads 2 --json runs/bench_compression.json

Throughput is ``4 * elements`` bytes (the fp32 input) over the median time of
``compress`` then ``decompress`` on one float32 vector (no network); ``ratio`` is the
fp32 size over the payload bytes actually produced. Runs in this process with
``torch.set_num_threads(--threads)``. A benchmark, not a test: nothing is asserted.

Quality (``--quality``): accuracy against bytes, end to end on Spark, at worlds 2, 4 and
8 with the global batch fixed, three seeds and paired gaps to the uncompressed run; see
:mod:`benchmarks.compression_worlds` (issue 21's targets)::

    sparktrain bench compression --quality --json runs/compression_worlds.json \
        --plot runs/compression_worlds.png [--worlds 2 4 8] [--seeds 0 1 2] [--ablation]

:func:`quality_run` (one training run as a record) and :func:`quality_table` (the
one-seed records of docs/results/compression_quality*.json, issue 5's bench) stay for
those files and for ``--per-layer``. ``topk:0.01+ef:momentum=0.9`` is DGC's momentum
correction: momentum applied before compression, the optimizer's momentum set to 0.

Per-layer policies (``--per-layer``, ring, first of ``--worlds``): for each model, the
uniform runs (``none``, ``--safe``, ``int8+ef``, ``--aggressive``), then one run per layer
with only that layer under ``--aggressive`` (its accuracy drop is the layer's
sensitivity), then the mixed policy that keeps the sensitive layers (drop >=
``--sensitive-pp``, and the most sensitive one in any case) in ``--safe`` and sends
every other parameter with ``--aggressive``::

    sparktrain bench compression --per-layer --json runs/per_layer.json \
        [--aggressive topk:0.01+ef] [--safe fp16] [--sensitive-pp 0.5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import compression_worlds
from benchmarks.allreduce import parse_size
from benchmarks.compression_worlds import WORLD_SPECS, target_for
from benchmarks.plots import pyplot
from sparktrain.compress.base import BucketState
from sparktrain.compress.registry import build
from sparktrain.errors import ConfigError

DEFAULT_SPECS = [
    "fp16",
    "bf16",
    "int8",
    "int8:stochastic",
    "topk:0.01",
    "topk:0.01,sampled",
    "randomk:0.01",
    "sign",
    "powersgd:2",
]


def bench_spec(spec: str, elements: int, repeats: int) -> dict[str, Any]:
    comp = build(spec)
    if comp is None:
        raise ConfigError("nothing to measure for compression='none'")
    x = torch.randn(elements)
    state = BucketState()
    times_c, times_d = [], []
    nbytes = 0
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        payload, ctx = comp.compress(x, state)
        t1 = time.perf_counter()
        comp.decompress(payload, ctx)
        t2 = time.perf_counter()
        state.step += 1
        if i:  # the first round warms up allocators and caches
            times_c.append(t1 - t0)
            times_d.append(t2 - t1)
        nbytes = sum(p.nbytes for p in payload)
    c, d = statistics.median(times_c), statistics.median(times_d)
    return {
        "spec": comp.spec,
        "elements": elements,
        "compress_s": c,
        "decompress_s": d,
        "gb_per_s": 4 * elements / (c + d) / 1e9,
        "payload_bytes": nbytes,
        "ratio": 4 * elements / max(nbytes, 1),
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------- quality
QUALITY_MODELS = {"mlp": "sparktrain.models:digits_mlp", "cnn": "sparktrain.models:digits_cnn"}
# the old default grid (one seed, world 2, ring and PS): its records are in
# docs/results/compression_quality*.json; --quality now runs compression_worlds' grid
QUALITY_SPECS = WORLD_SPECS
RECIPE: dict[str, Any] = {
    "batch_size": 32,
    "lr": 0.1,
    "optimizer": "sgd",
    "optimizer_kwargs": {"momentum": 0.9},
    "comm_timeout": 60.0,
    "progress": False,
    "seed": 0,
}


def policy_label(table: dict[str, str]) -> str:
    """A per-layer table as one readable string: ``{0.*: fp16, *: topk:0.01+ef}``."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in table.items()) + "}"


def quality_run(
    spark: Any,
    frames: tuple[Any, Any],
    model: str,
    strategy: str,
    spec: str | dict[str, str],
    world: int,
    epochs: int,
    drop_last: bool = False,
    *,
    seed: int = 0,
    batch_size: int | None = None,
    link: str = "none",
    compression_path: str | None = None,
) -> dict[str, Any]:
    """One training run; its figures as a JSON-able record. ``spec`` may be a per-layer
    table (:mod:`sparktrain.compress.policy`); ``drop_last`` leaves out each partition's
    short final batch (for every spec alike, the baseline included). ``batch_size`` is
    per worker (None: the recipe's), ``link`` an emulated link profile and
    ``compression_path`` forces the collective's path (None: its own choice). The record
    keeps each epoch's validation accuracy and time (``history``)."""
    from sparktrain import TrainConfig, Trainer
    from sparktrain.compress.registry import build

    specs = [spec] if isinstance(spec, str) else list(spec.values())
    kwargs = dict(RECIPE["optimizer_kwargs"])
    if any(getattr(build(s), "momentum", 0.0) for s in specs):
        kwargs["momentum"] = 0.0  # DGC: the compressor applies the momentum
    recipe = {**RECIPE, "seed": seed, "link_profile": link}
    if batch_size is not None:
        recipe["batch_size"] = batch_size
    overrides: dict[str, Any] = {"ps_mode": "sync", "ps_shards": 2} if strategy == "ps" else {}
    if compression_path is not None:  # issue 21's config key; absent: the collective chooses
        overrides["compression_path"] = compression_path
    cfg = TrainConfig(
        **{**recipe, "optimizer_kwargs": kwargs},
        **overrides,
        strategy=strategy,
        compression=spec,
        num_workers=world,
        epochs=epochs,
        drop_last=drop_last,
    )
    path = QUALITY_MODELS[model]
    started = time.perf_counter()
    s = Trainer(path, cfg, spark=spark).fit(frames[0], validation_data=frames[1]).summary
    rec: dict[str, Any] = {
        "model": model,
        "strategy": "ps-sync" if strategy == "ps" else strategy,
        "world": world,
        "spec": spec if isinstance(spec, str) else policy_label(spec),
        "lr": float(recipe["lr"]),
        "accuracy": float(s["metric_value"]),
        "wire_bytes": int(s["wire_bytes"]),
        "raw_bytes": int(s["bytes_sent"]),
        "ratio": float(s["compression_ratio"]),
        "in_sync": bool(s.get("replicas_in_sync", True)),
        "wall_s": time.perf_counter() - started,
        "epochs": epochs,
        "drop_last": drop_last,
        "seed": seed,
        "batch_size": int(recipe["batch_size"]),
        "link": link,
        "steps_per_epoch": int(s["steps_per_epoch"]),
        # what the collective chose (forced or its own); absent without compression
        "compression_path": s.get("compression_path"),
        "compression_path_forced": compression_path,
        "history": [
            {"epoch": h["epoch"], "metric": h["metric"], "seconds": h["seconds"]}
            for h in s["history"]
        ],
    }
    if strategy == "ps":
        for direction in ("push", "pull"):
            d = s["ps"][direction]
            rec[f"{direction}_wire_bytes"] = int(d["wire_bytes"])
            rec[f"{direction}_ratio"] = float(d["ratio"])
    return rec


def add_gaps(records: list[dict[str, Any]]) -> None:
    """Gap to the uncompressed run (pp), wire-byte reduction and the target verdict."""
    base = {(r["model"], r["strategy"], r["world"]): r for r in records if r["spec"] == "none"}
    for r in records:
        ref = base.get((r["model"], r["strategy"], r["world"]))
        if ref is None:
            continue
        r["gap_pp"] = 100.0 * (ref["accuracy"] - r["accuracy"])
        key = "push_wire_bytes" if r["strategy"] == "ps-sync" else "wire_bytes"
        r["reduction"] = ref[key] / max(r[key], 1)
        target = target_for(r["spec"])
        if target is not None:
            gap_ok = r["gap_pp"] <= target[0] + 1e-9
            bytes_ok = target[1] is None or r["reduction"] >= target[1]
            r["target"] = f"<= {target[0]:g} pp" + (f", >= {target[1]:g}x" if target[1] else "")
            r["meets_target"] = gap_ok and bytes_ok


def quality_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| model | strategy | world | compression | accuracy | gap (pp) | wire MB | reduction "
        "| ratio (raw/wire) | push / pull ratio | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        pp = f"{r['push_ratio']:.1f} / {r['pull_ratio']:.2f}" if r["strategy"] == "ps-sync" else "-"
        verdict = "-"
        if "target" in r:
            verdict = f"{'met' if r['meets_target'] else 'MISSED'} ({r['target']})"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['world']} | `{r['spec']}` "
            f"| {r['accuracy']:.4f} | {r.get('gap_pp', 0.0):+.2f} | {r['wire_bytes'] / 1e6:.2f} "
            f"| {r.get('reduction', 1.0):.1f}x | {r['ratio']:.2f} | {pp} | {verdict} |"
        )
    return "\n".join(lines)


def quality_plot(records: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against wire bytes (log x), one panel per model, one marker per strategy."""
    plt = pyplot()

    models = sorted({r["model"] for r in records})
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.5), squeeze=False)
    markers = {"ring": "o", "ps-sync": "s"}
    for ax, model in zip(axes[0], models, strict=True):
        for r in (r for r in records if r["model"] == model):
            ef = "+ef" in r["spec"]
            ax.scatter(
                r["wire_bytes"] / 1e6,
                100 * r["accuracy"],
                marker=markers.get(r["strategy"], "^"),
                c="tab:blue" if r["strategy"] == "ring" else "tab:orange",
                alpha=0.9 if ef or r["spec"] == "none" else 0.45,
                edgecolors="black" if ef else "none",
            )
            label = r["spec"] + (f" w{r['world']}" if r["world"] != 2 else "")
            ax.annotate(
                label,
                (r["wire_bytes"] / 1e6, 100 * r["accuracy"]),
                fontsize=6,
                xytext=(3, 2),
                textcoords="offset points",
            )
        ax.set_xscale("log")
        ax.set_xlabel("wire bytes (MB, all senders, log scale)")
        ax.set_ylabel("final test accuracy (%)")
        ax.set_title(f"digits {model}: circles ring, squares ps-sync; outlined: +ef")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def quality_main(args: argparse.Namespace) -> int:
    """``--quality``: worlds x seeds x specs with paired gaps (:mod:`.compression_worlds`)."""
    if getattr(args, "config", None):  # the shipped configs as they are (issue 34.3)
        specs = args.specs if args.specs != DEFAULT_SPECS else compression_worlds.SHIPPED_SPECS
        return compression_worlds.config_main(args, specs)
    specs = args.specs if args.specs != DEFAULT_SPECS else WORLD_SPECS
    return compression_worlds.main(args, specs, quality_run)


# ---------------------------------------------------------------------- per-layer
def layer_groups(model: str) -> list[tuple[str, int]]:
    """``(layer prefix, elements)`` of a bench model, in parameter order: ``0.weight``
    and ``0.bias`` form layer ``0``."""
    import importlib

    module, _, fn = QUALITY_MODELS[model].partition(":")
    net = getattr(importlib.import_module(module), fn)()
    groups: dict[str, int] = {}
    for name, p in net.named_parameters():
        prefix = name.rpartition(".")[0] or name
        groups[prefix] = groups.get(prefix, 0) + p.numel()
    return list(groups.items())


def mixed_policy(
    sensitivity: dict[str, float], aggressive: str, safe: str, threshold_pp: float
) -> dict[str, str]:
    """The layers whose accuracy drop reaches ``threshold_pp`` — and the most sensitive
    one in any case — keep ``safe``; every other parameter gets ``aggressive``."""
    worst = max(sensitivity, key=lambda k: sensitivity[k])
    keep = [k for k, v in sensitivity.items() if v >= threshold_pp or k == worst]
    table = {f"{k}.*": safe for k in keep}
    table["*"] = aggressive
    return table


def per_layer_main(args: argparse.Namespace) -> int:
    """Per-layer sensitivity and one mixed policy against the uniform ones (ring)."""
    from sparktrain import datasets
    from sparktrain.session import get_or_create_session

    world = args.worlds[0]
    split = datasets.digits()
    spark = get_or_create_session(f"local[{world}]", app_name="sparktrain-bench-per-layer")
    frames = (
        datasets.to_dataframe(spark, split.x_train, split.y_train, world),
        datasets.to_dataframe(spark, split.x_test, split.y_test, world),
    )
    quality_run(spark, frames, "mlp", "ring", "none", world, 1)  # warm-up
    records: list[dict[str, Any]] = []

    def run(model: str, spec: str | dict[str, str], role: str, layer: str = "") -> dict[str, Any]:
        rec = quality_run(spark, frames, model, "ring", spec, world, args.epochs)
        rec["role"], rec["layer"] = role, layer
        records.append(rec)
        print(json.dumps(rec), flush=True)
        return rec

    for model in args.models:
        base = run(model, "none", "uniform")
        for spec in dict.fromkeys([args.safe, "int8+ef", args.aggressive]):
            run(model, spec, "uniform")
        sensitivity = {}
        for layer, _ in layer_groups(model):
            rec = run(model, {f"{layer}.*": args.aggressive, "*": "none"}, "sensitivity", layer)
            sensitivity[layer] = 100.0 * (base["accuracy"] - rec["accuracy"])
        run(
            model, mixed_policy(sensitivity, args.aggressive, args.safe, args.sensitive_pp), "mixed"
        )
    spark.stop()
    add_gaps(records)
    print(per_layer_table(records))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1) + "\n")
        print(f"records written to {path}")
    return 0


def per_layer_table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| model | run | policy | accuracy | drop (pp) | wire MB | reduction |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        role = r["role"] + (f" ({r['layer']})" if r.get("layer") else "")
        lines.append(
            f"| {r['model']} | {role} | `{r['spec']}` | {r['accuracy']:.4f} "
            f"| {r.get('gap_pp', 0.0):+.2f} | {r['wire_bytes'] / 1e6:.2f} "
            f"| {r.get('reduction', 1.0):.1f}x |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quality",
        action="store_true",
        help="accuracy against bytes on Spark (models x compressors x strategies)",
    )
    parser.add_argument("--specs", nargs="+", default=DEFAULT_SPECS)
    parser.add_argument("--elements", default="16M", help="float32 elements, e.g. 1M, 16M")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--json", metavar="PATH", help="write the records here")
    parser.add_argument("--plot", metavar="PATH", help="--quality: write the PNG plot here")
    parser.add_argument("--epochs", type=int, default=20, help="--quality: epochs per run")
    parser.add_argument(
        "--drop-last",
        action="store_true",
        help="--quality: leave out each partition's short final batch (drop_last=true)",
    )
    parser.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=[2, 4, 8],
        help="--quality: worker counts (--per-layer: the first)",
    )
    parser.add_argument(
        "--models", nargs="+", default=["mlp", "cnn"], choices=sorted(QUALITY_MODELS)
    )
    parser.add_argument("--strategies", nargs="+", default=["ring"], choices=["ring", "tree", "ps"])
    compression_worlds.add_arguments(parser)
    parser.add_argument(
        "--per-layer",
        action="store_true",
        help="per-layer sensitivity (ring) and one mixed policy against the uniform ones",
    )
    parser.add_argument(
        "--aggressive", default="topk:0.01+ef", help="--per-layer: the spec tried per layer"
    )
    parser.add_argument("--safe", default="fp16", help="--per-layer: sensitive layers' spec")
    parser.add_argument(
        "--sensitive-pp",
        type=float,
        default=0.5,
        help="--per-layer: layers losing at least this many pp stay --safe",
    )


def main(args: argparse.Namespace) -> int:
    if getattr(args, "per_layer", False):
        return per_layer_main(args)
    if getattr(args, "quality", False):
        return quality_main(args)
    text = args.elements  # "16M" means 16 Mi elements here
    elements = parse_size(text) if text[-1:].isalpha() else int(text)
    if elements < 1 or args.repeats < 1:
        raise ConfigError("--elements and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    print(f"{'spec':<24}{'compress ms':>12}{'decompress ms':>15}{'GB/s':>8}{'ratio':>9}")
    for spec in args.specs:
        rec = bench_spec(spec, elements, args.repeats)
        records.append(rec)
        print(
            f"{rec['spec']:<24}{rec['compress_s'] * 1e3:>12.1f}{rec['decompress_s'] * 1e3:>15.1f}"
            f"{rec['gb_per_s']:>8.2f}{rec['ratio']:>9.1f}",
            flush=True,
        )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=2) + "\n")
    return 0
