"""Head-to-head training benchmark (issue 9): the same jobs, in the same run, trained by
every sparktrain strategy × compressor, by pyspark's ``TorchDistributor`` (DDP over Gloo)
and by pyspark.ml's ``MultilayerPerceptronClassifier``.

    sparktrain bench train --json docs/results/bench_train.json
    sparktrain bench train --workloads digits --links none --strategies ring tree \\
        --compressions none fp16 --repeats 1        # a small matrix

Four parts, each a fair comparison of its own:

* **Headline, whole process** (``--parts headline``): ``ring`` and
  ``TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)`` each run in a
  fresh Python process that starts its own SparkSession on ``local[2]`` (loopback), trains
  the digits MLP with the same recipe (64-128-10 ReLU MLP, SGD lr 0.1 momentum 0.9, batch
  32 per worker, 2 workers, the same train/test split; each DDP process reads every
  second training row) and evaluates on the test split after every epoch. ring's child
  starts its session with :func:`~sparktrain.session.get_or_create_session`; the
  TorchDistributor child and the session-only floor with :func:`plain_session` (the same
  confs, no torch import in the driver, as a TorchDistributor user's). The parent times
  each child from spawn to exit (``whole_process_s``) and from spawn until the first
  epoch whose test accuracy reached the target was known (``whole_process_to_target_s``),
  and samples the memory of its Python processes (:mod:`benchmarks.procmem`:
  summed PSS over the child's process tree without the JVMs, every
  ``MEMORY_INTERVAL_S``; ``peak_pss_bytes`` up to the end of the first call). Each child
  then makes the same call again, warm (the notebook case: ``warm_time_to_target_s``).
  DDP's per-epoch evaluation runs on rank 0 and its cost is reported (``eval_s``); ours
  rides in the training stage. The three children take turns, the first rotating.
* **Steady state** (``--parts steady``): steady-state samples/s on the synthetic MLP,
  the ring (a fit in the bench's session) against DDP (:func:`ddp_synthetic` under
  ``TorchDistributor``), interleaved, ``--steady-epochs`` epochs a run; the rate is the
  median over every epoch but the first of training rows over the epoch's seconds
  (:func:`steady_rate`). A third contender, ``compute-only``, runs DDP's loop with no
  exchange: the ceiling of any data-parallel trainer on these cores.
* **Matrix, one shared session** (this process, after a warm-up fit): every
  ``--strategies`` × ``--compressions`` × ``--links`` × ``--workloads`` combination
  (``ps-sync``/``ps-async`` are ``strategy="ps"`` with that ``ps_mode``; ``ring-torch``/
  ``tree-torch`` are that strategy with ``comm_backend="torch"``;
  ``tree_aggregate`` runs ``local_steps=64``, one round per epoch on digits, and 4 on
  the synthetic job; ``--include-auto`` adds ``strategy="auto", compression="auto"``;
  ``delta+<spec>`` compressions, for ``ps-*`` and ``tree_aggregate`` only, compress the
  weights the driver sends too).
  ``--links`` only sets the ``link`` key (the emulation itself lives in
  :mod:`sparktrain.wire.link`). Time to target is measured
  from ``fit()`` until the epoch record that first reached the target arrived at the
  driver (its JSON line, polled every ``POLL_S``).
* **tree_aggregate against MLlib**: :mod:`benchmarks.mllib`'s two systems in the
  same shared session (its ``fast`` recipe; MLlib timed fit by fit with growing
  ``maxIter``).

The synthetic workload (``conf/synthetic_throughput.toml``'s 256-1024-1024-10 MLP and
teacher data, ``--synthetic-samples`` rows, ``--synthetic-epochs``) has no accuracy
target: it reports samples/s and bytes.

Derived figures (``derived`` in the JSON), with issue 20's targets: ring/TorchDistributor
whole process to the target (<= 1.0) and warm (<= 0.25), peak PSS of the Python
processes (<= 1.0), steady-state samples/s against DDP (>= 1.2); tree_aggregate/MLlib
time to target (target <= 1), under the 5g link the
compression time saving against the ideal ``1 - 1/ratio`` wherever communication dominates
the uncompressed run (``comm_s / train_s >= COMM_DOMINATES``; target >= 70 %), and auto
against the best fixed choice per link and workload (target within 10 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.order import rotated
from benchmarks.plots import pyplot, save_figure
from benchmarks.torchdist import rank0_everywhere, run_cluster, run_local
from sparktrain import datasets
from sparktrain.errors import SparkTrainError

DIGITS_MODEL = "sparktrain.models:digits_mlp"
SYNTHETIC_MODEL = "sparktrain.models:mlp"
SYNTHETIC_KWARGS: dict[str, Any] = {"in_features": 256, "hidden": [1024, 1024], "out_features": 10}
STRATEGIES = ("ring", "tree", "ps-sync", "ps-async", "tree_aggregate")
COMPRESSIONS = ("none", "fp16", "int8+ef", "topk:0.01+ef")
RESULT_MARK = "BENCH_TRAIN_RESULT "
POLL_S = 0.02  # resolution of the driver-side time-to-target clock
# Compression shrinks bytes, not round trips: it is judged where moving the uncompressed
# run's bytes at the link's bandwidth takes at least half of its training time.
COMM_DOMINATES = 0.5
TREE_AGGREGATE_LOCAL_STEPS = 64  # >= batches per partition on digits: one round per epoch
# On the synthetic job 64 would be a single round, which train_s (after the cache round)
# does not see; 4 local steps make 9 rounds of its 36 batches per partition.
SYNTHETIC_TREE_AGGREGATE_LOCAL_STEPS = 4

SUBPROCESS_TIMEOUT_S = 300
WORKERS = 2

# The digits recipe of conf/digits_mlp.toml, shared by every contender.
DIGITS_RECIPE: dict[str, Any] = {
    "batch_size": 32,
    "lr": 0.1,
    "optimizer": "sgd",
    "optimizer_kwargs": {"momentum": 0.9},
}
# conf/synthetic_throughput.toml's recipe.
SYNTHETIC_RECIPE: dict[str, Any] = {
    "batch_size": 256,
    "lr": 0.05,
    "optimizer": "sgd",
    "bucket_mb": 4.0,
}


# ---------------------------------------------------------------------- time to target
class EpochClock:
    """Timestamps per-epoch JSON lines as they reach the driver's ``metrics_jsonl``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.arrivals: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._run, name="epoch-clock", daemon=True)

    def start(self) -> None:
        self.started = time.perf_counter()
        self._thread.start()

    def _read(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as fh:
            fh.seek(self._offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        now = time.perf_counter() - self.started
        for line in complete.splitlines():
            if line.strip():
                self.arrivals.append((now, json.loads(line)))

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self._read()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._read()

    def curve(self) -> list[tuple[float, float]]:
        """(seconds since start, metric) per epoch; ``elapsed_s`` when the record has it."""
        return [(float(rec.get("elapsed_s", t)), float(rec["metric"])) for t, rec in self.arrivals]


def first_reaching(curve: list[tuple[float, float]], target: float | None) -> float | None:
    """The time of the first point whose metric reached ``target``."""
    if target is None:
        return None
    return next((t for t, metric in curve if metric >= target), None)


# ---------------------------------------------------------------------- one sparktrain fit
def strategy_config(name: str) -> dict[str, Any]:
    """TrainConfig keys for a contender name of ``--strategies``."""
    if name in ("ps-sync", "ps-async", "ps-ssp"):
        return {"strategy": "ps", "ps_mode": name.split("-")[1]}
    if name == "tree_aggregate":
        return {"strategy": name, "local_steps": TREE_AGGREGATE_LOCAL_STEPS}
    if name in ("ring", "tree", "auto"):
        return {"strategy": name}
    if name in ("ring-torch", "tree-torch"):  # the same stage, torch.distributed's collective
        return {"strategy": name.split("-")[0], "comm_backend": "torch"}
    raise SparkTrainError(
        f"unknown contender {name!r}; use ring, tree, ring-torch, tree-torch, ps-sync, "
        "ps-async, ps-ssp, tree_aggregate or auto"
    )


def workload_job(
    name: str, args: argparse.Namespace
) -> tuple[str, dict[str, Any], dict[str, Any], float | None]:
    """(model, model_kwargs, config keys, accuracy target or None) of a workload."""
    if name == "digits":
        return DIGITS_MODEL, {}, {**DIGITS_RECIPE, "epochs": args.epochs}, args.target
    if name == "synthetic":
        keys = {**SYNTHETIC_RECIPE, "epochs": args.synthetic_epochs}
        return SYNTHETIC_MODEL, dict(SYNTHETIC_KWARGS), keys, None
    raise SparkTrainError(f"unknown workload {name!r}; use digits or synthetic")


def load_split(name: str, args: argparse.Namespace) -> datasets.Split:
    if name == "synthetic":
        return datasets.synthetic(n=args.synthetic_samples, features=256, classes=10)
    return datasets.digits()


def fit_once(
    spark: Any,
    frames: tuple[Any, Any],
    model: str,
    model_kwargs: dict[str, Any],
    keys: dict[str, Any],
    target: float | None,
    workers: int = WORKERS,
) -> dict[str, Any]:
    """One sparktrain fit in the shared session (``workers`` ranks), with its
    time-to-target clock."""
    from sparktrain import TrainConfig, Trainer

    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "epochs.jsonl"
        cfg = TrainConfig(
            **{"num_workers": workers, "progress": False, "comm_timeout": 120.0, **keys},
            metrics_jsonl=str(jsonl),
        )
        clock = EpochClock(jsonl)
        clock.start()
        try:
            result = Trainer(model, cfg, model_kwargs=model_kwargs, spark=spark).fit(
                frames[0], validation_data=frames[1]
            )
        finally:
            clock.stop()
    s = result.summary
    curve = clock.curve()
    # torch.distributed's sockets are its own: sparktrain's counters see only the mesh's
    # rendezvous and reports, so the gradients' bytes are not measured
    counted = s["config"].get("comm_backend", "sparktrain") == "sparktrain"
    return {
        "time_to_target_s": first_reaching(curve, target),
        "final_accuracy": s["metric_value"],
        "fit_s": s["wall_s"],
        "train_s": s["train_s"],
        "comm_s": s.get("comm_s"),
        "samples_per_s": s["samples_per_s"],
        "wire_bytes": s["wire_bytes"] if counted else None,
        "raw_bytes": s["bytes_sent"] if counted else None,
        "compression_ratio": s.get("compression_ratio") if counted else None,
        "epochs": s["epochs"],
        "train_samples": s["train_samples"],
        # each epoch's own seconds (its first batch until its record: steps and the
        # validation pass), for the steady-state rate
        "epoch_seconds": [float(rec["seconds"]) for _, rec in clock.arrivals if "seconds" in rec],
        # strategy/compression "auto": what the stage-start probe chose
        "chosen": {k: s["auto"][k] for k in ("strategy", "compression") if k in s["auto"]}
        if isinstance(s.get("auto"), dict)
        else None,
        "curve": curve,
    }


def warm_up(spark: Any) -> None:
    """One unrecorded one-epoch ring fit: the Python workers import torch and the JVM
    compiles the query paths once, so the first recorded configuration does not pay it."""
    split = datasets.digits()
    frames = (
        datasets.to_dataframe(spark, split.x_train, split.y_train, WORKERS),
        datasets.to_dataframe(spark, split.x_test, split.y_test, WORKERS),
    )
    fit_once(spark, frames, DIGITS_MODEL, {}, {**DIGITS_RECIPE, "epochs": 1}, None)


def run_matrix(spark: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every strategy × compression × link × workload, in this process's session."""
    records = []
    combos = [(s, c) for s in args.strategies for c in args.compressions]
    if args.include_auto:
        combos.append(("auto", "auto"))
    for workload in args.workloads:
        model, kwargs, base, target = workload_job(workload, args)
        split = load_split(workload, args)
        frames = (
            datasets.to_dataframe(spark, split.x_train, split.y_train, WORKERS).cache(),
            datasets.to_dataframe(spark, split.x_test, split.y_test, WORKERS).cache(),
        )
        frames[0].count(), frames[1].count()
        for link in args.links:
            for strategy, compression in combos:
                for seed in args.seeds:
                    for repeat in range(args.repeats):
                        keys = {
                            **base,
                            **strategy_config(strategy),
                            "compression": compression,
                            "link_profile": link,
                            "seed": seed,
                        }
                        if strategy == "tree_aggregate" and workload == "synthetic":
                            keys["local_steps"] = SYNTHETIC_TREE_AGGREGATE_LOCAL_STEPS
                        record: dict[str, Any] = {
                            "contender": "sparktrain",
                            "strategy": strategy,
                            "compression": compression,
                            "link": link,
                            "workload": workload,
                            "seed": seed,
                            "repeat": repeat,
                            "whole_process_s": None,
                        }
                        try:
                            record.update(fit_once(spark, frames, model, kwargs, keys, target))
                        except Exception as exc:  # one failed configuration, not the bench
                            record["error"] = f"{type(exc).__name__}: {exc}"
                        records.append(record)
                        _progress(record)
        frames[0].unpersist(), frames[1].unpersist()
    return records


def _progress(r: dict[str, Any]) -> None:
    if "error" in r:
        what = f"error: {r['error']}"
    else:
        ttt = r.get("time_to_target_s")
        what = ", ".join(
            [
                f"to target {ttt:.2f} s" if ttt is not None else "target not reached (or none)",
                f"acc {_fmt(r.get('final_accuracy'), '{:.4f}')}",
                f"{_fmt(r.get('samples_per_s'), '{:.0f}')} samples/s",
                f"whole process {_fmt(r.get('whole_process_s'), '{:.1f} s')}",
            ]
        )
    print(
        f"[{r['workload']} {r['link']}] {r['contender']} {r['strategy']} {r['compression']} "
        f"seed {r['seed']}: {what}",
        flush=True,
    )


# ---------------------------------------------------------------------- TorchDistributor
def ddp_epoch(
    model: Any,
    opt: Any,
    x: Any,
    y: Any,
    batch: int,
    steps: int,
    seed: int,
    precision: str = "fp32",
) -> None:
    """One epoch of a DDP contender: ``steps`` shuffled batches (the order drawn from
    ``seed``) of cross-entropy and SGD; a shard shorter than ``steps`` batches repeats
    its first batch, so every rank takes the same number of steps (DDP needs it).
    ``precision="bf16"``: the forward pass and the loss under ``torch.autocast`` to
    bfloat16, parameters and gradients float32 (sparktrain's ``precision="bf16"``)."""
    import torch

    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    model.train()
    for step in range(steps):
        idx = order[step * batch : (step + 1) * batch]
        if len(idx) == 0:
            idx = order[:batch]
        opt.zero_grad(set_to_none=True)
        with autocast(precision):
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()


def autocast(precision: str) -> Any:
    """The forward pass's context of a DDP contender: none for fp32, CPU autocast to
    bfloat16 for bf16 (as :class:`sparktrain.task.precision.Precision`)."""
    import contextlib

    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    raise SparkTrainError(f"unknown precision {precision!r}; use fp32 or bf16")


def ddp_train(epochs: int, seed: int, target: float) -> dict[str, Any]:
    """The DDP training function TorchDistributor runs in each of its processes: the
    digits MLP, the shared recipe, every ``world``-th training row; rank 0 evaluates on
    the test split after every epoch. Returns rank 0's record (absolute times) on every
    rank."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparktrain.models import digits_mlp

    started = time.time()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as ours: one thread per worker on local[2]
    split = datasets.digits()
    torch.manual_seed(seed)
    model = DistributedDataParallel(digits_mlp())
    x = torch.from_numpy(split.x_train[rank::world])
    y = torch.from_numpy(split.y_train[rank::world])
    x_test, y_test = torch.from_numpy(split.x_test), torch.from_numpy(split.y_test)
    batch = int(DIGITS_RECIPE["batch_size"])
    opt = torch.optim.SGD(
        model.parameters(), lr=DIGITS_RECIPE["lr"], **DIGITS_RECIPE["optimizer_kwargs"]
    )
    # every rank takes the same number of steps (DDP needs it): the largest shard's
    steps = -(-((len(split.x_train) + world - 1) // world) // batch)
    curve: list[tuple[float, float]] = []
    eval_s = train_s = 0.0
    for epoch in range(epochs):
        t = time.perf_counter()
        ddp_epoch(model, opt, x, y, batch, steps, seed * 1000 + epoch * world + rank)
        train_s += time.perf_counter() - t
        if rank == 0:
            t = time.perf_counter()
            model.eval()
            with torch.no_grad():
                acc = float((model.module(x_test).argmax(1) == y_test).float().mean())
            eval_s += time.perf_counter() - t
            curve.append((time.time(), acc))
    record = {
        "started_abs": started,
        "curve_abs": curve,
        "eval_s": eval_s,
        "train_s": train_s,
        "train_samples": len(split.x_train),
        "target": target,
    }
    out: dict[str, Any] = rank0_everywhere(record)
    return out


def ddp_synthetic(
    epochs: int, seed: int, samples: int, exchange: bool = True, precision: str = "fp32"
) -> dict[str, Any]:
    """The synthetic job under DDP, as the steady part trains it with the ring:
    ``SYNTHETIC_KWARGS``' MLP and ``SYNTHETIC_RECIPE`` (batch 256 per rank, SGD lr 0.05),
    every ``world``-th training row per rank, DDP's default buckets, one torch thread per
    process. After each epoch both ranks score their half of the test split and sum the
    counts (as the ring's ranks do). Returns rank 0's per-epoch seconds, each from the
    epoch's first step until its accuracy is known (the span of the ring's ``seconds``).

    ``exchange=False`` trains the same loop without DDP: no gradient is exchanged, each
    rank steps alone. That is the compute floor: no data-parallel trainer with this
    model, batch and one thread per rank can step faster on the same cores.
    ``precision="bf16"``: the forward passes (training and scoring) under autocast to
    bfloat16 (:func:`autocast`)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparktrain.models import mlp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as ours: one thread per worker on local[2]
    split = datasets.synthetic(n=samples, features=256, classes=10)
    torch.manual_seed(seed)
    net = mlp(**SYNTHETIC_KWARGS)
    model: torch.nn.Module = DistributedDataParallel(net) if exchange else net
    x = torch.from_numpy(split.x_train[rank::world])
    y = torch.from_numpy(split.y_train[rank::world])
    x_test = torch.from_numpy(split.x_test[rank::world])
    y_test = torch.from_numpy(split.y_test[rank::world])
    batch = int(SYNTHETIC_RECIPE["batch_size"])
    opt = torch.optim.SGD(model.parameters(), lr=SYNTHETIC_RECIPE["lr"])
    steps = -(-((len(split.x_train) + world - 1) // world) // batch)  # the largest shard's
    seconds: list[float] = []
    accuracy = 0.0
    for epoch in range(epochs):
        t = time.perf_counter()
        ddp_epoch(model, opt, x, y, batch, steps, seed * 1000 + epoch * world + rank, precision)
        model.eval()
        with torch.no_grad(), autocast(precision):
            right = (net(x_test).argmax(1) == y_test).sum().float()
        counts = torch.stack([right, torch.tensor(float(len(y_test)))])
        dist.all_reduce(counts)
        accuracy = float(counts[0] / counts[1])
        seconds.append(time.perf_counter() - t)
    record = {
        "epoch_seconds": seconds,
        "train_samples": len(split.x_train),
        "final_accuracy": accuracy,
    }
    shared: list[Any] = [record if rank == 0 else None]  # see ddp_train: last writer wins
    dist.broadcast_object_list(shared, src=0)
    dist.destroy_process_group()
    out: dict[str, Any] = shared[0]
    return out


def steady_rate(epoch_seconds: list[float], rows: int | None) -> float | None:
    """Steady-state samples/s: the median over every epoch but the first (allocations,
    first-call costs) of the epoch's training rows over its seconds; None with fewer
    than two epochs."""
    rates = [rows / s for s in epoch_seconds[1:] if s > 0] if rows else []
    return statistics.median(rates) if rates else None


def load_average() -> float:
    """The 1-minute load average now (the machine is shared: it goes next to figures)."""
    return os.getloadavg()[0]


# ---------------------------------------------------------------------- child processes
def plain_session(app_name: str) -> Any:
    """A SparkSession with sparktrain's settings (loopback, quiet, the same confs), as a
    pyspark user builds it: unlike :func:`~sparktrain.session.get_or_create_session`, it
    imports no torch in this process while the JVM starts. The TorchDistributor and
    floor children use it: a TorchDistributor driver never imports torch itself, so its
    memory and start-up are measured without that import."""
    from pyspark.sql import SparkSession

    from sparktrain import session

    builder = SparkSession.builder.master(f"local[{WORKERS}]").appName(app_name)
    settings = {**session.DEFAULTS, "spark.driver.extraJavaOptions": session.log4j_options()}
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def child_main(args: argparse.Namespace) -> int:
    """One headline contender in this fresh process; prints one JSON line."""
    from sparktrain.session import get_or_create_session

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    if args.child in ("ring", "torch_run"):
        spark = get_or_create_session(
            f"local[{WORKERS}]", app_name=f"bench-train-{args.child}", warm_workers=False
        )
    else:
        spark = plain_session(f"bench-train-{args.child}")
    out: dict[str, Any] = {"contender": args.child, "session_ready_abs": time.time()}
    if args.child == "ring":
        # what sparktrain's session helper does by default (warm_workers=True), after the
        # session is up so that its cost counts in ring's part, not in the shared floor;
        # the TorchDistributor user and the bare-session floor get a plain session
        from sparktrain.driver import warmup

        warmup.start(spark)
    curve_abs: list[tuple[float, float]] = []
    if args.child == "session":
        pass  # the floor: a Python process that starts a SparkSession and stops it
    elif args.child == "ring":
        split = datasets.digits()
        frames = (
            datasets.to_dataframe(spark, split.x_train, split.y_train, WORKERS),
            datasets.to_dataframe(spark, split.x_test, split.y_test, WORKERS),
        )
        keys = {**DIGITS_RECIPE, "epochs": args.epochs, "strategy": "ring", "seed": args.seed}
        fit_started = time.time()
        rec = fit_once(spark, frames, DIGITS_MODEL, {}, keys, args.target)
        curve_abs = [(fit_started + t, acc) for t, acc in rec.pop("curve")]
        out.update(rec)
        out["first_done_abs"] = time.time()
        # the same fit again in this now-warm process: what a notebook user sees the
        # second time (JVM, Python workers and imports already up)
        warm_started = time.perf_counter()
        warm = fit_once(spark, frames, DIGITS_MODEL, {}, keys, args.target)
        out["warm_time_to_target_s"] = warm["time_to_target_s"]
        out["warm_fit_s"] = warm["fit_s"]
        out["warm_total_s"] = time.perf_counter() - warm_started
    elif args.child in DDP_RUNNERS:
        launch = DDP_RUNNERS[args.child]
        fit_started = time.time()
        t = time.perf_counter()
        result = launch(spark, args.epochs, args.seed, args.target)
        fit_s = time.perf_counter() - t
        out["first_done_abs"] = time.time()
        curve_abs = [(float(a), float(b)) for a, b in result["curve_abs"]]
        warm_ttt: float | None = None
        warm_fit_s: float | None = None
        if args.child in WARM_CALL:
            # the same run() again in this now-warm process (TorchDistributor's torchrun
            # starts afresh: that is how it works)
            warm_started = time.time()
            t = time.perf_counter()
            td_warm = launch(spark, args.epochs, args.seed, args.target)
            warm_fit_s = time.perf_counter() - t
            warm_ttt = first_reaching(
                [(float(a) - warm_started, float(b)) for a, b in td_warm["curve_abs"]],
                args.target,
            )
        out.update(
            {
                "fit_s": fit_s,
                # run() until rank 0 entered the training function: torchrun, imports
                "startup_s": float(result["started_abs"]) - fit_started,
                "train_s": result["train_s"],
                "eval_s": result["eval_s"],
                "final_accuracy": curve_abs[-1][1],
                "samples_per_s": result["train_samples"] * args.epochs / result["train_s"],
                "wire_bytes": None,  # Gloo does not count its bytes
                "raw_bytes": None,
                "epochs": args.epochs,
                "time_to_target_s": first_reaching(
                    [(a - fit_started, b) for a, b in curve_abs], args.target
                ),
                "warm_time_to_target_s": warm_ttt,
                "warm_fit_s": warm_fit_s,
                "warm_total_s": warm_fit_s or 0.0,
            }
        )
    else:
        raise SparkTrainError(f"unknown child contender {args.child!r}")
    out["target_reached_abs"] = first_reaching(curve_abs, args.target) if curve_abs else None
    spark.stop()
    out["exit_abs"] = time.time()
    print(RESULT_MARK + json.dumps(out), flush=True)
    return 0


def _td_local(spark: Any, epochs: int, seed: int, target: float) -> Any:
    return run_local(ddp_train, epochs, seed, target, workers=WORKERS)


def _td_cluster(spark: Any, epochs: int, seed: int, target: float) -> Any:
    """``TorchDistributor(local_mode=False)``: torchrun inside barrier tasks."""
    return run_cluster(ddp_train, epochs, seed, target, workers=WORKERS)


def _torch_run(spark: Any, epochs: int, seed: int, target: float) -> Any:
    """The same DDP function under :func:`sparktrain.torch_run`, in sparktrain's session."""
    from sparktrain import torch_run

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return torch_run(ddp_train, epochs, seed, target, num_workers=WORKERS, spark=spark)


# the DDP contenders: one training function (:func:`ddp_train`), three launchers
DDP_RUNNERS = {
    "torchdistributor": _td_local,
    "torchdistributor-cluster": _td_cluster,
    "torch_run": _torch_run,
}
HEADLINE = ("ring", "torchdistributor", "torchdistributor-cluster", "torch_run", "session")
# the DDP contenders that make their call a second time, warm (the notebook case)
WARM_CALL = ("torchdistributor", "torch_run")
MEMORY_INTERVAL_S = 0.1  # how often the headline children's process trees are sampled


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[str, str, int, float, float, Any]:
    """Run one headline child, sampling its process tree's memory (``procmem``) until it
    exits; (stdout, stderr, exit code, spawned, ended, sampler). Bounded by
    ``SUBPROCESS_TIMEOUT_S``: a child that overruns it is killed."""
    from benchmarks.procmem import TreeMemorySampler

    spawned = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = TreeMemorySampler(proc.pid, MEMORY_INTERVAL_S).start()
    try:
        out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    ended = time.time()
    sampler.stop()
    return out, err, proc.returncode, spawned, ended, sampler


def run_headline(args: argparse.Namespace) -> list[dict[str, Any]]:
    """ring, TorchDistributor and the session floor, each in a fresh process, taking
    turns (the first of the three rotates with the repeat), per seed/repeat; each child's
    Python processes' memory is sampled from the parent."""
    records = []
    chosen = set(args.headline_contenders)
    env = {**os.environ, "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")}
    for seed in args.seeds:
        for repeat in range(args.repeats):
            for contender in [c for c in rotated(HEADLINE, repeat) if c in chosen]:
                cmd = [
                    sys.executable, "-m", "benchmarks.train", "--child", contender,
                    "--epochs", str(args.epochs), "--seed", str(seed), "--target", str(args.target),
                ]  # fmt: skip
                load = load_average()
                stdout, stderr, code, spawned, ended, sampler = run_child(cmd, env)
                line = next((x for x in stdout.splitlines() if x.startswith(RESULT_MARK)), None)
                record: dict[str, Any] = {
                    "contender": contender,
                    "strategy": "ring"
                    if contender == "ring"
                    else ("ddp-gloo" if contender in DDP_RUNNERS else "none"),
                    "compression": "none",
                    "link": "none",
                    "workload": "digits",
                    "seed": seed,
                    "repeat": repeat,
                    "whole_process_s": ended - spawned,
                    "load_avg_1m": load,
                    # the whole child, its warm second call included
                    "child_peak_pss_bytes": sampler.peak_pss_bytes,
                    "child_peak_rss_bytes": sampler.peak_rss_bytes,
                    "memory_samples": sampler.samples,
                    # at the whole child's PSS peak: [command line, pss bytes] per process
                    "peak_breakdown": [[what, pss] for _, what, pss in sampler.peak_breakdown],
                }
                if code != 0 or line is None:
                    tail = (stderr or stdout).strip().splitlines()[-5:]
                    record["error"] = f"exit {code}: " + " | ".join(tail)
                else:
                    child = json.loads(line[len(RESULT_MARK) :])
                    reached = child.pop("target_reached_abs")
                    child.pop("exit_abs")
                    # the first call's part of the run: up to the warm call (or the exit)
                    first_done = float(child.pop("first_done_abs", ended))
                    pss, rss = sampler.peak_until(first_done)
                    record["peak_pss_bytes"], record["peak_rss_bytes"] = pss, rss
                    # spawn until the SparkSession was up: the part every contender pays
                    record["session_ready_s"] = float(child.pop("session_ready_abs")) - spawned
                    record.update(child)
                    # the second (warm) call is not part of the first run's whole process
                    record["whole_process_s"] -= float(child.get("warm_total_s", 0.0))
                    record["contender"] = contender
                    record["whole_process_to_target_s"] = (
                        reached - spawned if reached is not None else None
                    )
                records.append(record)
                _progress(record)
    return records


# ---------------------------------------------------------------------- steady state
PRECISIONS = ("fp32", "bf16")
# the steady part's contenders: (name stem, strategy key of its records)
STEADY_KINDS = (("ring", "ring"), ("torchdistributor", "ddp-gloo"), ("compute-only", "none"))


def steady_name(stem: str, precision: str) -> str:
    """A steady contender's name: ``ring``, ``ring-bf16``, ``compute-only-bf16``..."""
    return stem if precision == "fp32" else f"{stem}-{precision}"


def steady_order(precisions: list[str], repeat: int) -> list[tuple[str, str]]:
    """The steady part's (stem, precision) turns in repeat ``repeat``: every contender of
    every precision, the list rotated by one per repeat, so each contender runs first,
    last and in between across repeats and no one always follows the same neighbour."""
    return rotated([(stem, p) for p in precisions for stem, _ in STEADY_KINDS], repeat)


def run_steady(spark: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Steady-state samples/s on the synthetic MLP, at each ``--steady-worlds`` world and
    each ``--steady-precisions`` precision: the sparktrain ring (a fit in this process's
    session, ``precision`` in its TrainConfig), DDP (``TorchDistributor.run`` of
    :func:`ddp_synthetic`, local mode, the forward under the same autocast) and the
    compute floor (``ddp_synthetic(exchange=False)``, contender ``compute-only``) take
    turns (:func:`steady_order`), ``--repeats`` times each; within a repeat every world
    runs before the next repeat starts."""
    from pyspark.ml.torch.distributor import TorchDistributor

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, like ours
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    split = load_split("synthetic", args)
    worlds = list(getattr(args, "steady_worlds", [WORKERS]))
    precisions = list(getattr(args, "steady_precisions", ["fp32"]))
    frames = {}
    for world in worlds:
        frames[world] = (
            datasets.to_dataframe(spark, split.x_train, split.y_train, world).cache(),
            datasets.to_dataframe(spark, split.x_test, split.y_test, world).cache(),
        )
        frames[world][0].count(), frames[world][1].count()
    model, kwargs, base, _ = workload_job("synthetic", args)
    strategies = dict(STEADY_KINDS)
    records = []
    for repeat in range(args.repeats):
        for world in worlds:
            for stem, precision in steady_order(precisions, repeat):
                contender = steady_name(stem, precision)
                record: dict[str, Any] = {
                    "contender": contender,
                    "strategy": strategies[stem],
                    "compression": "none",
                    "link": "none",
                    "workload": "synthetic",
                    "part": "steady",
                    "world": world,
                    "precision": precision,
                    "seed": 0,
                    "repeat": repeat,
                    "whole_process_s": None,
                    "load_avg_1m": load_average(),
                }
                try:
                    if stem == "ring":
                        keys = {
                            **base,
                            "strategy": "ring",
                            "epochs": args.steady_epochs,
                            "seed": 0,
                            "precision": precision,
                        }
                        fit = fit_once(spark, frames[world], model, kwargs, keys, None, world)
                        fit.pop("curve")
                        record.update(fit)
                        record["fit_samples_per_s"] = record.pop("samples_per_s")
                    else:
                        t = time.perf_counter()
                        ddp = TorchDistributor(
                            num_processes=world, local_mode=True, use_gpu=False
                        ).run(
                            ddp_synthetic,
                            args.steady_epochs,
                            0,
                            args.synthetic_samples,
                            stem == "torchdistributor",
                            precision,
                        )
                        if ddp is None:
                            raise SparkTrainError("TorchDistributor returned nothing from rank 0")
                        record.update(ddp)
                        record["fit_s"] = time.perf_counter() - t
                    record["samples_per_s"] = steady_rate(
                        record["epoch_seconds"], record.get("train_samples")
                    )
                except Exception as exc:  # one failed run, not the bench
                    record["error"] = f"{type(exc).__name__}: {exc}"
                records.append(record)
                _progress(record)
    for train, test in frames.values():
        train.unpersist(), test.unpersist()
    return records


def steady_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (world, precision) of the steady part: medians of the ring, DDP and the
    compute floor, ring / DDP of the same precision (the target, >= 1.2), ring / DDP in
    fp32 (DDP as shipped), each against the floor, and their final test accuracies.
    Records without ``world``/``precision`` (before both existed) are world 2, fp32."""
    ok = [r for r in records if "error" not in r and r.get("part") == "steady"]

    def runs(stem: str, world: int, precision: str) -> list[dict[str, Any]]:
        name = steady_name(stem, precision)
        return [
            r
            for r in ok
            if r["contender"] == name
            and r.get("world", WORKERS) == world
            and r.get("precision", "fp32") == precision
        ]

    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        return _median([r.get(key) for r in rows])

    worlds = sorted({int(r.get("world", WORKERS)) for r in ok})
    seen = {r.get("precision", "fp32") for r in ok}
    out = []
    for world in worlds:
        ddp32 = med(runs("torchdistributor", world, "fp32"), "samples_per_s")
        for precision in [p for p in PRECISIONS if p in seen]:
            ring = runs("ring", world, precision)
            ddp = runs("torchdistributor", world, precision)
            floor = runs("compute-only", world, precision)
            if not (ring or ddp or floor):
                continue
            a, b, c = (med(x, "samples_per_s") for x in (ring, ddp, floor))
            ratio = _ratio(a, b)
            out.append(
                {
                    "world": world,
                    "precision": precision,
                    "ring_samples_per_s": a,
                    "ddp_samples_per_s": b,
                    "compute_only_samples_per_s": c,
                    "ratio": ratio,
                    "ratio_vs_ddp_fp32": _ratio(a, ddp32),
                    "ring_of_floor": _ratio(a, c),
                    "ddp_of_floor": _ratio(b, c),
                    "ring_final_accuracy": med(ring, "final_accuracy"),
                    "ddp_final_accuracy": med(ddp, "final_accuracy"),
                    "compute_only_final_accuracy": med(floor, "final_accuracy"),
                    "runs": min(len(ring), len(ddp)),
                    "target": ">= 1.2",
                    "met": ratio is not None and ratio >= 1.2,
                    "load_avg_1m": _spread([r.get("load_avg_1m") for r in ring + ddp + floor]),
                }
            )
    return out


def steady_table(report: dict[str, Any]) -> str:
    """Markdown of the steady part: one row per world, precision and contender (medians
    and the min-max of samples/s over the repeats), then one verdict per world and
    precision."""
    lines = [
        "| world | precision | contender | samples/s (median) | min-max | x DDP (same precision) "
        "| x compute floor | final acc | runs | load (1 min) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows = {(r["world"], r["precision"]): r for r in steady_rows(report["runs"])}
    steady = [
        {"world": WORKERS, "precision": "fp32", **r}
        for r in report["runs"]
        if r.get("part") == "steady"
    ]
    groups = _group(steady, "world", "precision", "contender")
    turn = {steady_name(s, p): i for p in PRECISIONS for i, (s, _) in enumerate(STEADY_KINDS)}

    def place(key: tuple[Any, ...]) -> tuple[int, int, int]:
        return (key[0], PRECISIONS.index(key[1]), turn.get(key[2], len(turn)))

    for world, precision, contender in sorted(groups, key=place):
        good = [r for r in groups[(world, precision, contender)] if "error" not in r]
        head = f"| {world} | {precision} | {contender} | "
        if not good:
            lines.append(head + "error | - | - | - | - | 0 | - |")
            continue
        rates = [r["samples_per_s"] for r in good if r.get("samples_per_s") is not None]
        rate = _median(rates)
        row = rows.get((world, precision), {})
        loads = _spread([r.get("load_avg_1m") for r in good])
        cells = [
            _fmt(rate, "{:,.0f}"),
            f"{min(rates):,.0f}-{max(rates):,.0f}" if rates else "-",
            _fmt(_ratio(rate, row.get("ddp_samples_per_s")), "{:.2f}"),
            _fmt(_ratio(rate, row.get("compute_only_samples_per_s")), "{:.2f}"),
            _fmt(_median([r.get("final_accuracy") for r in good]), "{:.4f}"),
            str(len(good)),
            f"{loads[0]:.1f}-{loads[1]:.1f}" if loads else "-",
        ]
        lines.append(head + " | ".join(cells) + " |")
    verdicts = []
    for r in rows.values():
        cross = (
            f"; against DDP in fp32 {_fmt(r['ratio_vs_ddp_fp32'], '{:.2f}')}"
            if r["precision"] != "fp32"
            else ""
        )
        verdicts.append(
            f"- world {r['world']}, {r['precision']}: ring / DDP "
            f"{_fmt(r['ring_samples_per_s'], '{:,.0f}')} / "
            f"{_fmt(r['ddp_samples_per_s'], '{:,.0f}')} = {_fmt(r['ratio'], '{:.2f}')} "
            f"(target {r['target']}: {'met' if r['met'] else 'missed'}){cross}; the compute "
            f"floor {_fmt(r['compute_only_samples_per_s'], '{:,.0f}')} (ring "
            f"{_fmt(r['ring_of_floor'], '{:.0%}')} of it, DDP "
            f"{_fmt(r['ddp_of_floor'], '{:.0%}')}); final test accuracy ring "
            f"{_fmt(r['ring_final_accuracy'], '{:.4f}')}, DDP "
            f"{_fmt(r['ddp_final_accuracy'], '{:.4f}')}"
        )
    return "\n".join([*lines, "", *verdicts] if verdicts else lines)


# ---------------------------------------------------------------------- tree_aggregate vs MLlib
def run_mllib_pair(spark: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks import mllib

    split = datasets.digits()
    mllib.bench_ours(spark, split, WORKERS, TREE_AGGREGATE_LOCAL_STEPS, 1, args.target)  # warm-up
    records = []
    for seed_rep in range(args.repeats):
        ours = mllib.bench_ours(
            spark, split, WORKERS, TREE_AGGREGATE_LOCAL_STEPS, args.epochs, args.target
        )
        theirs = mllib.bench_mllib(spark, split, WORKERS, args.mllib_iters, args.target)
        # "sparktrain-fast": bench/mllib.py's recipe, kept apart from the matrix's rows
        for contender, r in (("sparktrain-fast", ours), ("mllib", theirs)):
            records.append(
                {
                    "contender": contender,
                    "strategy": "tree_aggregate" if contender != "mllib" else "mlp-lbfgs",
                    "compression": "none",
                    "link": "none",
                    "workload": "digits",
                    "seed": 0,
                    "repeat": seed_rep,
                    "system": r["system"],
                    "time_to_target_s": r["time_to_target_s"],
                    "final_accuracy": r["final_accuracy"],
                    "fit_s": r["total_s"],
                    "whole_process_s": None,
                    "samples_per_s": None,
                    "wire_bytes": r.get("spark_result_bytes"),
                    "raw_bytes": None,
                    "epochs": args.epochs if contender != "mllib" else None,
                    "curve": r["curve"],
                }
            )
            _progress(records[-1])
    return records


# ---------------------------------------------------------------------- derived figures
def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _spread(values: list[float | None]) -> list[float] | None:
    """[lowest, highest] of the load averages recorded next to a figure's runs."""
    vals = [v for v in values if v is not None]
    return [min(vals), max(vals)] if vals else None


def _memory_vs(
    ring: list[dict[str, Any]], td: list[dict[str, Any]], floor: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """Peak memory of the Python processes (``procmem``: summed PSS, java left out) of
    ring's first fit against TorchDistributor's first run (medians over repeats)."""
    a = _median([r.get("peak_pss_bytes") for r in ring])
    b = _median([r.get("peak_pss_bytes") for r in td])
    if a is None or b is None:
        return None
    ratio = _ratio(a, b)
    return {
        "ring_peak_pss_bytes": a,
        "torchdistributor_peak_pss_bytes": b,
        "ratio": ratio,
        "rss_ratio": _ratio(
            _median([r.get("peak_rss_bytes") for r in ring]),
            _median([r.get("peak_rss_bytes") for r in td]),
        ),
        "ring_peak_rss_bytes": _median([r.get("peak_rss_bytes") for r in ring]),
        "torchdistributor_peak_rss_bytes": _median([r.get("peak_rss_bytes") for r in td]),
        "session_only_peak_pss_bytes": _median([r.get("peak_pss_bytes") for r in floor]),
        "target": "<= 1.0",
        "met": ratio is not None and ratio <= 1.0,
    }


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def derive(records: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Ratios against the targets of issue 9 (medians over seeds and repeats)."""
    ok = [r for r in records if "error" not in r]

    def pick(**where: Any) -> list[dict[str, Any]]:
        return [r for r in ok if all(r.get(k) == v for k, v in where.items())]

    out: dict[str, Any] = {"target_accuracy": target}
    ring = pick(contender="ring", workload="digits")
    td = pick(contender="torchdistributor", workload="digits")
    if ring and td:
        ring_ttt = _median([r.get("whole_process_to_target_s") for r in ring])
        td_ttt = _median([r.get("whole_process_to_target_s") for r in td])
        ratio = _ratio(ring_ttt, td_ttt)
        out["ring_vs_torchdistributor"] = {
            "ring_whole_process_to_target_s": ring_ttt,
            "torchdistributor_whole_process_to_target_s": td_ttt,
            "ratio": ratio,
            "whole_process_s_ratio": _ratio(
                _median([r["whole_process_s"] for r in ring]),
                _median([r["whole_process_s"] for r in td]),
            ),
            "torchdistributor_eval_s": _median([r.get("eval_s") for r in td]),
            "target": "<= 1.0",
            "met": ratio is not None and ratio <= 1.0,
            "load_avg_1m": _spread([r.get("load_avg_1m") for r in ring + td]),
        }
        floor = pick(contender="session")
        if floor and td_ttt:
            # The floor every Spark-based contender pays: a fresh Python process that only
            # starts a SparkSession (and stops it); after it, each contender's own part.
            floor_s = _median([r["whole_process_s"] for r in floor])
            ready = _median([r.get("session_ready_s") for r in floor])
            ring_after = _median(
                [_minus(r.get("whole_process_to_target_s"), r.get("session_ready_s")) for r in ring]
            )
            td_after = _median(
                [_minus(r.get("whole_process_to_target_s"), r.get("session_ready_s")) for r in td]
            )
            out["ring_vs_torchdistributor"].update(
                {
                    "session_only_process_s": floor_s,
                    "session_ready_s": ready,
                    "floor_ratio": _ratio(floor_s, td_ttt),
                    "ring_after_session_s": ring_after,
                    "torchdistributor_after_session_s": td_after,
                    "after_session_ratio": _ratio(ring_after, td_after),
                }
            )
        ring_warm = _median([r.get("warm_time_to_target_s") for r in ring])
        td_warm = _median([r.get("warm_time_to_target_s") for r in td])
        if ring_warm is not None and td_warm is not None:
            # the second fit()/run() in an already-running process, as in a notebook
            warm_ratio = _ratio(ring_warm, td_warm)
            out["ring_vs_torchdistributor_warm"] = {
                "ring_time_to_target_s": ring_warm,
                "torchdistributor_time_to_target_s": td_warm,
                "ratio": warm_ratio,
                "target": "<= 0.25",
                "met": warm_ratio is not None and warm_ratio <= 0.25,
            }
        memory = _memory_vs(ring, td, pick(contender="session"))
        if memory:
            out["memory_vs_torchdistributor"] = memory
    whole = _whole_process_vs_peers(pick)
    if whole:
        out["whole_process_vs_peers"] = whole

    # the shipped world (2) in fp32; every world and precision is in "steady"
    def shipped(contender: str) -> list[dict[str, Any]]:
        rows = pick(contender=contender, workload="synthetic", part="steady")
        return [r for r in rows if r.get("world", WORKERS) == WORKERS]

    steady_ring, steady_td = shipped("ring"), shipped("torchdistributor")
    if steady_ring and steady_td:
        a = _median([r.get("samples_per_s") for r in steady_ring])
        b = _median([r.get("samples_per_s") for r in steady_td])
        ratio = _ratio(a, b)
        out["steady_vs_ddp"] = {
            "ring_samples_per_s": a,
            "ddp_samples_per_s": b,
            "ratio": ratio,
            "runs": min(len(steady_ring), len(steady_td)),
            "target": ">= 1.2",
            "met": ratio is not None and ratio >= 1.2,
            "load_avg_1m": _spread([r.get("load_avg_1m") for r in steady_ring + steady_td]),
        }
        floor = shipped("compute-only")
        if floor:
            # the most any gradient exchange could reach: the same steps, no exchange
            c = _median([r.get("samples_per_s") for r in floor])
            out["steady_vs_ddp"]["compute_only_samples_per_s"] = c
            out["steady_vs_ddp"]["compute_only_ratio"] = _ratio(c, b)
    steady = steady_rows(records)
    if steady:
        out["steady"] = steady
    ta = pick(contender="sparktrain-fast")
    ml = pick(contender="mllib")
    if ta and ml:
        a, b = (
            _median([r["time_to_target_s"] for r in ta]),
            _median([r["time_to_target_s"] for r in ml]),
        )
        ratio = _ratio(a, b)
        out["tree_aggregate_vs_mllib"] = {
            "tree_aggregate_time_to_target_s": a,
            "mllib_time_to_target_s": b,
            "ratio": ratio,
            "target": "<= 1",
            "met": ratio is not None and ratio <= 1.0,
        }
    matrix = [r for r in pick(contender="sparktrain") if "system" not in r]
    out["compression_vs_ideal"] = _compression_vs_ideal(matrix)
    out["auto_vs_best"] = _auto_vs_best(matrix)
    return out


# (ours, peer) pairs of the headline: sparktrain's built-in loop and its torch_run against
# both TorchDistributor modes
WHOLE_PROCESS_PAIRS = (
    ("ring", "torchdistributor"),
    ("ring", "torchdistributor-cluster"),
    ("torch_run", "torchdistributor"),
    ("torch_run", "torchdistributor-cluster"),
)


def _whole_process_vs_peers(pick: Any) -> list[dict[str, Any]]:
    """Medians of each headline contender's whole process (spawn to exit, and spawn to the
    target accuracy), and the ratio of each (ours, peer) pair of
    :data:`WHOLE_PROCESS_PAIRS` that this run measured."""
    rows = []
    for ours, peer in WHOLE_PROCESS_PAIRS:
        a, b = pick(contender=ours, workload="digits"), pick(contender=peer, workload="digits")
        if not a or not b:
            continue
        a_ttt = _median([r.get("whole_process_to_target_s") for r in a])
        b_ttt = _median([r.get("whole_process_to_target_s") for r in b])
        a_all = _median([r.get("whole_process_s") for r in a])
        b_all = _median([r.get("whole_process_s") for r in b])
        rows.append(
            {
                "ours": ours,
                "peer": peer,
                "ours_to_target_s": a_ttt,
                "peer_to_target_s": b_ttt,
                "to_target_ratio": _ratio(a_ttt, b_ttt),
                "ours_whole_s": a_all,
                "peer_whole_s": b_all,
                "whole_ratio": _ratio(a_all, b_all),
                "runs": min(len(a), len(b)),
                "load_avg_1m": _spread([r.get("load_avg_1m") for r in a + b]),
            }
        )
    return rows


def _group(
    records: list[dict[str, Any]], *keys: str
) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def _bandwidth(profile: str) -> float:
    """Bytes/s of a link profile (wire/link.py's figures)."""
    from sparktrain.wire.link import PROFILES

    return float(PROFILES[profile].bandwidth)


def _compression_vs_ideal(matrix: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Under 5g, per workload and strategy: the training-time saving of each compressor
    against the uncompressed run, next to the ideal ``1 - 1/ratio``."""
    rows = []
    groups = _group([r for r in matrix if r["link"] == "5g"], "workload", "strategy", "compression")
    for (workload, strategy, compression), runs in sorted(groups.items()):
        base = groups.get((workload, strategy, "none"))
        if compression in ("none", "auto") or not base:
            continue
        t0 = _median([r["train_s"] for r in base])
        t = _median([r["train_s"] for r in runs])
        comm0 = _median([r.get("comm_s") for r in base])
        wire0 = _median([r.get("wire_bytes") for r in base])
        ratio = _median([r.get("compression_ratio") for r in runs])
        if t0 is None or t is None or ratio is None or t0 <= 0:
            continue
        saving = 1.0 - t / t0
        ideal = 1.0 - 1.0 / ratio if ratio > 0 else 0.0
        # each rank has a link of its own: its share of the bytes at the 5g bandwidth
        transfer = wire0 / WORKERS / _bandwidth("5g") if wire0 is not None else None
        dominates = transfer is not None and transfer / t0 >= COMM_DOMINATES
        fraction = saving / ideal if ideal > 0 else None
        rows.append(
            {
                "workload": workload,
                "strategy": strategy,
                "compression": compression,
                "train_s_none": t0,
                "train_s": t,
                "comm_share_none": comm0 / t0 if comm0 is not None else None,
                "transfer_share_none": transfer / t0 if transfer is not None else None,
                "ratio": ratio,
                "saving": saving,
                "ideal_saving": ideal,
                "fraction_of_ideal": fraction,
                "comm_dominates": dominates,
                "met": (fraction is not None and fraction >= 0.7) if dominates else None,
            }
        )
    return rows


def _score(runs: list[dict[str, Any]]) -> float | None:
    """Lower is better: time to target on digits, training time on the synthetic job."""
    if runs[0]["workload"] == "digits":
        return _median([r["time_to_target_s"] for r in runs])
    return _median([r["train_s"] for r in runs])


def _auto_vs_best(matrix: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for (workload, link), runs in sorted(_group(matrix, "workload", "link").items()):
        by_choice = _group(runs, "strategy", "compression")
        auto = by_choice.get(("auto", "auto"))
        if not auto:
            continue
        # auto picks among costmodel's strategies and compressors: the best fixed choice
        # is sought among the same ones (tree_aggregate's local SGD is another algorithm)
        from sparktrain import costmodel

        fixed: dict[tuple[Any, ...], float] = {}
        for k, v in by_choice.items():
            score = _score(v)
            if (
                k[0] in costmodel.AUTO_STRATEGIES
                and k[1] in costmodel.AUTO_COMPRESSIONS
                and score is not None
            ):
                fixed[k] = score
        auto_score = _score(auto)
        if not fixed or auto_score is None:
            continue
        best_key = min(fixed, key=lambda k: fixed[k])
        gap = auto_score / fixed[best_key] - 1.0
        rows.append(
            {
                "workload": workload,
                "link": link,
                "measure": "time_to_target_s" if workload == "digits" else "train_s",
                "auto": auto_score,
                "auto_chose": auto[0].get("chosen"),
                "best_fixed": list(best_key),
                "best_fixed_score": fixed[best_key],
                "gap": gap,
                "met": gap <= 0.10,
            }
        )
    return rows


# ---------------------------------------------------------------------- output
def _fmt(value: float | None, pattern: str, missing: str = "-") -> str:
    return missing if value is None else pattern.format(value)


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def table(report: dict[str, Any]) -> str:
    """Markdown: one row per contender configuration (medians over seeds and repeats)."""
    lines = [
        "| workload | link | contender | strategy | compression | time to target | "
        "whole process (to target) | final acc | samples/s | wire MB | ratio |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    keys = ("workload", "link", "contender", "strategy", "compression")
    for key, runs in _group(report["runs"], *keys).items():
        head = "| " + " | ".join(map(str, key)) + " | "
        good = [r for r in runs if "error" not in r]
        if not good:
            lines.append(head + "error | - | - | - | - | - |")
            continue

        def med(k: str, rows: list[dict[str, Any]] = good) -> float | None:
            return _median([r.get(k) for r in rows])

        whole, whole_t = med("whole_process_s"), med("whole_process_to_target_s")
        cells = [
            _fmt(med("time_to_target_s"), "{:.2f} s", "not reached" if key[0] == "digits" else "-"),
            f"{whole:.1f} s ({_fmt(whole_t, '{:.1f} s', 'not reached')})" if whole else "-",
            _fmt(med("final_accuracy"), "{:.4f}"),
            _fmt(med("samples_per_s"), "{:,.0f}"),
            _fmt(_scaled(med("wire_bytes"), 1e-6), "{:.2f}"),
            _fmt(med("compression_ratio"), "{:.1f}"),
        ]
        lines.append(head + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Time-to-target bars per contender (digits, no link) and, under 5g, a strategy ×
    compressor heatmap per workload."""
    plt = pyplot()
    import numpy as np

    runs = [r for r in report["runs"] if "error" not in r]
    digits_none = [r for r in runs if r["workload"] == "digits" and r["link"] == "none"]
    bars = []
    for key, group in _group(digits_none, "contender", "strategy", "compression").items():
        value = _median(
            [r.get("whole_process_to_target_s") or r.get("time_to_target_s") for r in group]
        )
        if value is not None:
            if key[0] == "ring":
                label = "ring, fresh process (from spawn)"
            elif key[0] == "torchdistributor":
                label = "TorchDistributor DDP/Gloo, fresh process (from spawn)"
            elif key[0] == "torchdistributor-cluster":
                label = "TorchDistributor(local_mode=False), fresh process (from spawn)"
            elif key[0] == "torch_run":
                label = "sparktrain.torch_run DDP/Gloo, fresh process (from spawn)"
            elif key[0] == "mllib":
                label = "MLlib MLP (L-BFGS), cheapest fit"
            elif key[0] == "sparktrain-fast":
                label = "tree_aggregate, bench mllib's fast recipe"
            else:
                label = f"{key[1]} {key[2]}" if key[2] != "none" else key[1]
            bars.append((label, value))
    heat = [r for r in runs if r["link"] == "5g" and r["contender"] == "sparktrain"]
    workloads = sorted({r["workload"] for r in heat})
    fig, axes = plt.subplots(
        1, 1 + len(workloads), figsize=(6.4 + 4.2 * len(workloads), 0.3 * max(len(bars), 8) + 1.5)
    )
    axes = np.atleast_1d(axes)
    ax = axes[0]
    if bars:
        bars.sort(key=lambda b: b[1])
        ax.barh([b[0] for b in bars], [b[1] for b in bars], color="tab:blue")
        ax.invert_yaxis()
    ax.set_xlabel(f"seconds to {report['target']:.2f} test accuracy (digits)")
    ax.set_title("digits, no link: time to accuracy (from fit() unless noted)", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    for ax, workload in zip(axes[1:], workloads, strict=True):
        rows = [r for r in heat if r["workload"] == workload]
        strategies = sorted({r["strategy"] for r in rows})
        seen = {r["compression"] for r in rows}
        comps = [c for c in report.get("args", {}).get("compressions", []) if c in seen]
        comps += sorted(seen - set(comps))  # auto, or anything not asked for by name
        grid = np.full((len(strategies), len(comps)), np.nan)
        for (s, c), group in _group(rows, "strategy", "compression").items():
            value = _score(group)
            if value is not None:
                grid[strategies.index(s), comps.index(c)] = value
        im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
        ax.set_xticks(range(len(comps)), comps, rotation=30, fontsize=7)
        ax.set_yticks(range(len(strategies)), strategies, fontsize=7)
        for i in range(len(strategies)):
            for j in range(len(comps)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize=7)
        measure = "s to target" if workload == "digits" else "training s"
        ax.set_title(f"5g, {workload}: {measure}", fontsize=9)
        fig.colorbar(im, ax=ax, shrink=0.8)
    save_figure(fig, path)


def machine() -> dict[str, Any]:
    import platform

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------- entry
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--compressions", nargs="+", default=list(COMPRESSIONS))
    parser.add_argument("--workloads", nargs="+", default=["digits", "synthetic"])
    parser.add_argument("--links", nargs="+", default=["none", "5g"])
    parser.add_argument(
        "--include-auto", action="store_true", help="add strategy=auto, compression=auto"
    )

    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=10, help="digits epochs per fit")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--synthetic-samples", type=int, default=20_000)
    parser.add_argument("--synthetic-epochs", type=int, default=1)
    parser.add_argument("--mllib-iters", type=int, nargs="+", default=[10, 20, 40, 80])
    parser.add_argument(
        "--steady-epochs",
        type=int,
        default=4,
        help="synthetic epochs per run of the steady part (the first is left out of its rate)",
    )
    parser.add_argument(
        "--steady-worlds",
        type=int,
        nargs="+",
        default=[WORKERS],
        help="worlds of the steady part (the session's master gets local[max(2, worlds)]: "
        "a world above the machine's cores oversubscribes them, every contender alike)",
    )
    parser.add_argument(
        "--steady-precisions",
        nargs="+",
        choices=list(PRECISIONS),
        default=["fp32"],
        help="precisions of the steady part: bf16 runs ring-bf16 (TrainConfig precision="
        "'bf16'), torchdistributor-bf16 and compute-only-bf16 (the forward under CPU "
        "autocast to bfloat16, float32 weights)",
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=["headline", "steady", "matrix", "mllib"],
        default=["headline", "steady", "matrix", "mllib"],
        help="which comparisons to run (steady: ring against DDP, steady-state samples/s "
        "on the synthetic MLP)",
    )
    parser.add_argument(
        "--headline-contenders",
        nargs="+",
        choices=list(HEADLINE),
        default=list(HEADLINE),
        help="which fresh-process contenders the headline part runs",
    )
    parser.add_argument("--out", default="docs/results", help="folder for bench_train.json/.png")
    parser.add_argument("--json", metavar="PATH", help="JSON path (default OUT/bench_train.json)")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the JSON's earlier runs, replacing those this run measures again (same "
        "contender, strategy, compression, link and workload), and derive from the union",
    )


def main(args: argparse.Namespace) -> int:
    from sparktrain.session import get_or_create_session

    for name in args.strategies:
        strategy_config(name)  # refuse a typo before minutes of work
    for name in args.workloads:
        workload_job(name, args)
    if args.steady_epochs < 2 and "steady" in args.parts:
        raise SparkTrainError(
            f"--steady-epochs {args.steady_epochs}: the steady rate leaves the first epoch "
            "out, so it needs at least 2"
        )
    if "steady" in args.parts and min(args.steady_worlds) < 2:
        raise SparkTrainError(
            f"--steady-worlds {args.steady_worlds}: a data-parallel comparison needs 2 ranks"
        )
    slots = max(WORKERS, *args.steady_worlds) if "steady" in args.parts else WORKERS
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    if "headline" in args.parts:
        runs += run_headline(args)
    if {"steady", "matrix", "mllib"} & set(args.parts):
        spark = get_or_create_session(f"local[{slots}]", app_name="sparktrain-bench-train")
        spark.sparkContext.parallelize(range(4), 2).count()
        warm_up(spark)
        if "steady" in args.parts:
            runs += run_steady(spark, args)
        if "matrix" in args.parts:
            runs += run_matrix(spark, args)
        if "mllib" in args.parts:
            runs += run_mllib_pair(spark, args)
    report: dict[str, Any] = {
        "target": args.target,
        "workers": WORKERS,
        "master": f"local[{slots}]",
        "args": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "machine": machine(),
        "bench_s": time.perf_counter() - started,
        "runs": runs,
    }
    path = Path(args.json) if args.json else Path(args.out) / "bench_train.json"
    if args.merge and path.exists():
        report = merge_reports(json.loads(path.read_text()), report)
    report["derived"] = derive(report["runs"], args.target)
    print(table(report))
    if "steady" in report["derived"]:
        print(steady_table(report))
    print(json.dumps(report["derived"], indent=1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    if any(r.get("part") != "steady" for r in report["runs"]):  # the plot has no steady bars
        plot(report, path.with_suffix(".png"))
        print(f"report written to {path} and {path.with_suffix('.png')}")
    else:
        print(f"report written to {path}")
    return 0


RUN_KEY = ("contender", "strategy", "compression", "link", "workload")


def run_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """A run's cell for ``--merge``: ``RUN_KEY`` and the world (2 where not recorded)."""
    return (*(r.get(k) for k in RUN_KEY), r.get("world", WORKERS))


def merge_reports(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with ``old``'s runs of every cell ``new`` did not measure; each run keeps
    the date it was measured (``measured``), and ``merged`` lists the reruns' arguments."""
    stamp = time.strftime("%Y-%m-%d")
    fresh = [{**r, "measured": stamp} for r in new["runs"]]
    cells = {run_key(r) for r in fresh}
    kept = [r for r in old.get("runs", []) if run_key(r) not in cells]
    history = [*old.get("merged", []), {"date": stamp, "args": new["args"]}]
    return {
        **new,
        "args": old.get("args", new["args"]),
        "bench_s": old.get("bench_s", 0.0) + new["bench_s"],
        "runs": kept + fresh,
        "merged": history,
    }


def _child_entry(argv: list[str]) -> int:
    import logging

    logging.getLogger("py4j").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train")
    parser.add_argument("--child", choices=list(HEADLINE), required=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.95)
    return child_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_child_entry(sys.argv[1:]))
