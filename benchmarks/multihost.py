"""Head to head on a network that is not loopback (issue 20): the same jobs, in one run,
on a standalone Spark cluster whose two workers live in network namespaces of their own,
linked by veths that the kernel shapes with ``tc tbf`` (:mod:`tests.cluster.netcluster`).

    sparktrain bench multihost --rate-mbit 100 --repeats 3 --json docs/results/bench_multihost.json

Needs root (namespaces, ``tc``). Two parts, each interleaved (repeat after repeat, every
contender once per repeat, so the machine's load falls on all of them alike):

* **Contenders under tbf**: the digits MLP and the synthetic 256-1024-1024-10 MLP
  (:mod:`benchmarks.train`'s recipes) trained by ``ring``, ``tree``, ``ps`` (sync),
  ``tree_aggregate`` and DDP under ``TorchDistributor(local_mode=False,
  num_processes=2)`` over the same cluster (Gloo between the namespaces), every link
  shaped at ``--rate-mbit``. Reported: time per optimizer step (the training loop's
  seconds over its steps), samples/s, accuracy on digits, the bytes sparktrain says it
  wrote (``wire_bytes``) and the bytes the veths carried.
* **Own emulation against tbf**: one job (``--compare-contenders`` on
  ``--compare-workload``) with the veths unshaped and sparktrain's link emulation at
  ``link_bandwidth_mbit = rate`` (rtt 0), against the veths shaped by ``tbf`` at the
  same rate and no emulation. Reported: median time per step of each and their ratio
  (emulated / tbf; the target is within 15 %). ``ps1`` is ``ps`` with one shard: the
  emulation gives each connection a link of its own, so a worker talking to two shards
  has twice the rate that tbf gives its one veth; with one shard the two agree.

Every record carries the 1-minute load average when it started (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import train as bench_train
from benchmarks.order import rotated
from sparktrain import datasets
from sparktrain.errors import SparkTrainError

CONTENDERS = ("ring", "tree", "ps", "tree_aggregate", "ddp")
WORKLOADS = ("digits", "synthetic")
WORKERS = 2
TARGET_RATIO = 0.15  # emulated vs tbf time per step: within 15 %
PARTS = ("contenders", "compare", "busbw")
MAX_BUSBW_WORLD = 8  # namespaces in the subnet's plan (netcluster.MAX_WORKERS)


# ---------------------------------------------------------------------- workloads
def workload(name: str, epochs: int, samples: int) -> dict[str, Any]:
    """Model, model kwargs, recipe and data of a workload (bench/train.py's recipes)."""
    if name == "digits":
        return {
            "model": bench_train.DIGITS_MODEL,
            "model_kwargs": {},
            "recipe": dict(bench_train.DIGITS_RECIPE),
            "epochs": epochs,
            "split": datasets.digits(),
            "local_steps": bench_train.TREE_AGGREGATE_LOCAL_STEPS,
        }
    if name == "synthetic":
        return {
            "model": bench_train.SYNTHETIC_MODEL,
            "model_kwargs": dict(bench_train.SYNTHETIC_KWARGS),
            "recipe": dict(bench_train.SYNTHETIC_RECIPE),
            "epochs": epochs,
            "split": datasets.synthetic(n=samples, features=256, classes=10),
            "local_steps": bench_train.SYNTHETIC_TREE_AGGREGATE_LOCAL_STEPS,
        }
    raise SparkTrainError(f"unknown workload {name!r}; use {' or '.join(WORKLOADS)}")


def frames(spark: Any, job: dict[str, Any]) -> tuple[Any, Any]:
    """The workload's train and test DataFrames, cached on the executors."""
    split = job["split"]
    train = datasets.to_dataframe(spark, split.x_train, split.y_train, WORKERS).cache()
    test = datasets.to_dataframe(spark, split.x_test, split.y_test, WORKERS).cache()
    train.count(), test.count()
    return train, test


def _veth_bytes(net: Any) -> int:
    return sum(c.sent + c.received for c in net.counters())


# ---------------------------------------------------------------------- sparktrain
def sparktrain_fit(
    spark: Any,
    net: Any,
    data: tuple[Any, Any],
    job: dict[str, Any],
    contender: str,
    link_mbit: float = 0.0,
) -> dict[str, Any]:
    """One sparktrain fit on the cluster; ``link_mbit`` > 0 turns on sparktrain's own
    link emulation at that bandwidth (no delay)."""
    from sparktrain import TrainConfig, Trainer

    strategy = "ps" if contender == "ps1" else contender
    keys: dict[str, Any] = {**job["recipe"], "epochs": job["epochs"], "strategy": strategy}
    if strategy == "ps":
        keys["ps_mode"] = "sync"
    if contender == "ps1":  # one shard: one connection per worker, as one link
        keys["ps_shards"] = 1
    if contender == "tree_aggregate":
        keys["local_steps"] = job["local_steps"]
    if link_mbit:
        keys.update(link_profile="none", link_bandwidth_mbit=float(link_mbit))
    cfg = TrainConfig(num_workers=WORKERS, progress=False, comm_timeout=120.0, **keys)
    load = os.getloadavg()[0]
    before = _veth_bytes(net)
    result = Trainer(job["model"], cfg, model_kwargs=job["model_kwargs"], spark=spark).fit(
        data[0], validation_data=data[1]
    )
    s = result.summary
    steps = int(s["steps_per_epoch"]) * int(s["epochs"])
    return {
        "train_s": s["train_s"],
        "steps": steps,
        "step_s": s["train_s"] / max(steps, 1),
        "samples_per_s": s["samples_per_s"],
        "accuracy": s["metric_value"],
        "wire_bytes": s["wire_bytes"],
        "veth_bytes": _veth_bytes(net) - before,
        "fit_s": s["wall_s"],
        "load_1m": load,
    }


# ---------------------------------------------------------------------- DDP
def ddp_train(
    model: str,
    model_kwargs: dict[str, Any],
    recipe: dict[str, Any],
    epochs: int,
    name: str,
    samples: int,
    seed: int = 0,
) -> dict[str, Any]:
    """What each TorchDistributor process runs: DDP over Gloo, the workload's model and
    recipe, every ``world``-th training row, the same number of steps on every rank;
    rank 0 scores the test split once at the end. Returns rank 0's record on every rank."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparktrain.builders import resolve_model_fn

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as sparktrain's tasks: one core per executor
    split = (
        datasets.digits()
        if name == "digits"
        else datasets.synthetic(n=samples, features=256, classes=10)
    )
    torch.manual_seed(seed)
    net = DistributedDataParallel(resolve_model_fn(model, model_kwargs)())
    x = torch.from_numpy(split.x_train[rank::world])
    y = torch.from_numpy(split.y_train[rank::world])
    batch = int(recipe["batch_size"])
    opt = torch.optim.SGD(
        net.parameters(), lr=float(recipe["lr"]), **recipe.get("optimizer_kwargs", {})
    )
    steps = math.ceil(math.ceil(len(split.x_train) / world) / batch)
    dist.barrier()
    t = time.perf_counter()
    for epoch in range(epochs):
        gen = torch.Generator().manual_seed(seed * 1000 + epoch * world + rank)
        order = torch.randperm(len(x), generator=gen)
        for step in range(steps):
            idx = order[step * batch : (step + 1) * batch]
            if len(idx) == 0:  # a shorter shard repeats a batch: DDP needs equal steps
                idx = order[:batch]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    train_s = time.perf_counter() - t
    with torch.no_grad():
        pred = net.module(torch.from_numpy(split.x_test)).argmax(1).numpy()
    record = {
        "train_s": train_s,
        "steps": steps * epochs,
        "train_samples": len(split.x_train),
        "accuracy": float((pred == split.y_test).mean()),
    }
    shared: list[Any] = [record if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    dist.destroy_process_group()
    out: dict[str, Any] = shared[0]
    return out


def ddp_fit(net: Any, job: dict[str, Any], name: str, samples: int) -> dict[str, Any]:
    """DDP under ``TorchDistributor(local_mode=False, num_processes=2)``: one barrier
    task per executor, i.e. one per namespace."""
    from pyspark.ml.torch.distributor import TorchDistributor

    load = os.getloadavg()[0]
    before = _veth_bytes(net)
    t = time.perf_counter()
    rec: dict[str, Any] | None = TorchDistributor(
        num_processes=WORKERS, local_mode=False, use_gpu=False
    ).run(
        ddp_train,
        job["model"],
        job["model_kwargs"],
        job["recipe"],
        job["epochs"],
        name,
        samples,
    )
    if rec is None:
        raise SparkTrainError("TorchDistributor returned nothing from rank 0")
    return {
        "train_s": rec["train_s"],
        "steps": rec["steps"],
        "step_s": rec["train_s"] / max(rec["steps"], 1),
        "samples_per_s": rec["train_samples"] * job["epochs"] / rec["train_s"],
        "accuracy": rec["accuracy"],
        "wire_bytes": None,  # Gloo's sockets are its own
        "veth_bytes": _veth_bytes(net) - before,
        "fit_s": time.perf_counter() - t,
        "load_1m": load,
    }


# ---------------------------------------------------------------------- the two parts
def _one(spark: Any, net: Any, data: Any, job: dict[str, Any], name: str, contender: str,
         samples: int, link_mbit: float = 0.0) -> dict[str, Any]:  # fmt: skip
    try:
        if contender == "ddp":
            return ddp_fit(net, job, name, samples)
        return sparktrain_fit(spark, net, data, job, contender, link_mbit)
    except Exception as exc:  # one failed run, not the bench: it is reported as such
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_contenders(spark: Any, net: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every contender on every workload, links shaped by tbf at ``args.rate_mbit``,
    repeats interleaved."""
    net.shape(args.rate_mbit)
    records = []
    for name in args.workloads:
        job = workload(name, _epochs(name, args), args.synthetic_samples)
        data = frames(spark, job)
        for repeat in range(args.repeats):
            for contender in rotated(args.contenders, repeat):
                rec = {"workload": name, "contender": contender, "repeat": repeat,
                       "link": f"tbf {args.rate_mbit:g} Mbit/s"}  # fmt: skip
                rec.update(_one(spark, net, data, job, name, contender, args.synthetic_samples))
                records.append(rec)
                _progress(rec)
        data[0].unpersist(), data[1].unpersist()
    return records


def compare_link(
    spark: Any,
    net: Any,
    name: str,
    contenders: list[str],
    rate_mbit: float,
    repeats: int,
    epochs: int,
    samples: int,
) -> list[dict[str, Any]]:
    """The same job with the kernel's tbf at ``rate_mbit`` (no emulation) and with
    unshaped veths and sparktrain's emulation at the same rate, interleaved. The links'
    shaping is put back as it was, whatever happens."""
    job = workload(name, epochs, samples)
    data = frames(spark, job)
    records = []
    shaping = net.rate_mbit
    try:
        for repeat in range(repeats):
            for contender in contenders:
                for mode in rotated(["tbf", "emulated"], repeat):
                    net.shape(rate_mbit if mode == "tbf" else None)
                    mbit = rate_mbit if mode == "emulated" else 0.0
                    rec = {"workload": name, "contender": contender, "mode": mode,
                           "repeat": repeat, "rate_mbit": rate_mbit}  # fmt: skip
                    rec.update(_one(spark, net, data, job, name, contender, samples, mbit))
                    records.append(rec)
                    _progress(rec)
    finally:
        net.shape(shaping)
        data[0].unpersist(), data[1].unpersist()
    return records


def run_busbw(net: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Allreduce bus bandwidth between barrier tasks in the namespaces, at each world of
    ``--busbw-worlds``: sparktrain's ring against Gloo (``comm_backend="torch"``'s
    bootstrap, in the same tasks; :func:`benchmarks.allreduce.bench_ours`), links
    shaped by tbf at the rate and unshaped (the veths' own speed). One session per world,
    with that many one-core executors."""
    from benchmarks import allreduce
    from sparktrain.session import get_or_create_session

    sizes = [allreduce.parse_size(s) for s in args.busbw_sizes]
    records: list[dict[str, Any]] = []
    shaping = net.rate_mbit
    try:
        for world in args.busbw_worlds:
            conf = net.spark_conf(cores_max=world)
            spark = get_or_create_session(
                conf.pop("spark.master"), app_name=f"sparktrain-bench-busbw{world}", conf=conf
            )
            try:
                net.wait_for_executors(spark, count=world)
                for link in rotated(["tbf", "unshaped"], world):
                    net.shape(args.rate_mbit if link == "tbf" else None)
                    load = os.getloadavg()[0]
                    rows = allreduce.bench_ours(
                        spark, world, sizes, ["ring", "torch"], iterations=args.busbw_iterations
                    )
                    for row in rows:
                        row["algo"] = "gloo" if row["algo"] == "torch" else row["algo"]
                        row.update(link=_link_name(link, args.rate_mbit), load_1m=load)
                        records.append(row)
                        print(
                            f"[busbw world {world} {row['link']}] {row['algo']} "
                            f"{row['bytes'] >> 20} MiB: {row['busbw']:.4f} GB/s, load {load:.2f}",
                            flush=True,
                        )
            finally:
                spark.stop()
    finally:
        net.shape(shaping)
    return records


def _link_name(link: str, rate_mbit: float) -> str:
    return f"tbf {rate_mbit:g} Mbit/s" if link == "tbf" else "veth, unshaped"


def busbw_ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per link, world and size: ring's busbw over Gloo's."""
    out = []
    for r in records:
        if r["algo"] != "ring":
            continue
        gloo = next(
            (g for g in records if g["algo"] == "gloo" and
             (g["link"], g["world"], g["bytes"]) == (r["link"], r["world"], r["bytes"])), None,
        )  # fmt: skip
        out.append(
            {
                "link": r["link"],
                "world": r["world"],
                "bytes": r["bytes"],
                "ring_busbw": r["busbw"],
                "gloo_busbw": gloo["busbw"] if gloo else None,
                "ring_over_gloo": r["busbw"] / gloo["busbw"] if gloo and gloo["busbw"] else None,
                "load_1m": r["load_1m"],
            }
        )
    return out


def _epochs(name: str, args: argparse.Namespace) -> int:
    return int(args.epochs if name == "digits" else args.synthetic_epochs)


def _progress(r: dict[str, Any]) -> None:
    what = r.get("error") or (
        f"{r['step_s'] * 1e3:.1f} ms/step, {r['samples_per_s']:.0f} samples/s, "
        f"acc {r['accuracy']:.4f}, veth {r['veth_bytes'] / 1e6:.1f} MB, load {r['load_1m']:.2f}"
    )
    where = r.get("mode") or r.get("link")
    print(f"[{r['workload']} {where}] {r['contender']} #{r['repeat']}: {what}", flush=True)


# ---------------------------------------------------------------------- summaries
def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(records: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Medians over the repeats of each group of ``keys``."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    out = []
    for key, runs in groups.items():
        ok = [r for r in runs if "error" not in r]
        row: dict[str, Any] = dict(zip(keys, key, strict=True))
        row["runs"] = len(ok)
        row["errors"] = len(runs) - len(ok)
        for field in ("step_s", "samples_per_s", "accuracy", "wire_bytes", "veth_bytes",
                      "load_1m"):  # fmt: skip
            row[field] = _median([r.get(field) for r in ok])
        out.append(row)
    return out


def link_verdicts(compare: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per contender: median step time emulated / tbf, and whether within 15 %."""
    out = []
    rows = summarize(compare, ("workload", "contender", "mode"))
    for row in rows:
        if row["mode"] != "tbf":
            continue
        emu = next(
            (r for r in rows if r["mode"] == "emulated" and r["contender"] == row["contender"]
             and r["workload"] == row["workload"]), None,
        )  # fmt: skip
        ratio = emu["step_s"] / row["step_s"] if emu and emu["step_s"] and row["step_s"] else None
        out.append(
            {
                "workload": row["workload"],
                "contender": row["contender"],
                "tbf_step_s": row["step_s"],
                "emulated_step_s": emu["step_s"] if emu else None,
                "ratio": ratio,
                "within_15pct": ratio is not None and abs(ratio - 1) <= TARGET_RATIO,
                "load_1m": row["load_1m"],
            }
        )
    return out


def table(report: dict[str, Any]) -> str:
    """The results page's tables (docs/results.md, via ``sparktrain bench report``)."""
    rate = report["rate_mbit"]
    parts = [
        f"Both workers' links shaped by `tc tbf` at {rate:g} Mbit/s (medians of "
        f"{report['repeats']} interleaved repeats; load = 1-minute load average).",
        "",
        "| workload | contender | time/step | samples/s | accuracy | sparktrain wire bytes "
        "| veth bytes | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.get("summary", []):
        parts.append(
            f"| {r['workload']} | {r['contender']} | {_ms(r['step_s'])} "
            f"| {_num(r['samples_per_s'], '{:,.0f}')} | {_num(r['accuracy'], '{:.4f}')} "
            f"| {_mb(r['wire_bytes'])} | {_mb(r['veth_bytes'])} | {_num(r['load_1m'], '{:.2f}')} |"
        )
    parts += [
        "",
        f"sparktrain's own link emulation (`link_bandwidth_mbit={rate:g}`, rtt 0, veths "
        f"unshaped) against `tbf` at {rate:g} Mbit/s (no emulation), same job:",
        "",
        "| workload | contender | tbf time/step | emulated time/step | emulated / tbf "
        "| within 15 % | load |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for v in report.get("link_compare", []):
        parts.append(
            f"| {v['workload']} | {v['contender']} | {_ms(v['tbf_step_s'])} "
            f"| {_ms(v['emulated_step_s'])} | {_num(v['ratio'], '{:.3f}')} "
            f"| {'yes' if v['within_15pct'] else 'no'} | {_num(v['load_1m'], '{:.2f}')} |"
        )
    if report.get("busbw"):
        parts += [
            "",
            "Allreduce between barrier tasks in the namespaces: sparktrain's ring against "
            'Gloo (bootstrapped as `comm_backend="torch"` does, in the same tasks); busbw = '
            "bytes x 2(n-1)/n / time, median over iterations of the slowest rank:",
            "",
            "| link | world | size | ring busbw | Gloo busbw | ring / Gloo | load |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for b in busbw_ratios(report["busbw"]):
            parts.append(
                f"| {b['link']} | {b['world']} | {b['bytes'] >> 20} MiB "
                f"| {b['ring_busbw'] * 1e3:.1f} MB/s | {_num(b['gloo_busbw'], '{:.1f} MB/s', 1e3)} "
                f"| {_num(b['ring_over_gloo'], '{:.2f}')} | {b['load_1m']:.2f} |"
            )
    return "\n".join(parts)


def _num(value: Any, pattern: str, scale: float = 1.0) -> str:
    return "-" if value is None else pattern.format(value * scale)


def _ms(value: float | None) -> str:
    return _num(None if value is None else value * 1e3, "{:.1f} ms")


def _mb(value: float | None) -> str:
    return _num(None if value is None else value / 1e6, "{:.1f} MB")


# ---------------------------------------------------------------------- entry
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="tbf rate, both ends")
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5, help="digits epochs per fit")
    parser.add_argument("--synthetic-samples", type=int, default=4096)
    parser.add_argument("--synthetic-epochs", type=int, default=2)
    parser.add_argument("--compare-workload", default="synthetic")
    parser.add_argument(
        "--compare-contenders",
        nargs="+",
        default=["ring", "ps", "ps1"],
        help="ps: 2 shards (a connection to each per worker); ps1: ps with one shard",
    )
    parser.add_argument("--compare-repeats", type=int, default=3)
    parser.add_argument("--busbw-worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--busbw-sizes", nargs="+", default=["1M", "16M"])
    parser.add_argument("--busbw-iterations", type=int, default=5)
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=list(PARTS),
        default=list(PARTS),
        help="contenders: every strategy and DDP under tbf; compare: own emulation vs tbf; "
        "busbw: ring vs Gloo allreduce",
    )
    parser.add_argument(
        "--merge", action="store_true", help="keep the JSON's other parts, replace these"
    )
    parser.add_argument("--workdir", default=None, help="cluster logs (default: a temp dir)")
    parser.add_argument("--json", default="docs/results/bench_multihost.json")


def _check(args: argparse.Namespace) -> None:
    for name in args.contenders:
        if name not in CONTENDERS:
            raise SparkTrainError(f"unknown contender {name!r}; use {', '.join(CONTENDERS)}")
    for name in [*args.workloads, args.compare_workload]:
        if name not in WORKLOADS:
            raise SparkTrainError(f"unknown workload {name!r}; use {' or '.join(WORKLOADS)}")
    for name in args.compare_contenders:
        if name not in (*CONTENDERS, "ps1") or name == "ddp":
            raise SparkTrainError(
                f"--compare-contenders {name!r}: sparktrain strategies only (emulation is "
                "sparktrain's own), e.g. ring ps ps1"
            )
    if any(w < 2 or w > MAX_BUSBW_WORLD for w in args.busbw_worlds):
        raise SparkTrainError(f"--busbw-worlds: each between 2 and {MAX_BUSBW_WORLD}")
    if args.busbw_iterations < 1 or args.repeats < 1 or args.compare_repeats < 1:
        raise SparkTrainError("--repeats, --compare-repeats and --busbw-iterations must be >= 1")
    if not args.rate_mbit > 0:
        raise SparkTrainError("--rate-mbit must be > 0 (the tbf rate both methods share)")


def main(args: argparse.Namespace) -> int:
    from sparktrain.session import get_or_create_session
    from tests.cluster.netcluster import NetCluster, unavailable

    _check(args)
    reason = unavailable()
    if reason is not None:
        raise SparkTrainError(f"bench multihost needs network namespaces: {reason}")
    path = Path(args.json)
    report: dict[str, Any] = json.loads(path.read_text()) if args.merge and path.exists() else {}
    # a SIGTERM (timeout, CI) unwinds like Ctrl-C, so the cluster's cleanup still runs
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each part: a later part's failure keeps the earlier ones
        report.update(rate_mbit=args.rate_mbit, workers=WORKERS, machine=bench_train.machine())
        path.write_text(json.dumps(report, indent=1) + "\n")

    if report.get("rate_mbit", args.rate_mbit) != args.rate_mbit:
        raise SparkTrainError(
            f"--merge: {path} was measured at {report['rate_mbit']:g} Mbit/s, this run at "
            f"{args.rate_mbit:g}; use the same --rate-mbit or another --json"
        )
    workers = max([WORKERS, *(args.busbw_worlds if "busbw" in args.parts else [])])
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        with NetCluster(workdir, workers=workers) as net:
            if "contenders" in args.parts or "compare" in args.parts:
                conf = net.spark_conf(cores_max=WORKERS)
                spark = get_or_create_session(
                    conf.pop("spark.master"), app_name="sparktrain-bench-multihost", conf=conf
                )
                try:
                    net.wait_for_executors(spark, count=WORKERS)
                    # warm-up, unrecorded: the Python workers import torch once
                    warm = workload("digits", 1, args.synthetic_samples)
                    sparktrain_fit(spark, net, frames(spark, warm), warm, "ring")
                    if "contenders" in args.parts:
                        records = run_contenders(spark, net, args)
                        report["records"] = records
                        report["summary"] = summarize(records, ("workload", "contender"))
                        report["repeats"] = args.repeats
                        save()
                    if "compare" in args.parts:
                        compare = compare_link(
                            spark, net, args.compare_workload, args.compare_contenders,
                            args.rate_mbit, args.compare_repeats,
                            _epochs(args.compare_workload, args), args.synthetic_samples,
                        )  # fmt: skip
                        report["compare_records"] = compare
                        report["link_compare"] = link_verdicts(compare)
                        save()
                finally:
                    spark.stop()
            if "busbw" in args.parts:
                report["busbw"] = run_busbw(net, args)
    runs = report.get("runs", [])
    runs.append({"parts": args.parts, "args": {k: v for k, v in vars(args).items()
                 if k != "func"}, "bench_s": time.perf_counter() - started,
                 "date": time.strftime("%Y-%m-%d")})  # fmt: skip
    report["runs"] = runs
    report.setdefault("repeats", args.repeats)
    save()
    print(table(report))
    print(f"report written to {path}")
    return 0
