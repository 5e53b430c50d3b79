"""Compression as the world grows (issue 21): ``sparktrain bench compression --quality``.

    sparktrain bench compression --quality --json docs/results/compression_worlds.json \\
        --plot docs/results/compression_worlds.png [--worlds 2 4 8] [--seeds 0 1 2] \\
        [--global-batch 64] [--epochs 20] [--ablation --local-clip 5.0 --warmup-epochs 4] \\
        [--time-to 0.95 --link 5g --time-to-world 4 --time-to-spec topk:0.01+ef:momentum=0.9]

The digits MLP and CNN (conf/digits_mlp.toml's recipe: SGD lr 0.1, momentum 0.9) on the
ring at every world of ``--worlds``, each on its own ``local[world]`` session. The global
batch and the epochs are the same at every world — per-worker batch = global / world — so
every world takes (nearly) the same optimizer steps on the same samples and a gap that
grows with the world is the compressor's, not a smaller batch's. Every run sets ``seed``.

The gap is paired: for each (model, world, spec, seed), accuracy(``none``, same model,
world and seed) − accuracy(spec), in pp; a row reports the median of those gaps, their
min and max, and the byte reduction: the uncompressed run's wire bytes over this run's
(whole run, a warm-up's denser steps included; on the PS the push bytes). The verdict
of a row holds its *median* gap (and median reduction) to the spec's target
(:data:`TARGETS`; top-k's DGC variants share ``topk:0.01+ef``'s).

``--config conf/digits_mlp.toml [conf/digits_cnn.toml]`` measures the shipped configs
instead (issue 34.3: "top-k out of the box"): what ``sparktrain train CONF --set
num_workers=N --set compression=SPEC --master local[N]`` trains, at every world of
``--worlds`` and seed of ``--seeds`` — the config's own recipe and per-worker batch, so
the global batch grows with the world, and the spec as written (``topk:0.01+ef``: the
job moves SGD's momentum into it, :mod:`sparktrain.compress.correction`). The table
(:func:`shipped_table`) gives accuracy mean ± sd over the seeds, the paired gap, the
wire-byte ratio and the path taken; ``--force-paths`` adds rows on forced paths::

    sparktrain bench compression --quality --config conf/digits_mlp.toml \
        --json docs/results/compression_shipped.json [--force-paths allgather]

``--ablation`` adds one row per DGC remedy (:func:`ablation_variants`): momentum masking
off, local gradient clipping, sparsity warm-up and the allgather path forced through the
``compression_path`` config key. ``--time-to`` trains ``none`` and ``--time-to-spec``
interleaved, seed by seed, on an emulated ``--link`` at ``--time-to-world`` and reports
the training time until the validation accuracy first reaches the target
(:func:`time_to_accuracy`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.plots import pyplot
from sparktrain.errors import ConfigError

FORMAT = "compression_worlds/1"
WORLD_SPECS = [
    "none",
    "int8+ef",
    "powersgd:2+ef",
    "sign:chunk=32+ef:momentum=0.9",
    "topk:0.01+ef",
    "topk:0.01+ef:momentum=0.9",
]
TOPK = "topk:0.01+ef"
TARGETS: dict[str, tuple[float, float | None]] = {  # spec -> (max gap pp, min reduction)
    "int8+ef": (0.5, None),
    "powersgd:2+ef": (0.5, None),
    "sign:chunk=32+ef:momentum=0.9": (1.0, None),
    TOPK: (1.0, 25.0),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the bench: a compression spec, the ``compression_path`` it forces
    (None: the collective's own choice) and the label the records and tables use."""

    spec: str
    path: str | None = None

    @property
    def label(self) -> str:
        return self.spec if self.path is None else f"{self.spec} [{self.path}]"


def ablation_variants(local_clip: float, warmup: int) -> list[Variant]:
    """One row per DGC remedy, each against ``topk:0.01+ef:momentum=0.9`` (the spec
    syntax agreed for issue 21), and plain top-k on the allgather path."""
    if local_clip <= 0 or warmup < 1:
        raise ConfigError("--local-clip must be > 0 and the warm-up at least 1 step")
    return [
        Variant("topk:0.01+ef:momentum=0.9,mask=0"),
        Variant(f"topk:0.01+ef:momentum=0.9,local_clip={local_clip:g}"),
        Variant(f"topk:0.01,warmup={warmup}+ef:momentum=0.9"),
        Variant(TOPK, path="allgather"),
    ]


def per_worker_batch(global_batch: int, world: int) -> int:
    """The batch each of ``world`` workers takes so that one step sees ``global_batch``
    samples; a world that does not divide it is an error, not a rounded batch."""
    if global_batch < 1 or world < 1:
        raise ConfigError(f"--global-batch ({global_batch}) and worlds ({world}) must be >= 1")
    if global_batch % world:
        raise ConfigError(
            f"--global-batch {global_batch} does not divide by world {world}: pick a global "
            f"batch that every world of --worlds divides (e.g. a multiple of {world})"
        )
    return global_batch // world


def steps_per_epoch(samples: int, global_batch: int, drop_last: bool) -> int:
    """Optimizer steps in one epoch over ``samples`` at ``global_batch``."""
    return samples // global_batch if drop_last else math.ceil(samples / global_batch)


def target_for(spec: str) -> tuple[float, float | None] | None:
    """The target of a spec: its own, or ``topk:0.01+ef``'s for top-k 1 % with error
    feedback and any DGC remedy (momentum, masking, clipping, warm-up)."""
    if spec in TARGETS:
        return TARGETS[spec]
    head, _, rest = spec.partition("+")
    if head.split(",")[0] == "topk:0.01" and rest.startswith("ef"):
        return TARGETS[TOPK]
    return None


def time_to_accuracy(history: Sequence[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """Training time until the validation accuracy first reaches ``target``: the sum of
    the epochs' ``seconds`` (rank 0's wall time of each epoch, its validation pass
    included) up to and including the first epoch whose ``metric`` is >= ``target``.
    None when no epoch reached it."""
    elapsed = 0.0
    for h in history:
        elapsed += float(h["seconds"])
        if float(h["metric"]) >= target:
            return {"seconds": elapsed, "epoch": int(h["epoch"])}
    return None


# ---------------------------------------------------------------------- aggregation
def _key(r: dict[str, Any]) -> tuple[str, str, int]:
    return (r["model"], r["strategy"], int(r["world"]))


def aggregate(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, strategy, world, spec label): the paired gaps to ``none`` of
    the same seed (median, min, max; pp), the median byte reduction and the verdict.
    Seeds without a ``none`` run are left out of the pairing (and counted)."""
    base = {(*_key(r), int(r["seed"])): r for r in records if r["spec"] == "none"}
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((*_key(r), r["spec"]), []).append(r)
    rows = []
    for (model, strategy, world, spec), runs in groups.items():
        gaps, reductions = [], []
        for r in runs:
            ref = base.get((model, strategy, world, int(r["seed"])))
            if ref is None:
                continue
            gaps.append(100.0 * (ref["accuracy"] - r["accuracy"]))
            wire = "push_wire_bytes" if strategy == "ps-sync" else "wire_bytes"
            reductions.append(ref[wire] / max(r[wire], 1))
        row: dict[str, Any] = {
            "model": model,
            "strategy": strategy,
            "world": world,
            "spec": spec,
            "seeds": sorted(int(r["seed"]) for r in runs),
            "unpaired": len(runs) - len(gaps),
            "accuracy_median": statistics.median(r["accuracy"] for r in runs),
            "compression_path": sorted({str(r.get("compression_path")) for r in runs}),
        }
        if gaps:
            row.update(
                gap_pp=gaps,
                gap_median=statistics.median(gaps),
                gap_min=min(gaps),
                gap_max=max(gaps),
                reduction=statistics.median(reductions),
            )
        target = target_for(runs[0].get("compression", spec))
        if target is not None and gaps:
            gap_ok = row["gap_median"] <= target[0] + 1e-9
            bytes_ok = target[1] is None or row["reduction"] >= target[1]
            row["target"] = f"<= {target[0]:g} pp" + (f", >= {target[1]:g}x" if target[1] else "")
            row["meets_target"] = gap_ok and bytes_ok
        rows.append(row)
    return rows


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row["spec"] == "none":
        return f"acc {100 * row['accuracy_median']:.2f} %"
    if "gap_median" not in row:
        return "no paired none"
    verdict = "-"
    if "meets_target" in row:
        verdict = "met" if row["meets_target"] else "MISSED"
    return (
        f"{row['gap_median']:+.2f} [{row['gap_min']:+.2f}, {row['gap_max']:+.2f}] "
        f"/ {row['reduction']:.1f}x / {verdict}"
    )


def tables(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table per model (and strategy): one row per spec, one column per world,
    each cell "median gap [min, max] (pp) / reduction / verdict"."""
    out = []
    worlds = sorted({int(r["world"]) for r in rows})
    for model, strategy in dict.fromkeys((r["model"], r["strategy"]) for r in rows):
        mine = [r for r in rows if r["model"] == model and r["strategy"] == strategy]
        by = {(r["spec"], int(r["world"])): r for r in mine}
        specs = list(dict.fromkeys(r["spec"] for r in mine))
        seeds = sorted({s for r in mine for s in r["seeds"]})
        out += [
            f"**{model}**, {strategy}, seeds {', '.join(map(str, seeds))}: "
            "gap to `none` in pp, median [min, max] / wire-byte reduction / verdict",
            "",
            "| compression | target | " + " | ".join(f"world {w}" for w in worlds) + " |",
            "|---|---|" + "---|" * len(worlds),
        ]
        for spec in specs:
            target = next((r["target"] for r in mine if r["spec"] == spec and "target" in r), "-")
            cells = " | ".join(_cell(by.get((spec, w))) for w in worlds)
            out.append(f"| `{spec}` | {target} | {cells} |")
        out.append("")
    return "\n".join(out).rstrip()


def summarize_time_to(records: Sequence[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """Per (model, spec) of the time-to runs: median seconds to ``target`` over the seeds
    that reached it, and the ratio of each spec's median to ``none``'s of the same model."""
    rows: list[dict[str, Any]] = []
    for model, spec in dict.fromkeys((r["model"], r["spec"]) for r in records):
        runs = [r for r in records if r["model"] == model and r["spec"] == spec]
        reached = [t for t in (time_to_accuracy(r["history"], target) for r in runs) if t]
        rows.append(
            {
                "model": model,
                "spec": spec,
                "world": runs[0]["world"],
                "link": runs[0]["link"],
                "runs": len(runs),
                "reached": len(reached),
                "seconds_median": (
                    statistics.median(t["seconds"] for t in reached) if reached else None
                ),
                "epoch_median": statistics.median(t["epoch"] for t in reached) if reached else None,
                "load1": [r["load1"] for r in runs],
            }
        )
    for row in rows:
        ref = next(r for r in rows if r["model"] == row["model"] and r["spec"] == "none")
        a, b = row["seconds_median"], ref["seconds_median"]
        row["vs_none"] = a / b if a is not None and b else None
    return rows


def time_to_table(rows: Sequence[dict[str, Any]], target: float) -> str:
    lines = [
        f"Training time to validation accuracy {target:g} (sum of epoch times up to the "
        "first epoch reaching it; median over the seeds that reached it):",
        "",
        "| model | world | link | compression | reached | epoch | seconds | vs none "
        "| load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        secs = "-" if r["seconds_median"] is None else f"{r['seconds_median']:.1f}"
        epoch = "-" if r["epoch_median"] is None else f"{r['epoch_median']:g}"
        ratio = "-" if r["vs_none"] is None else f"{r['vs_none']:.2f}x"
        load = ", ".join(f"{x:.1f}" for x in r["load1"])
        lines.append(
            f"| {r['model']} | {r['world']} | {r['link']} | `{r['spec']}` "
            f"| {r['reached']}/{r['runs']} | {epoch} | {secs} | {ratio} | {load} |"
        )
    return "\n".join(lines)


def render(data: dict[str, Any]) -> str:
    """The results-page text of a ``compression_worlds.json``: the tables and the
    time-to-accuracy table when the run had one."""
    if data.get("format") != FORMAT:
        raise KeyError(f"format {data.get('format')!r}, expected {FORMAT!r}")
    loads = [r["load1"] for r in data["records"]]
    parts = [
        tables(data["rows"]),
        "",
        f"Global batch {data['config']['global_batch']}, {data['config']['epochs']} epochs, "
        f"drop_last {data['config']['drop_last']}; load average (1 min) during the runs "
        f"{min(loads):.1f}-{max(loads):.1f}.",
    ]
    tt = data.get("time_to")
    if tt:
        parts += ["", time_to_table(tt["rows"], tt["target"])]
    return "\n".join(parts)


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Two panels per model: median gap (pp) against world size and byte reduction
    against world size, one line per spec, the targets drawn as dashed lines."""
    plt = pyplot()
    import matplotlib.ticker

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.5 * len(models)), squeeze=False)
    for (gap_ax, red_ax), model in zip(axes, models, strict=True):
        mine = [
            r for r in rows if r["model"] == model and "gap_median" in r and r["spec"] != "none"
        ]
        for label in dict.fromkeys(f"{r['spec']} ({r['strategy']})" for r in mine):
            line = sorted(
                (r for r in mine if f"{r['spec']} ({r['strategy']})" == label),
                key=lambda r: r["world"],
            )
            worlds = [r["world"] for r in line]
            gap_ax.errorbar(
                worlds,
                [r["gap_median"] for r in line],
                yerr=[
                    [r["gap_median"] - r["gap_min"] for r in line],
                    [r["gap_max"] - r["gap_median"] for r in line],
                ],
                marker="o",
                capsize=3,
                label=label,
            )
            red_ax.plot(worlds, [r["reduction"] for r in line], marker="o", label=label)
        for pp in sorted({t[0] for t in TARGETS.values()}):
            gap_ax.axhline(pp, ls="--", c="grey", lw=0.8)
        red_ax.axhline(TARGETS[TOPK][1] or 1.0, ls="--", c="grey", lw=0.8)
        gap_ax.set(
            xlabel="world size",
            ylabel="gap to none (pp, median, bars min-max)",
            title=f"digits {model}: accuracy gap (targets 0.5 / 1 pp dashed)",
        )
        red_ax.set(
            xlabel="world size",
            ylabel="wire-byte reduction (x, log)",
            yscale="log",
            title=f"digits {model}: bytes (target 25x dashed)",
        )
        for ax in (gap_ax, red_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["world"] for r in rows}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.grid(True, alpha=0.3)
        # plain numbers on the log axis: "30" reads better than "3 x 10^1"
        red_ax.get_yaxis().set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        red_ax.get_yaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        red_ax.get_yaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        gap_ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------- the runs
def check_variants(variants: Sequence[Variant]) -> None:
    """Fail before any Spark stage when a spec does not parse or a forced path needs the
    ``compression_path`` config key this build lacks: a long bench must not die midway."""
    from sparktrain.compress.registry import build
    from sparktrain.config import TrainConfig

    for v in variants:
        build(v.spec)  # raises ConfigError naming what is wrong with the spec
    has_key = "compression_path" in {f.name for f in dataclasses.fields(TrainConfig)}
    if any(v.path for v in variants) and not has_key:
        raise ConfigError(
            "a forced compression_path row needs TrainConfig's compression_path key "
            "(issue 21's top-k exchange); run without --ablation on this build"
        )


def record_key(r: dict[str, Any]) -> tuple[str, str, int, int, str]:
    """What makes a grid run: (model, strategy, world, seed, spec label)."""
    return (r["model"], str(r["strategy"]), int(r["world"]), int(r["seed"]), r["spec"])


def load_earlier(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """An earlier run's JSON for ``--add-to``: its records are kept (and its time-to
    block, unless ``--time-to`` runs again), only the grid's missing runs are trained.
    Refused when it was measured another way (global batch, epochs, drop_last)."""
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ConfigError(f"--add-to {path}: not a {FORMAT} file")
    cfg = data["config"]
    mine = {"global_batch": args.global_batch, "epochs": args.epochs, "drop_last": args.drop_last}
    other = {k: v for k, v in mine.items() if cfg.get(k) != v}
    if other:
        raise ConfigError(
            f"--add-to {path} was measured with "
            + ", ".join(f"{k}={cfg.get(k)!r}" for k in other)
            + f"; this run has {', '.join(f'{k}={v!r}' for k, v in other.items())}: "
            "give the same settings or write a new file"
        )
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--quality")
    parser.add_argument(
        "--config",
        nargs="+",
        metavar="TOML",
        help="--quality: train these shipped configs as they are (their per-worker batch "
        "and recipe; num_workers, seed and compression set per run) instead of the "
        "fixed-global-batch grid",
    )
    parser.add_argument(
        "--force-paths",
        nargs="+",
        default=[],
        metavar="PATH",
        help="--config: also train every compressed spec on these compression_path values",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=64,
        help="--quality: samples per step at every world (per worker: global / world)",
    )
    parser.add_argument("--ablation", action="store_true", help="--quality: one row per DGC remedy")
    parser.add_argument(
        "--local-clip", type=float, default=5.0, help="--ablation: DGC local_clip's C"
    )
    parser.add_argument(
        "--warmup-epochs",
        type=float,
        default=4.0,
        help="--ablation: sparsity warm-up length in epochs at the global batch",
    )
    parser.add_argument(
        "--time-to",
        type=float,
        metavar="ACC",
        help="--quality: also time none and --time-to-spec to this validation accuracy",
    )
    parser.add_argument("--time-to-spec", default="topk:0.01+ef:momentum=0.9")
    parser.add_argument("--time-to-world", type=int, default=4)
    parser.add_argument("--link", default="5g", help="--time-to: the emulated link profile")
    parser.add_argument(
        "--add-to",
        metavar="JSON",
        help="--quality: keep this earlier run's records and train only the missing runs "
        "(e.g. another strategy's rows)",
    )


def main(
    args: argparse.Namespace, specs: Sequence[str], quality_run: Callable[..., dict[str, Any]]
) -> int:
    """The grid (models x worlds x seeds x specs), then the time-to-accuracy runs;
    ``quality_run`` is :func:`benchmarks.compression.quality_run` (passed in, as
    that module imports this one)."""
    from sparktrain import datasets
    from sparktrain.session import get_or_create_session

    worlds = sorted(set(args.worlds))
    if min(worlds) < 1 or args.epochs < 1 or not args.seeds:
        raise ConfigError("--worlds and --epochs must be >= 1 and --seeds name one seed at least")
    batches = {w: per_worker_batch(args.global_batch, w) for w in worlds}
    split = datasets.digits()
    variants = [Variant(s) for s in dict.fromkeys(["none", *specs])]
    if args.ablation:
        per_epoch = steps_per_epoch(len(split.y_train), args.global_batch, args.drop_last)
        warmup = max(1, round(args.warmup_epochs * per_epoch))
        variants += ablation_variants(args.local_clip, warmup)
    timed = [Variant("none"), Variant(args.time_to_spec)] if args.time_to is not None else []
    check_variants([*variants, *timed])
    if timed:
        from sparktrain.wire.link import PROFILES

        per_worker_batch(args.global_batch, args.time_to_world)
        if args.link not in PROFILES:
            raise ConfigError(f"--link {args.link!r}: use one of {', '.join(PROFILES)}")

    def run(spark: Any, frames: Any, model: str, strategy: str, v: Variant, world: int,
            seed: int, link: str = "none") -> dict[str, Any]:  # fmt: skip
        rec = quality_run(
            spark, frames, model, strategy, v.spec, world, args.epochs, args.drop_last,
            seed=seed, batch_size=per_worker_batch(args.global_batch, world), link=link,
            compression_path=v.path,
        )  # fmt: skip
        rec["spec"], rec["compression"] = v.label, v.spec
        rec["global_batch"], rec["load1"] = args.global_batch, os.getloadavg()[0]
        print(json.dumps({k: v for k, v in rec.items() if k != "history"}), flush=True)
        return rec

    def session(world: int) -> tuple[Any, Any]:
        spark = get_or_create_session(f"local[{world}]", app_name="sparktrain-bench-worlds")
        frames = (
            datasets.to_dataframe(spark, split.x_train, split.y_train, world),
            datasets.to_dataframe(spark, split.x_test, split.y_test, world),
        )
        # warm-up: the first stage pays for Python workers and torch imports
        quality_run(spark, frames, "mlp", "ring", "none", world, 1, batch_size=batches.get(world))
        return spark, frames

    earlier = load_earlier(args.add_to, args) if args.add_to else None
    records: list[dict[str, Any]] = list(earlier["records"]) if earlier else []
    done = {record_key(r) for r in records}
    for world in worlds:
        todo = [
            (model, strategy, seed, v)
            for model in args.models
            for strategy in args.strategies
            for seed in args.seeds
            for v in variants
            if (model, "ps-sync" if strategy == "ps" else strategy, world, seed, v.label)
            not in done
        ]
        if not todo:
            continue
        spark, frames = session(world)
        for model, strategy, seed, v in todo:
            records.append(run(spark, frames, model, strategy, v, world, seed))
        spark.stop()
    rows = aggregate(records)
    data: dict[str, Any] = {
        "format": FORMAT,
        "config": {
            "global_batch": args.global_batch,
            "epochs": args.epochs,
            "drop_last": args.drop_last,
            "seeds": sorted({int(r["seed"]) for r in records}),
            "per_worker_batch": {
                str(w): per_worker_batch(args.global_batch, w)
                for w in sorted({int(r["world"]) for r in records})
            },
        },
        "records": records,
        "rows": rows,
        "time_to": earlier.get("time_to") if earlier else None,
    }
    if timed:
        spark, frames = session(args.time_to_world)
        timed_records = [
            run(spark, frames, model, "ring", v, args.time_to_world, seed, link=args.link)
            for model in args.models
            for seed in args.seeds
            for v in timed  # interleaved: none, then the spec, seed by seed
        ]
        spark.stop()
        data["time_to"] = {
            "target": args.time_to,
            "records": timed_records,
            "rows": summarize_time_to(timed_records, args.time_to),
        }
    print(render(data))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"records written to {path}")
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"plot written to {args.plot}")
    return 0


# ---------------------------------------------------------------------- shipped configs
SHIPPED_FORMAT = "compression_shipped/1"
SHIPPED_SPECS = ["none", TOPK]


def config_values(conf: str, world: int, seed: int, v: Variant) -> dict[str, Any]:
    """The flat config values of ``sparktrain train conf --set num_workers=world --set
    seed=seed --set compression=spec``: the file's, with the run's world, seed, spec and
    forced path (a spec with ``+ef:momentum=M`` of its own runs the optimizer without
    momentum, as the config requires). ``comm_timeout`` is raised to 600 s so that a
    loaded machine does not fail a rendezvous; accuracy and bytes do not depend on it."""
    from sparktrain.compress.registry import build
    from sparktrain.config import load_toml

    values = dict(load_toml(conf))
    values.update(
        num_workers=world,
        seed=seed,
        compression=v.spec,
        progress=False,
        comm_timeout=max(600.0, float(values.get("comm_timeout", 60.0))),
    )
    if v.path is not None:
        values["compression_path"] = v.path
    if getattr(build(v.spec), "momentum", 0.0):  # DGC written out: the optimizer's is 0
        values["optimizer_kwargs"] = {**values.get("optimizer_kwargs", {}), "momentum": 0.0}
    return values


def config_run(
    spark: Any, frames: Any, conf: str, v: Variant, world: int, seed: int
) -> dict[str, Any]:
    """One run of a shipped config as a record (the summary's figures)."""
    import time

    from sparktrain import Trainer
    from sparktrain.cli import split_job_keys
    from sparktrain.config import TrainConfig

    job, rest = split_job_keys(config_values(conf, world, seed, v))
    cfg = TrainConfig.from_dict(rest)
    started = time.perf_counter()
    trainer = Trainer(job["model"], cfg, model_kwargs=job["model_kwargs"], spark=spark)
    s = trainer.fit(frames[0], validation_data=frames[1]).summary
    return {
        "model": Path(conf).stem,
        "config": conf,
        "strategy": str(s.get("strategy", cfg.strategy)),
        "world": world,
        "seed": seed,
        "spec": v.label,
        "compression": v.spec,
        "trained_as": s.get("compression"),  # the spec the job ran (momentum moved in)
        "compression_path": s.get("compression_path"),
        "compression_path_forced": v.path,
        "accuracy": float(s["metric_value"]),
        "wire_bytes": int(s["wire_bytes"]),
        "raw_bytes": int(s["bytes_sent"]),
        "batch_size": int(cfg.batch_size),
        "steps_per_epoch": int(s["steps_per_epoch"]),
        "epochs": int(cfg.epochs),
        "wall_s": time.perf_counter() - started,
        "load1": os.getloadavg()[0],
        "history": [
            {"epoch": h["epoch"], "metric": h["metric"], "seconds": h["seconds"]}
            for h in s["history"]
        ],
    }


def _mean_sd(xs: Sequence[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.fmean(xs):.2f} ± {100 * sd:.2f}"


def shipped_rows(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (config, world, spec label): accuracy mean and sd over the seeds, the mean
    paired gap to ``none`` of the same seed (pp), the median wire-byte ratio, the paths
    taken and the verdict against ``topk:0.01+ef``'s target (mean gap, median ratio)."""
    base = {
        (r["model"], int(r["world"]), int(r["seed"])): r for r in records if r["spec"] == "none"
    }
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["model"], int(r["world"]), r["spec"]), []).append(r)
    rows = []
    for (model, world, spec), runs in groups.items():
        accs = [r["accuracy"] for r in runs]
        row: dict[str, Any] = {
            "model": model,
            "world": world,
            "spec": spec,
            "seeds": sorted(int(r["seed"]) for r in runs),
            "accuracy_mean": statistics.fmean(accs),
            "accuracy_sd": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "accuracy": _mean_sd(accs),
            "wire_mb": statistics.fmean(r["wire_bytes"] for r in runs) / 1e6,
            "paths": sorted({str(r.get("compression_path")) for r in runs}),
            "trained_as": sorted({str(r.get("trained_as")) for r in runs}),
            "batch_size": runs[0]["batch_size"],
            "steps_per_epoch": runs[0]["steps_per_epoch"],
        }
        pairs = [
            (base[(model, world, int(r["seed"]))], r)
            for r in runs
            if (model, world, int(r["seed"])) in base
        ]
        if pairs and spec != "none":
            row["gap_mean"] = statistics.fmean(
                100 * (b["accuracy"] - r["accuracy"]) for b, r in pairs
            )
            row["ratio"] = statistics.median(
                b["wire_bytes"] / max(r["wire_bytes"], 1) for b, r in pairs
            )
            target = target_for(runs[0]["compression"])
            if target is not None:
                row["target"] = f"<= {target[0]:g} pp" + (
                    f", >= {target[1]:g}x" if target[1] else ""
                )
                row["meets_target"] = row["gap_mean"] <= target[0] + 1e-9 and (
                    target[1] is None or row["ratio"] >= target[1]
                )
        rows.append(row)
    return rows


def shipped_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per (config, world, spec)."""
    lines = [
        "| config | world | batch (per worker) | steps/epoch | compression | accuracy % "
        "(mean ± sd) | gap (pp) | wire MB | ratio | path | trained as | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["model"], r["world"], r["spec"] != "none")):
        gap = f"{r['gap_mean']:+.2f}" if "gap_mean" in r else "-"
        ratio = f"{r['ratio']:.1f}x" if "ratio" in r else "-"
        verdict = "-"
        if "meets_target" in r:
            verdict = "met" if r["meets_target"] else "MISSED"
        paths = ", ".join(p for p in r["paths"] if p != "None") or "-"
        trained = ", ".join(f"`{t}`" for t in r["trained_as"] if t not in ("None", r["spec"]))
        lines.append(
            f"| {r['model']} | {r['world']} | {r['batch_size']} | {r['steps_per_epoch']} "
            f"| `{r['spec']}` | {r['accuracy']} | {gap} | {r['wire_mb']:.2f} | {ratio} "
            f"| {paths} | {trained or '-'} | {verdict} |"
        )
    return "\n".join(lines)


def render_shipped(data: dict[str, Any]) -> str:
    """The results-page text of a ``compression_shipped.json``: the table and the load."""
    if data.get("format") != SHIPPED_FORMAT:
        raise KeyError(f"format {data.get('format')!r}, expected {SHIPPED_FORMAT!r}")
    loads = [r["load1"] for r in data["records"]]
    return (
        shipped_table(data["rows"])
        + f"\n\nLoad average (1 min) during the runs {min(loads):.1f}-{max(loads):.1f}."
    )


def config_main(args: argparse.Namespace, specs: Sequence[str]) -> int:
    """``--quality --config``: the shipped configs at every world and seed."""
    from sparktrain import datasets
    from sparktrain.cli import split_job_keys
    from sparktrain.session import get_or_create_session

    worlds = sorted(set(args.worlds))
    if min(worlds) < 1 or not args.seeds:
        raise ConfigError("--worlds must be >= 1 and --seeds name one seed at least")
    variants = [Variant(s) for s in dict.fromkeys(["none", *specs])]
    variants += [
        Variant(v.spec, p) for p in args.force_paths for v in list(variants) if v.spec != "none"
    ]
    check_variants(variants)
    jobs = {}
    for conf in args.config:
        job, _ = split_job_keys(config_values(conf, worlds[0], args.seeds[0], variants[0]))
        jobs[conf] = job
    earlier = json.loads(Path(args.add_to).read_text()) if args.add_to else None
    if earlier is not None and earlier.get("format") != SHIPPED_FORMAT:
        raise ConfigError(f"--add-to {args.add_to}: not a {SHIPPED_FORMAT} file")
    records: list[dict[str, Any]] = list(earlier["records"]) if earlier else []
    done = {(r["config"], int(r["world"]), int(r["seed"]), r["spec"]) for r in records}
    for world in worlds:
        todo = [
            (conf, seed, v)
            for conf in args.config
            for seed in args.seeds
            for v in variants
            if (conf, world, seed, v.label) not in done
        ]
        if not todo:
            continue
        spark = get_or_create_session(f"local[{world}]", app_name="sparktrain-bench-shipped")
        frames = {}
        for conf, job in jobs.items():
            split = datasets.load(job["dataset"], **job["dataset_kwargs"])
            frames[conf] = (
                datasets.to_dataframe(spark, split.x_train, split.y_train, world),
                datasets.to_dataframe(spark, split.x_test, split.y_test, world),
            )
        for conf, seed, v in todo:
            rec = config_run(spark, frames[conf], conf, v, world, seed)
            records.append(rec)
            print(json.dumps({k: x for k, x in rec.items() if k != "history"}), flush=True)
        spark.stop()
    data = {"format": SHIPPED_FORMAT, "records": records, "rows": shipped_rows(records)}
    print(render_shipped(data))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"records written to {path}")
    return 0
