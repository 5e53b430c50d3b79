"""The 5G seeds' headline (issue 36.1): does compression cut the *time to a fixed accuracy*
on a slow link, on a model where bandwidth matters?

    sparktrain bench headline --links 5g tbf:100 tbf:1000 --seeds 0 \\
        --json docs/results/bench_headline5g.json --plot docs/results/bench_headline5g.png
    sparktrain bench headline --links 5g --seeds 1 2 --merge \\
        --json docs/results/bench_headline5g.json          # more seeds, kept beside the rest

(``tbf:RATE`` links need root: network namespaces.)

The model is the synthetic MLP made wide, 512-2048-2048-10 (5.27 M parameters, 21 MB of
float32 gradient a step; :data:`MODEL_KWARGS`) on ``datasets.synthetic(n=9216,
features=512)``, 2 workers, per-worker batch 128 (global 256, 32 steps an epoch), SGD lr
0.05 momentum 0.9, at most ``--epochs`` epochs. Each run's *time to target* is the sum
of its epochs' seconds (the training loop and the validation pass after each epoch, as
:func:`benchmarks.compression_worlds.time_to_accuracy` counts them) up to the first
epoch whose test accuracy reaches ``--target``; a run that never does is "not reached".

Contenders (:data:`CONTENDERS`): sparktrain's ring with ``none``, ``fp16``,
``int8+ef``, ``topk:0.01+ef`` and ``powersgd:2+ef``; ``delta``, the parameter server
(sync) with ``delta+int8+ef`` (int8 pushes with error feedback, delta-encoded int8
pulls: the only place ``delta+`` acts); ``auto`` (``strategy="auto"``,
``compression="auto"``, whose choice each record keeps); and DDP under
``pyspark.ml.torch.distributor.TorchDistributor`` over Gloo: plain, with torch's
``fp16_compress_hook`` and with its ``powerSGD_hook`` (rank 2, error feedback, from the
second step, the model in one bucket: :data:`DDP_POWERSGD_BUCKET_MB`).

Links (``--links``):

* ``5g`` (or any profile of :mod:`sparktrain.wire.link`): sparktrain's own emulation on
  ``local[2]`` (100 Mbit/s, 20 ms RTT ± 2 ms). Gloo's sockets are not sparktrain's, so
  the emulation cannot shape DDP: the DDP contenders are left out on these links.
* ``tbf:RATE``: the multi-host namespaces of :mod:`tests.cluster.netcluster` (root), both
  ends of each worker's veth shaped by ``tc tbf`` at RATE Mbit/s; every contender, DDP
  included, crosses the same kernel link. This kernel has no ``netem``, so no delay.

Every seed runs every contender once, the order rotated seed by seed (interleaved: the
machine's load falls on all alike); each record keeps the 1-minute load average when its
fit started.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.compression_worlds import time_to_accuracy
from benchmarks.order import rotated
from benchmarks.plots import pyplot, save_figure
from sparktrain.errors import ConfigError, SparkTrainError

FORMAT = "headline/1"
MODEL = "sparktrain.models:mlp"
MODEL_KWARGS: dict[str, Any] = {"in_features": 512, "hidden": [2048, 2048], "out_features": 10}
SAMPLES = 9216
WORLD = 2
RECIPE: dict[str, Any] = {
    "batch_size": 128,  # per worker
    "lr": 0.05,
    "optimizer": "sgd",
    "optimizer_kwargs": {"momentum": 0.9},
}
TARGET = 0.55
EPOCHS = 3
COMM_TIMEOUT_S = 600.0
DDP_POWERSGD_START = 2  # torch's default (1000) would run plain allreduce all run long
# powerSGD_hook waits on a collective inside a future's callback (pytorch/pytorch#48478):
# over Gloo, DDP's default buckets (a 1 MiB first one, then 25 MB) block both of Gloo's
# threads and the step deadlocks (seen here); one bucket for the whole model does not.
DDP_POWERSGD_BUCKET_MB = 64.0


@dataclasses.dataclass(frozen=True)
class Contender:
    """One contender: sparktrain (``strategy`` x ``compression``) or DDP (``hook``)."""

    name: str
    kind: str  # "sparktrain" or "ddp"
    strategy: str = "ring"
    compression: str = "none"
    hook: str = "none"  # ddp: none, fp16, powersgd

    @property
    def ddp(self) -> bool:
        return self.kind == "ddp"


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        Contender("none", "sparktrain"),
        Contender("fp16", "sparktrain", compression="fp16"),
        Contender("int8+ef", "sparktrain", compression="int8+ef"),
        Contender("delta", "sparktrain", strategy="ps", compression="delta+int8+ef"),
        Contender("topk+ef", "sparktrain", compression="topk:0.01+ef"),
        Contender("powersgd", "sparktrain", compression="powersgd:2+ef"),
        Contender("auto", "sparktrain", strategy="auto", compression="auto"),
        Contender("ddp", "ddp"),
        Contender("ddp-fp16", "ddp", hook="fp16"),
        Contender("ddp-powersgd", "ddp", hook="powersgd"),
    )
}


@dataclasses.dataclass(frozen=True)
class Link:
    """An emulated profile (``5g``) or a kernel-shaped namespace link (``tbf:100``)."""

    name: str
    kind: str  # "emulated" or "tbf"
    rate_mbit: float = 0.0

    @property
    def label(self) -> str:
        if self.kind == "tbf":
            return f"tbf {self.rate_mbit:g} Mbit/s (namespaces)"
        return f"{self.name} (emulated)"


def parse_link(text: str) -> Link:
    """``5g`` / ``lan`` / ... (a profile of :mod:`sparktrain.wire.link`) or ``tbf:RATE``."""
    from sparktrain.wire.link import PROFILES

    if text.startswith("tbf:"):
        try:
            rate = float(text[4:])
        except ValueError:
            rate = math.nan
        if not (math.isfinite(rate) and rate > 0):
            raise ConfigError(f"--links {text!r}: tbf:RATE needs a rate in Mbit/s > 0")
        return Link(f"tbf:{rate:g}", "tbf", rate)
    if text not in PROFILES or text == "none":
        raise ConfigError(
            f"--links {text!r}: use tbf:RATE or a link profile "
            f"({', '.join(p for p in PROFILES if p != 'none')})"
        )
    return Link(text, "emulated")


def contenders_on(link: Link, names: Sequence[str]) -> list[Contender]:
    """The contenders that can run on ``link``: DDP only where the kernel shapes Gloo."""
    out = []
    for name in names:
        if name not in CONTENDERS:
            raise ConfigError(f"unknown contender {name!r}; use {', '.join(CONTENDERS)}")
        c = CONTENDERS[name]
        if c.ddp and link.kind != "tbf":
            continue
        out.append(c)
    return out


def train_keys(c: Contender, link: Link, seed: int, epochs: int) -> dict[str, Any]:
    """The TrainConfig keys of a sparktrain contender on ``link``."""
    if c.ddp:
        raise ConfigError(f"{c.name} is a DDP contender, not a TrainConfig")
    keys: dict[str, Any] = {
        **RECIPE,
        "optimizer_kwargs": dict(RECIPE["optimizer_kwargs"]),
        "strategy": c.strategy,
        "compression": c.compression,
        "num_workers": WORLD,
        "epochs": epochs,
        "seed": seed,
        "progress": False,
        "comm_timeout": COMM_TIMEOUT_S,
        "feature_scaling": False,  # as DDP's loop: the raw features
    }
    if c.strategy == "ps":
        keys["ps_mode"] = "sync"
    if link.kind == "emulated":
        keys["link_profile"] = link.name
    return keys


# ---------------------------------------------------------------------- records
def make_record(
    c: Contender,
    link: Link,
    seed: int,
    target: float,
    history: Sequence[dict[str, Any]],
    *,
    load1: float,
    wire_bytes: int | None,
    veth_bytes: int | None = None,
    chosen: dict[str, Any] | None = None,
    fit_s: float | None = None,
) -> dict[str, Any]:
    """One run as a JSON-able record; ``history`` is [{epoch, metric, seconds}]."""
    hist = [
        {"epoch": int(h["epoch"]), "metric": float(h["metric"]), "seconds": float(h["seconds"])}
        for h in history
    ]
    reached = time_to_accuracy(hist, target)
    if reached is not None:  # epochs run until the target, whatever the history's numbering
        reached["epoch"] = 1 + [h["epoch"] for h in hist].index(reached["epoch"])
    return {
        "link": link.name,
        "link_label": link.label,
        "contender": c.name,
        "kind": c.kind,
        "strategy": c.strategy if not c.ddp else "ddp",
        "compression": c.compression if not c.ddp else f"hook:{c.hook}",
        "seed": seed,
        "world": WORLD,
        "target": target,
        "time_to_s": reached["seconds"] if reached else None,
        "reached_epoch": reached["epoch"] if reached else None,
        "final_accuracy": hist[-1]["metric"] if hist else None,
        "epochs_run": len(hist),
        "train_s": sum(h["seconds"] for h in hist),
        "wire_bytes": wire_bytes,
        "veth_bytes": veth_bytes,
        "chosen": chosen,
        "fit_s": fit_s,
        "load1": load1,
        "history": hist,
    }


def _median(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (link, contender): medians over the seeds (time to target over those
    that reached it), ratios to sparktrain ``none`` and to plain DDP on the same link."""
    rows: list[dict[str, Any]] = []
    links = list(dict.fromkeys(r["link"] for r in records))
    order = list(CONTENDERS)
    keys = sorted(
        dict.fromkeys((r["link"], r["contender"]) for r in records),
        key=lambda k: (links.index(k[0]), order.index(k[1]) if k[1] in order else len(order)),
    )
    for link, name in keys:
        runs = [r for r in records if r["link"] == link and r["contender"] == name]
        ok = [r for r in runs if "error" not in r]
        chosen = sorted(
            {f"{r['chosen'].get('strategy')} + {r['chosen'].get('compression')}"
             for r in ok if r.get("chosen")}
        )  # fmt: skip
        rows.append(
            {
                "link": link,
                "link_label": runs[0].get("link_label", link),
                "contender": name,
                "kind": runs[0].get("kind"),
                "runs": len(runs),
                "errors": len(runs) - len(ok),
                "seeds": sorted(int(r["seed"]) for r in runs),
                "reached": sum(1 for r in ok if r["time_to_s"] is not None),
                "time_to_s": _median([r["time_to_s"] for r in ok]),
                "reached_epoch": _median([r["reached_epoch"] for r in ok]),
                "final_accuracy": _median([r["final_accuracy"] for r in ok]),
                "epoch_s": _median([r["train_s"] / r["epochs_run"] for r in ok if r["epochs_run"]]),
                "wire_mb": _scaled(_median([r.get("wire_bytes") for r in ok]), 1e-6),
                "veth_mb": _scaled(_median([r.get("veth_bytes") for r in ok]), 1e-6),
                "load1": [round(float(r["load1"]), 2) for r in runs if "load1" in r],
                "chosen": chosen,
            }
        )
    for row in rows:
        same = {r["contender"]: r for r in rows if r["link"] == row["link"]}
        row["vs_none"] = _ratio(row["time_to_s"], same.get("none", {}).get("time_to_s"))
        row["vs_ddp"] = _ratio(row["time_to_s"], same.get("ddp", {}).get("time_to_s"))
    return rows


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def winners(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per link: the fastest contender to the target (every seed reached it), the fastest
    fixed sparktrain one, what ``auto`` chose and whether that is the winner's choice."""
    out = []
    for link in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == link and r["time_to_s"] is not None]
        full = [r for r in mine if r["reached"] == r["runs"] - r["errors"] and r["reached"]]
        fixed = [r for r in full if r["kind"] == "sparktrain" and r["contender"] != "auto"]
        best = min(full, key=lambda r: r["time_to_s"], default=None)
        best_fixed = min(fixed, key=lambda r: r["time_to_s"], default=None)
        auto = next((r for r in rows if r["link"] == link and r["contender"] == "auto"), None)
        entry: dict[str, Any] = {
            "link": link,
            "winner": best["contender"] if best else None,
            "best_sparktrain_fixed": best_fixed["contender"] if best_fixed else None,
            "auto_chose": auto["chosen"] if auto else None,
            "auto_time_to_s": auto["time_to_s"] if auto else None,
        }
        if auto and best_fixed:
            # the compressor decides; at world 2 the tree's exchange is the ring's
            spec = CONTENDERS[best_fixed["contender"]]
            entry["auto_picks_best_fixed"] = bool(auto["chosen"]) and all(
                c.partition(" + ")[2] == spec.compression for c in auto["chosen"]
            )
            entry["auto_vs_best_fixed"] = _ratio(auto["time_to_s"], best_fixed["time_to_s"])
        out.append(entry)
    return out


# ---------------------------------------------------------------------- rendering
def _fmt(value: float | None, pattern: str, missing: str = "-") -> str:
    return missing if value is None else format(value, pattern)


def _num(value: float | None, pattern: str, unit: str) -> str:
    return "-" if value is None else format(value, pattern) + unit


def table(data: dict[str, Any]) -> str:
    """The results-page text of a ``bench_headline5g.json``."""
    if data.get("format") != FORMAT:
        raise KeyError(f"format {data.get('format')!r}, expected {FORMAT!r}")
    cfg = data["config"]
    rows = data["rows"]
    lines = [
        f"Time to test accuracy {cfg['target']:g} (at most {cfg['epochs']} epochs; medians "
        "over the seeds that reached it; s/epoch: the median epoch time, training loop plus "
        "validation; load = 1-minute load average at each fit's start):",
        "",
        "| link | contender | strategy | compression | reached | epoch | time to target "
        "| vs none | vs DDP | s/epoch | final acc | sparktrain wire MB | veth MB | auto chose "
        "| load |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        c = CONTENDERS.get(r["contender"])
        strategy = "DDP (TorchDistributor)" if c and c.ddp else (c.strategy if c else "?")
        comp = (f"hook {c.hook}" if c.ddp else f"`{c.compression}`") if c else "?"
        reached = f"{r['reached']}/{r['runs']}" + (
            f" ({r['errors']} failed)" if r["errors"] else ""
        )
        lines.append(
            f"| {r['link_label']} | {r['contender']} | {strategy} | {comp} | {reached} "
            f"| {_fmt(r['reached_epoch'], 'g')} | {_num(r['time_to_s'], '.1f', ' s')} "
            f"| {_num(r['vs_none'], '.2f', 'x')} "
            f"| {_num(r['vs_ddp'], '.2f', 'x')} | {_num(r.get('epoch_s'), '.1f', '')} "
            f"| {_fmt(r['final_accuracy'], '.4f')} | {_fmt(r['wire_mb'], '.0f')} "
            f"| {_fmt(r['veth_mb'], '.0f')} | {', '.join(r['chosen']) or '-'} "
            f"| {', '.join(f'{x:.1f}' for x in r['load1'])} |"
        )
    lines += ["", "| link | winner | best fixed sparktrain | auto chose "
              "| auto picks its compressor | auto / best fixed |",
              "|---|---|---|---|---|---:|"]  # fmt: skip
    for w in data["winners"]:
        picks = w.get("auto_picks_best_fixed")
        lines.append(
            f"| {w['link']} | {w['winner'] or '-'} | {w['best_sparktrain_fixed'] or '-'} "
            f"| {', '.join(w['auto_chose'] or []) or '-'} "
            f"| {'-' if picks is None else ('yes' if picks else 'no')} "
            f"| {_num(w.get('auto_vs_best_fixed'), '.2f', 'x')} |"
        )
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    """Bars: median time to target per contender, one panel per link."""
    plt = pyplot()

    rows = data["rows"]
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.2), squeeze=False)
    for ax, link in zip(axes[0], links, strict=True):
        mine = [r for r in rows if r["link"] == link]
        names = [r["contender"] for r in mine]
        secs = [r["time_to_s"] or 0.0 for r in mine]
        colors = ["tab:orange" if r["kind"] == "ddp" else "tab:blue" for r in mine]
        bars = ax.bar(range(len(mine)), secs, color=colors)
        for bar, r in zip(bars, mine, strict=True):
            if r["time_to_s"] is None:
                ax.text(bar.get_x() + bar.get_width() / 2, 0, "not\nreached", ha="center",
                        va="bottom", fontsize=7)  # fmt: skip
        ax.set_xticks(range(len(mine)), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(f"seconds to test accuracy {data['config']['target']:g}")
        ax.set_title(mine[0]["link_label"], fontsize=9)
    fig.suptitle(
        "512-2048-2048-10 MLP (5.3 M parameters), 2 workers: sparktrain (blue) vs DDP (orange)",
        fontsize=9,
    )
    save_figure(fig, path)


# ---------------------------------------------------------------------- running
def split() -> Any:
    from sparktrain import datasets

    return datasets.synthetic(n=SAMPLES, features=MODEL_KWARGS["in_features"], classes=10)


def make_frames(spark: Any) -> tuple[Any, Any]:
    from sparktrain import datasets

    s = split()
    train = datasets.to_dataframe(spark, s.x_train, s.y_train, WORLD).cache()
    test = datasets.to_dataframe(spark, s.x_test, s.y_test, WORLD).cache()
    train.count(), test.count()
    return train, test


def sparktrain_fit(spark: Any, frames: tuple[Any, Any], c: Contender, link: Link, seed: int,
                   args: argparse.Namespace, net: Any = None) -> dict[str, Any]:  # fmt: skip
    from sparktrain import TrainConfig, Trainer

    cfg = TrainConfig(**train_keys(c, link, seed, args.epochs))
    load, before, t = os.getloadavg()[0], _veth(net), time.perf_counter()
    s = (
        Trainer(MODEL, cfg, model_kwargs=MODEL_KWARGS, spark=spark)
        .fit(frames[0], validation_data=frames[1])
        .summary
    )
    auto = s.get("auto") if isinstance(s.get("auto"), dict) else None
    chosen = {k: auto[k] for k in ("strategy", "compression") if k in auto} if auto else None
    if chosen is not None and "strategy" not in chosen:
        chosen["strategy"] = s.get("strategy")
    return make_record(
        c, link, seed, args.target, s["history"], load1=load, wire_bytes=int(s["wire_bytes"]),
        veth_bytes=_delta(net, before), chosen=chosen, fit_s=time.perf_counter() - t,
    )  # fmt: skip


def _veth(net: Any) -> int | None:
    return None if net is None else sum(x.sent + x.received for x in net.counters())


def _delta(net: Any, before: int | None) -> int | None:
    now = _veth(net)
    return None if now is None or before is None else now - before


def ddp_train(hook: str, epochs: int, seed: int) -> dict[str, Any]:
    """What each TorchDistributor process runs: DDP over Gloo on the headline's model,
    recipe and data (every WORLD-th training row, equal steps on every rank); rank 0
    scores the test split after each epoch (inside the epoch's time, as sparktrain's
    validation pass is). Returns rank 0's history on every rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from sparktrain.models import mlp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as sparktrain's tasks: one core per executor
    data = split()
    torch.manual_seed(seed)
    net = DistributedDataParallel(
        mlp(**MODEL_KWARGS), bucket_cap_mb=DDP_POWERSGD_BUCKET_MB if hook == "powersgd" else None
    )
    if hook == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=2,
            start_powerSGD_iter=DDP_POWERSGD_START, use_error_feedback=True, warm_start=True,
        )  # fmt: skip
        net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    x = torch.from_numpy(data.x_train[rank::world])
    y = torch.from_numpy(data.y_train[rank::world])
    xt, yt = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    batch = int(RECIPE["batch_size"])
    opt = torch.optim.SGD(net.parameters(), lr=float(RECIPE["lr"]), **RECIPE["optimizer_kwargs"])
    steps = math.ceil(math.ceil(len(data.x_train) / world) / batch)
    history = []
    dist.barrier()
    for epoch in range(epochs):
        t = time.perf_counter()
        gen = torch.Generator().manual_seed(seed * 1000 + epoch * world + rank)
        order = torch.randperm(len(x), generator=gen)
        for step in range(steps):
            idx = order[step * batch : (step + 1) * batch]
            if len(idx) == 0:
                idx = order[:batch]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
        acc = torch.zeros(1)
        if rank == 0:
            with torch.no_grad():
                acc[0] = (net.module(xt).argmax(1) == yt).float().mean()
        dist.broadcast(acc, src=0)
        history.append(
            {"epoch": epoch, "metric": float(acc[0]), "seconds": time.perf_counter() - t}
        )
    dist.destroy_process_group()
    return {"history": history}


def ddp_fit(c: Contender, link: Link, seed: int, args: argparse.Namespace,
            net: Any) -> dict[str, Any]:  # fmt: skip
    """DDP under ``TorchDistributor(local_mode=False, num_processes=2)`` on the cluster."""
    from pyspark.ml.torch.distributor import TorchDistributor

    load, before, t = os.getloadavg()[0], _veth(net), time.perf_counter()
    out = TorchDistributor(num_processes=WORLD, local_mode=False, use_gpu=False).run(
        ddp_train, c.hook, args.epochs, seed
    )
    if out is None:
        raise SparkTrainError("TorchDistributor returned nothing from rank 0")
    return make_record(
        c, link, seed, args.target, out["history"], load1=load, wire_bytes=None,
        veth_bytes=_delta(net, before), fit_s=time.perf_counter() - t,
    )  # fmt: skip


def _progress(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"[{r['link']} seed {r['seed']}] {r['contender']}: FAILED {r['error']}", flush=True)
        return
    print(
        f"[{r['link']} seed {r['seed']}] {r['contender']}: to {r['target']:g} "
        f"{_fmt(r['time_to_s'], '.1f', 'not reached')} s (epoch {r['reached_epoch']}), final "
        f"{r['final_accuracy']:.4f}, wire {_fmt(_scaled(r['wire_bytes'], 1e-6), '.0f')} MB, "
        f"chosen {r['chosen']}, load {r['load1']:.2f}",
        flush=True,
    )


def run_link(spark: Any, frames: tuple[Any, Any], link: Link, args: argparse.Namespace,
             records: list[dict[str, Any]], save: Callable[[], None],
             net: Any = None) -> None:  # fmt: skip
    """Every contender that can run on ``link``, once per seed, the order rotated; each
    record is appended to ``records`` and saved at once (a hang loses one run)."""
    todo = contenders_on(link, args.contenders)
    for seed in args.seeds:
        for c in rotated(todo, seed):  # by the seed: runs merged later rotate too
            try:
                if c.ddp:
                    rec = ddp_fit(c, link, seed, args, net)
                else:
                    rec = sparktrain_fit(spark, frames, c, link, seed, args, net)
            except Exception as exc:  # one failed run, not the bench
                rec = {"link": link.name, "link_label": link.label, "contender": c.name,
                       "kind": c.kind, "seed": seed, "load1": os.getloadavg()[0],
                       "error": f"{type(exc).__name__}: {str(exc)[:500]}"}  # fmt: skip
            records.append(rec)
            save()
            _progress(rec)


def _warm_up(spark: Any, frames: tuple[Any, Any], args: argparse.Namespace) -> None:
    """Unrecorded: the Python workers import torch once."""
    from sparktrain import TrainConfig, Trainer

    cfg = TrainConfig(**train_keys(CONTENDERS["none"], Link("none", "none"), 0, 1))
    Trainer(MODEL, cfg, model_kwargs=MODEL_KWARGS, spark=spark).fit(frames[0])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--links",
        nargs="+",
        default=["5g"],
        help="5g (emulated, local[2]) and/or tbf:RATE (namespaces, root)",
    )
    parser.add_argument(
        "--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS)
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="at most this many epochs")
    parser.add_argument("--json", default="docs/results/bench_headline5g.json")
    parser.add_argument("--plot", help="PNG of the time-to-target bars")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the JSON's records of other links and seeds (a link and seed run "
        "again is replaced)",
    )
    parser.add_argument("--workdir", help="namespaces' cluster work directory (default: temp)")


def rerun(record: dict[str, Any], links: Sequence[Link], args: argparse.Namespace) -> bool:
    """Whether this run measures ``record``'s (link, seed, contender) again (``--merge``
    then drops the old record)."""
    return int(record["seed"]) in args.seeds and any(
        record["link"] == x.name and record["contender"] in args.contenders for x in links
    )


def check_args(args: argparse.Namespace) -> list[Link]:
    if args.epochs < 1 or not args.seeds or not (0.0 < args.target <= 1.0):
        raise ConfigError("--epochs must be >= 1, --seeds name a seed, --target in (0, 1]")
    return [parse_link(x) for x in dict.fromkeys(args.links)]


def build_report(records: Sequence[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    rows = summarize(records)
    return {
        "format": FORMAT,
        "config": {
            "model": MODEL,
            "model_kwargs": MODEL_KWARGS,
            "parameters": parameter_count(),
            "samples": SAMPLES,
            "world": WORLD,
            "recipe": RECIPE,
            "target": args.target,
            "epochs": args.epochs,
        },
        "records": list(records),
        "rows": rows,
        "winners": winners(rows),
    }


def parameter_count() -> int:
    """Parameters of the headline's MLP (its linear layers' weights and biases)."""
    sizes = [MODEL_KWARGS["in_features"], *MODEL_KWARGS["hidden"], MODEL_KWARGS["out_features"]]
    return sum(a * b + b for a, b in itertools.pairwise(sizes))


def main(args: argparse.Namespace) -> int:
    from sparktrain.session import get_or_create_session

    links = check_args(args)
    path = Path(args.json)
    old: list[dict[str, Any]] = []
    if args.merge and path.exists():
        earlier = json.loads(path.read_text())
        if earlier.get("format") != FORMAT:
            raise ConfigError(f"--merge: {path} is not a {FORMAT} file")
        old = [r for r in earlier["records"] if not rerun(r, links, args)]
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    records: list[dict[str, Any]] = list(old)

    def save() -> None:
        data = build_report(records, args)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1) + "\n")

    emulated = [x for x in links if x.kind == "emulated"]
    if emulated:
        spark = get_or_create_session(f"local[{WORLD}]", app_name="sparktrain-bench-headline")
        try:
            frames = make_frames(spark)
            _warm_up(spark, frames, args)
            for link in emulated:
                run_link(spark, frames, link, args, records, save)
        finally:
            spark.stop()
    shaped = [x for x in links if x.kind == "tbf"]
    if shaped:
        from tests.cluster.netcluster import NetCluster, unavailable

        reason = unavailable()
        if reason is not None:
            raise SparkTrainError(f"tbf links need network namespaces: {reason}")
        with (
            tempfile.TemporaryDirectory() as tmp,
            NetCluster(Path(args.workdir or tmp), workers=WORLD) as net,
        ):
            conf = net.spark_conf(cores_max=WORLD)
            spark = get_or_create_session(
                conf.pop("spark.master"), app_name="sparktrain-bench-headline", conf=conf
            )
            try:
                net.wait_for_executors(spark, count=WORLD)
                frames = make_frames(spark)
                _warm_up(spark, frames, args)
                for link in shaped:
                    net.shape(link.rate_mbit)
                    run_link(spark, frames, link, args, records, save, net)
            finally:
                spark.stop()
    save()
    data = json.loads(path.read_text())
    print(table(data))
    if args.plot:
        plot(data, Path(args.plot))
        print(f"plot written to {args.plot}")
    print(f"records written to {path}")
    return 0
