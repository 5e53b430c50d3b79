"""Scaling benchmark: measured world sizes 1, 2, 4 and the alpha-beta model beyond.

    sparktrain bench scaling [--worlds 1 2 4] [--workload synthetic|digits] \
        [--links none 5g] [--out docs/results]

Three parts, written to ``OUT/scaling.json`` and plotted to ``OUT/scaling.png``:

1. **Links**: alpha and beta measured by :func:`sparktrain.task.probe.probe_links`
   between two ranks (threads of this process, one mesh) on loopback and on each
   emulated ``--links`` profile (:mod:`sparktrain.wire.link`, the shaping training uses),
   with more repeats and a larger transfer (``--transfer``, default 4 MiB: the ring's
   chunk size) than the stage-start probe, whose 256 KiB transfer underestimates
   loopback bandwidth.
2. **Measured scaling**: the real :class:`~sparktrain.Trainer` on ``local[w]`` for every
   ``--worlds`` entry (ring, 1 torch thread per worker, per-worker batch fixed, so an
   epoch has ``1/w`` the steps). **This machine has ``os.cpu_count()`` cores (2 where this
   was written): world 4 runs 4 single-threaded workers on 2 cores, 2x oversubscribed, so
   its figures show contention, not what 4 machines would do.** Each world's step time is
   set beside the cost model's prediction (compute from the world-1 run, alpha/beta from
   part 1).
3. **Predictions** for 8 to 1024 workers: per-step communication time of ring, tree and
   the parameter server (and ``tree_aggregate``'s round when ``bench mllib`` measured its
   Spark job overhead, read from ``--mllib-json``) with the measured alpha and beta, for
   the digits MLP (9,610 parameters) and a 25M-parameter model, gradients in 25 MiB
   buckets. These are model outputs, not measurements, and say so in the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.plots import pyplot, save_figure
from sparktrain import costmodel, strategies
from sparktrain.errors import ConfigError

log = logging.getLogger(__name__)

PREDICT_WORLDS = [2**k for k in range(3, 11)]  # 8 .. 1024
MODEL_SIZES = {"digits MLP (9,610 params)": 9_610 * 4, "25M params": 25_000_000 * 4}
BUCKET_BYTES = 25 << 20
WORKLOADS = {
    # (dataset, dataset kwargs, model kwargs for sparktrain.models:mlp, per-worker batch)
    "synthetic": (
        "synthetic",
        {"n": 20_000, "features": 256},
        {"in_features": 256, "hidden": [512, 512], "out_features": 10},
        64,
    ),
    "digits": ("digits", {}, {"in_features": 64, "hidden": [128], "out_features": 10}, 32),
}


# ---------------------------------------------------------------------- links
def measure_link(profile: str, transfer_bytes: int, repeats: int) -> dict[str, Any]:
    """alpha and beta between two thread ranks over one mesh shaped by ``profile``."""
    import threading

    from sparktrain.task.probe import probe_links
    from sparktrain.wire import Mesh, address_of, open_listener
    from sparktrain.wire.link import link_profile

    link = link_profile(profile)
    listeners = [open_listener("127.0.0.1") for _ in range(2)]
    addresses = [address_of(s) for s in listeners]
    out: list[Any] = [None, None]
    secret = os.urandom(32)

    def rank(r: int) -> None:
        try:
            with Mesh(
                r, 2, listeners[r], addresses, secret, "bench-scaling", 0, 30.0, link=link
            ) as mesh:
                out[r] = probe_links(
                    mesh, pings=repeats, transfers=repeats, transfer_bytes=transfer_bytes
                )
        except BaseException as exc:  # reported below
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120.0)
        if t.is_alive():
            raise TimeoutError(f"the link probe on {profile!r} did not finish in 120 s")
    for r in out:
        if isinstance(r, BaseException):
            raise r
    est = out[0]
    return {
        "profile": profile,
        "describe": link.describe() if link is not None else "loopback, unshaped",
        "alpha_s": est.alpha_s,
        "beta_s_per_byte": est.beta_s_per_byte,
        "bandwidth_mbit_s": 8e-6 / est.beta_s_per_byte if est.beta_s_per_byte else None,
        "transfer_bytes": transfer_bytes,
        "repeats": repeats,
        "probe_s": est.probe_s,
    }


# ---------------------------------------------------------------------- worlds
def measure_worlds(
    worlds: list[int], workload: str, epochs: int, timeout: float
) -> list[dict[str, Any]]:
    """Train ``workload`` with the ring on ``local[w]`` for each world; one session each."""
    from pyspark.sql import SparkSession

    from sparktrain import TrainConfig, Trainer, datasets
    from sparktrain.session import get_or_create_session

    name, data_kwargs, model_kwargs, batch = WORKLOADS[workload]
    split = datasets.load(name, **data_kwargs)
    rows = []
    for world in worlds:
        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()
        spark = get_or_create_session(f"local[{world}]", app_name="sparktrain-bench-scaling")
        spark.sparkContext.parallelize(range(world), world).count()  # warm the workers up
        train = datasets.to_dataframe(spark, split.x_train, split.y_train, world)
        test = datasets.to_dataframe(spark, split.x_test, split.y_test, world)
        cfg = TrainConfig(
            strategy="ring",
            epochs=epochs,
            batch_size=batch,
            lr=0.05,
            optimizer="sgd",
            optimizer_kwargs={"momentum": 0.9},
            num_workers=world,
            threads_per_worker=1,
            progress=False,
            comm_timeout=timeout,
        )
        started = time.perf_counter()
        s = (
            Trainer("sparktrain.models:mlp", cfg, model_kwargs=model_kwargs, spark=spark)
            .fit(train, validation_data=test)
            .summary
        )
        steps = s["steps_per_epoch"] * epochs
        rows.append(
            {
                "world": world,
                "cores": os.cpu_count(),
                "oversubscription": world / (os.cpu_count() or 1),
                "epochs": epochs,
                "steps": steps,
                "train_s": s["train_s"],
                "comm_s": s["comm_s"],
                "step_s": s["train_s"] / steps,
                "comm_step_s": s["comm_s"] / steps,
                "samples_per_s": s["samples_per_s"],
                "metric": s["metric_value"],
                "wall_s": time.perf_counter() - started,
                "num_parameters": s["num_parameters"],
            }
        )
        log.info("world %d: %s", world, rows[-1])
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    base = next((r for r in rows if r["world"] == 1), None)
    for r in rows:
        r["speedup"] = r["samples_per_s"] / base["samples_per_s"] if base else None
    return rows


def predict_measured(rows: list[dict[str, Any]], link: dict[str, Any]) -> None:
    """Add the cost model's step time to each measured world: compute = world 1's whole
    step (forward, backward, bucket copies and the optimizer: every world pays them; a
    world of one exchanges nothing), plus the ring's time with alpha/beta from loopback."""
    base = next((r for r in rows if r["world"] == 1), None)
    if base is None:
        return
    compute = base["step_s"]
    for r in rows:
        nbytes = r["num_parameters"] * 4
        comm = costmodel.ring_allreduce_s(
            nbytes,
            r["world"],
            link["alpha_s"],
            link["beta_s_per_byte"],
            calls=costmodel.buckets_for(nbytes, BUCKET_BYTES),
        )
        r["predicted_comm_step_s"] = comm
        r["predicted_step_s"] = compute + comm


# ---------------------------------------------------------------------- predictions
def predictions(
    links: list[dict[str, Any]], job_overhead_s: float | None, depth: int = 2
) -> list[dict[str, Any]]:
    """Per-step communication time by strategy, world, model size and link."""
    out = []
    for link in links:
        a, b = link["alpha_s"], link["beta_s_per_byte"]
        for model, nbytes in MODEL_SIZES.items():
            calls = costmodel.buckets_for(nbytes, BUCKET_BYTES)
            for p in PREDICT_WORLDS:
                row = {
                    "link": link["profile"],
                    "model": model,
                    "model_bytes": nbytes,
                    "world": p,
                    # each strategy's own term of the cost model
                    **{
                        f"{name}_s": strategies.get(name).comm_s(nbytes, p, a, b, buckets=calls)
                        for name in ("ring", "tree", "ps")
                    },
                }
                if job_overhead_s is not None:
                    row["tree_aggregate_s"] = costmodel.tree_aggregate_round_s(
                        nbytes, p, a, b, job_overhead_s, depth
                    )
                out.append(row)
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    """One panel per (model size, link): predicted seconds per step against workers."""
    plt = pyplot()

    links = [link["profile"] for link in report["links"]]
    models = list(MODEL_SIZES)
    fig, axes = plt.subplots(
        len(models), len(links), figsize=(5.2 * len(links), 3.8 * len(models)), squeeze=False
    )
    styles = {"ring_s": "o-", "tree_s": "s-", "ps_s": "^-", "tree_aggregate_s": "x--"}
    for i, model in enumerate(models):
        for j, link in enumerate(links):
            ax = axes[i][j]
            rows = [r for r in report["predictions"] if r["model"] == model and r["link"] == link]
            for key, style in styles.items():
                if rows and key in rows[0]:
                    ax.plot(
                        [r["world"] for r in rows],
                        [r[key] for r in rows],
                        style,
                        markersize=3,
                        label=key.removesuffix("_s"),
                    )
            info = next(x for x in report["links"] if x["profile"] == link)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(
                f"{model}, {link}: alpha {info['alpha_s'] * 1e6:.0f} us, "
                f"{(info['bandwidth_mbit_s'] or 0):.0f} Mbit/s",
                fontsize=9,
            )
            ax.set_xlabel("workers")
            ax.set_ylabel("predicted comm s / step")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.suptitle(
        "alpha-beta model with measured alpha, beta (predictions, not measurements)", fontsize=10
    )
    save_figure(fig, path)


# ---------------------------------------------------------------------- auto vs fixed
FIXED_STRATEGIES = costmodel.AUTO_STRATEGIES
FIXED_COMPRESSIONS = costmodel.AUTO_COMPRESSIONS


def compare_auto(
    profiles: list[str], epochs: int, world: int, timeout: float, repeats: int = 1
) -> list[dict[str, Any]]:
    """Digits on ``local[world]`` with every fixed (strategy, compression) that ``auto``
    chooses from, and with ``auto``, on each link profile: ``repeats`` rounds over the
    whole grid (interleaved, so a burst of load elsewhere hits one round, not one
    configuration); each configuration keeps its fastest round."""
    from pyspark.sql import SparkSession

    from sparktrain import TrainConfig, Trainer, datasets
    from sparktrain.session import get_or_create_session

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    spark = get_or_create_session(f"local[{world}]", app_name="sparktrain-bench-auto")
    spark.sparkContext.parallelize(range(world), world).count()
    split = datasets.digits()
    train = datasets.to_dataframe(spark, split.x_train, split.y_train, world)
    test = datasets.to_dataframe(spark, split.x_test, split.y_test, world)
    rows = []
    try:
        # a discarded first fit: the session's first training pays one-off costs (torch
        # import in the Python workers, first Arrow conversion) that no grid entry should
        warm = TrainConfig(epochs=1, num_workers=world, progress=False, comm_timeout=timeout)
        Trainer("sparktrain.models:digits_mlp", warm, spark=spark).fit(train)
        for profile, _round in itertools.product(profiles, range(repeats)):
            grid = [("auto", "auto")] + [
                (s, c) for c in FIXED_COMPRESSIONS for s in FIXED_STRATEGIES
            ]
            for strategy, compression in grid:
                cfg = TrainConfig(
                    strategy=strategy,
                    compression=compression,
                    link_profile=profile,
                    epochs=epochs,
                    batch_size=32,
                    lr=0.05,
                    optimizer="sgd",
                    optimizer_kwargs={"momentum": 0.9},
                    num_workers=world,
                    threads_per_worker=1,
                    progress=False,
                    comm_timeout=timeout,
                )
                s = (
                    Trainer("sparktrain.models:digits_mlp", cfg, spark=spark)
                    .fit(train, validation_data=test)
                    .summary
                )
                auto = s.get("auto")
                decide = auto["decide_s"] if auto else 0.0
                rows.append(
                    {
                        "link": profile,
                        "strategy": strategy,
                        "compression": compression,
                        "chosen": f"{auto['strategy']}/{auto['compression']}" if auto else None,
                        "reason": auto["reason"] if auto else None,
                        "predicted_s": auto["candidates"] if auto else None,
                        "train_s": s["train_s"],
                        "decide_s": decide,
                        "time_s": s["train_s"] + decide,
                        "metric": s["metric_value"],
                        "wire_bytes": s["wire_bytes"],
                    }
                )
                log.info("%s %s/%s: %.2f s", profile, strategy, compression, rows[-1]["time_s"])
    finally:
        spark.stop()
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["link"], r["strategy"], r["compression"])
        if key not in best or r["time_s"] < best[key]["time_s"]:
            best[key] = {**r, "rounds_s": [*best.get(key, {}).get("rounds_s", []), r["time_s"]]}
        else:
            best[key]["rounds_s"].append(r["time_s"])
    return list(best.values())


def auto_verdicts(rows: list[dict[str, Any]], tolerance: float = 0.10) -> list[dict[str, Any]]:
    """Per link: auto's time (probe and choice included) against the best fixed run."""
    out = []
    for link in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == link]
        auto = next(r for r in mine if r["strategy"] == "auto")
        best = min((r for r in mine if r["strategy"] != "auto"), key=lambda r: r["time_s"])
        ratio = auto["time_s"] / best["time_s"]
        out.append(
            {
                "link": link,
                "auto_chose": auto["chosen"],
                "auto_s": auto["time_s"],
                "best_fixed": f"{best['strategy']}/{best['compression']}",
                "best_fixed_s": best["time_s"],
                "ratio": ratio,
                "within_10_percent": ratio <= 1.0 + tolerance,
            }
        )
    return out


# ---------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="synthetic")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument(
        "--links",
        nargs="+",
        default=["none", "5g"],
        help="link profiles to measure alpha/beta on (none = loopback)",
    )
    parser.add_argument("--transfer", default="4M", help="bytes per bandwidth transfer")
    parser.add_argument("--repeats", type=int, default=5, help="pings and transfers per link")
    parser.add_argument(
        "--mllib-json",
        default="docs/results/bench_mllib.json",
        help="bench mllib report with the measured tree_aggregate round overhead",
    )
    parser.add_argument("--no-train", action="store_true", help="skip the measured worlds")
    parser.add_argument("--timeout", type=float, default=120.0, help="comm_timeout of the runs")
    parser.add_argument("--out", default="docs/results", help="directory for JSON and PNG")
    parser.add_argument(
        "--auto",
        action="store_true",
        help="instead: digits with auto against every fixed ring/tree x compressor, per "
        "--links profile (OUT/auto_vs_fixed.json)",
    )
    parser.add_argument("--auto-epochs", type=int, default=10)
    parser.add_argument(
        "--auto-repeats", type=int, default=1, help="rounds over the grid (fastest kept)"
    )


def main(args: argparse.Namespace) -> int:
    from benchmarks.allreduce import parse_size

    if args.auto:
        return main_auto(args)
    if "none" not in args.links:
        raise ConfigError("--links must include 'none' (loopback): the measured worlds use it")
    cores = os.cpu_count() or 1
    links = [measure_link(p, parse_size(args.transfer), args.repeats) for p in args.links]
    for link in links:
        print(
            f"link {link['profile']:>5}: alpha {link['alpha_s'] * 1e6:8.1f} us, "
            f"bandwidth {link['bandwidth_mbit_s']:9.1f} Mbit/s ({link['describe']})"
        )
    overhead = None
    mllib = Path(args.mllib_json)
    if mllib.is_file():
        overhead = json.loads(mllib.read_text()).get("round_rate", {}).get("round_overhead_s")
    measured: list[dict[str, Any]] = []
    note = (
        f"this machine has {cores} cores; world w runs w single-threaded workers, so world "
        f"{max(args.worlds)} is {max(args.worlds) / cores:g}x oversubscribed"
        + (
            " (its figures show CPU contention, not what separate machines would do)"
            if max(args.worlds) > cores
            else ""
        )
    )
    if not args.no_train:
        print(note)
        measured = measure_worlds(sorted(args.worlds), args.workload, args.epochs, args.timeout)
        predict_measured(measured, links[0])
        print("world | step ms (measured) | step ms (model) | comm ms/step | samples/s | speedup")
        for r in measured:
            print(
                f"{r['world']:5d} | {r['step_s'] * 1e3:18.2f} | "
                f"{r.get('predicted_step_s', float('nan')) * 1e3:15.2f} | "
                f"{r['comm_step_s'] * 1e3:12.2f} | {r['samples_per_s']:9.0f} | "
                f"{(r['speedup'] or 0):.2f}"
            )
    report = {
        "machine": {"cores": cores},
        "oversubscription": note,
        "workload": {"name": args.workload, "spec": WORKLOADS[args.workload][:3]},
        "links": links,
        "measured": measured,
        "tree_aggregate_round_overhead_s": overhead,
        "tree_aggregate_overhead_source": str(mllib) if overhead is not None else None,
        "predictions_note": (
            "alpha-beta model (sparktrain/costmodel.py) with the measured alpha and beta; "
            "comm seconds per step, 25 MiB buckets, no compute; predictions, not measurements"
        ),
        "predictions": predictions(links, overhead),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / "scaling.png")
    print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")
    return 0


def main_auto(args: argparse.Namespace) -> int:
    """``--auto``: the auto-vs-fixed comparison alone. Rows of other link profiles
    already in ``OUT/auto_vs_fixed.json`` are kept, so profiles can run one at a time."""
    path = Path(args.out) / "auto_vs_fixed.json"
    rows = compare_auto(args.links, args.auto_epochs, 2, args.timeout, args.auto_repeats)
    if path.is_file():
        kept = json.loads(path.read_text()).get("runs", [])
        rows = [r for r in kept if r["link"] not in args.links] + rows
    verdicts = auto_verdicts(rows)
    print("link | strategy/compression | time s | test acc | wire MB")
    for r in rows:
        name = f"{r['strategy']}/{r['compression']}"
        if r["chosen"]:
            name += f" -> {r['chosen']}"
        print(
            f"{r['link']:>4} | {name:34} | {r['time_s']:6.2f} | {r['metric']:.4f} | "
            f"{r['wire_bytes'] / 1e6:7.2f}"
        )
    for v in verdicts:
        print(
            f"{v['link']}: auto chose {v['auto_chose']} in {v['auto_s']:.2f} s, best fixed "
            f"{v['best_fixed']} {v['best_fixed_s']:.2f} s: ratio {v['ratio']:.2f} "
            f"({'within' if v['within_10_percent'] else 'NOT within'} 10 %)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "workload": "digits MLP, local[2], batch 32, SGD lr 0.05 momentum 0.9",
        "epochs": args.auto_epochs,
        "repeats": args.auto_repeats,
        "note": (
            "time = training loop + auto's probe and choice, fastest of the repeats; on a "
            "shared 2-core machine single runs vary by 2x or more with outside load"
        ),
        "runs": rows,
        "verdicts": verdicts,
    }
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0
