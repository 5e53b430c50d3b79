"""Defaults that train (issue 34.1): sparktrain's ``TrainConfig`` defaults against MLlib's
own defaults on scikit-learn's real data sets, with a newcomer's settings, in one run.

    sparktrain bench defaults --json docs/results/bench_defaults.json
    sparktrain bench defaults --datasets digits diabetes --seeds 0   # smaller, quicker

One Spark session (``local[2]``). For each data set and each seed, the rows are split
75/25 (``train_test_split(random_state=seed)``, stratified for classification) into a
train and a test DataFrame of the raw columns (``x0 .. xN`` and ``label``), as a
newcomer loads them (no scaling of any kind by hand), cached and counted before timing.
Then, each fit timed on its own (after one untimed warm-up fit of each kind on a slice of
digits, so that the first timed fit does not pay for the Python workers' start and the
JVM's compilation alone):

* **new defaults**: ``Trainer(model, TrainConfig(num_workers=2, seed=seed)).fit(df)`` on
  ``F.array(x0 .. xN)`` as the ``features`` column; ``loss="mse"`` for regression; nothing
  else (``progress=False`` only hides the progress bar). Until the defaults of issue 34.1
  are in ``TrainConfig`` (no ``feature_scaling`` field yet, or the default optimizer is not
  Adam) the bench passes the new settings that exist explicitly instead (``optimizer=adam,
  lr=1e-3, epochs=50``, ``label_scaling`` for mse) and records this in ``settings``.
* **old defaults**: the same with ``optimizer="sgd", lr=0.01, epochs=10`` and no label or
  feature scaling: what the same call did before the change.
* **MLlib defaults**: ``LogisticRegression()`` (classification) or ``LinearRegression()``
  (regression) with every default (``standardization=True``), fitted on a
  ``VectorAssembler`` of the same raw columns.

The test metric is accuracy (classification) or R² (regression) on the test rows, computed
on the driver: ours from ``result.model`` applied to the raw test features (the returned
model takes raw features and answers in label units), MLlib's from ``transform``.

Data sets: ``digits`` (``load_digits``, 1,797 8x8 images, pixel values 0..16, 10 classes,
``sparktrain.models:digits_mlp``), ``digits_cnn`` (the same rows,
``sparktrain.models:digits_cnn``, standing in for an MNIST CNN, as MNIST cannot be
downloaded here), ``breast_cancer`` (569 rows, 30 features of very different scales, 2
classes, ``sparktrain.models:mlp`` with ``in_features=30, out_features=2``: the default
128-unit hidden layer), ``diabetes`` (442 rows, 10 features as scikit-learn ships them,
target 25..346, ``mlp`` with ``in_features=10, out_features=1``, ``loss="mse"``) and
``california`` (20,640 rows, 8 features, ``mlp`` with ``in_features=8, out_features=1``,
``loss="mse"``), whose loader downloads the data: where that fails, the row says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sparktrain.errors import ConfigError

COMMAND = "sparktrain bench defaults --json docs/results/bench_defaults.json"
CONTENDERS = ("new", "old", "mllib")
CONTENDER_TITLES = {
    "new": "sparktrain, new defaults",
    "old": "sparktrain, old defaults",
    "mllib": "MLlib defaults",
}
# the settings the new defaults bring (issue 34.1), passed explicitly until they land
NEW_SETTINGS: dict[str, Any] = {"optimizer": "adam", "lr": 1e-3, "epochs": 50}
OLD_SETTINGS: dict[str, Any] = {"optimizer": "sgd", "lr": 0.01, "epochs": 10}
# where TrainConfig's defaults and their scaling live: named when uncommitted at the run
DEFAULTS_FILES = (
    "sparktrain/config.py",
    "sparktrain/driver/prepare.py",
    "sparktrain/driver/job.py",
)
# the gap (MLlib minus ours, in the test metric) worth flagging
SHORTFALL = 0.02


@dataclasses.dataclass(frozen=True)
class Workload:
    """One data set, the model a newcomer would pick for it, and MLlib's peer."""

    name: str
    loader: str  # sklearn.datasets function
    task: str  # "classification" | "regression"
    model_fn: str
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def metric(self) -> str:
        return "accuracy" if self.task == "classification" else "R²"

    @property
    def model_call(self) -> str:
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self.model_kwargs.items())
        return f"{self.model_fn.rpartition(':')[2]}({kwargs})"


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("digits", "load_digits", "classification", "sparktrain.models:digits_mlp"),
        Workload("digits_cnn", "load_digits", "classification", "sparktrain.models:digits_cnn"),
        Workload(
            "breast_cancer",
            "load_breast_cancer",
            "classification",
            "sparktrain.models:mlp",
            {"in_features": 30, "out_features": 2},
        ),
        Workload(
            "diabetes",
            "load_diabetes",
            "regression",
            "sparktrain.models:mlp",
            {"in_features": 10, "out_features": 1},
        ),
        Workload(
            "california",
            "fetch_california_housing",
            "regression",
            "sparktrain.models:mlp",
            {"in_features": 8, "out_features": 1},
        ),
    )
}


# ---------------------------------------------------------------------- figures
def mean_sd(values: Sequence[float]) -> tuple[float, float] | None:
    """Mean and sample standard deviation (0 for one value); None for no values."""
    if not values:
        return None
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), sd


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per contender: the metric's and the fit time's mean and sd over the runs that
    finished, and how many failed (diverged, raised)."""
    out: dict[str, dict[str, Any]] = {}
    for contender in CONTENDERS:
        mine = [r for r in runs if r["contender"] == contender]
        done = [r for r in mine if r.get("metric") is not None and math.isfinite(r["metric"])]
        out[contender] = {
            "metric": mean_sd([r["metric"] for r in done]),
            "fit_s": mean_sd([r["fit_s"] for r in done]),
            "runs": len(mine),
            "failed": len(mine) - len(done),
            "errors": sorted({r["error"] for r in mine if r.get("error")}),
        }
    return out


def shortfall(summary: dict[str, dict[str, Any]]) -> float | None:
    """MLlib's mean test metric minus our new defaults' (positive: ours fall short)."""
    new, mllib = summary["new"]["metric"], summary["mllib"]["metric"]
    if new is None or mllib is None:
        return None
    return float(mllib[0] - new[0])


def _pm(pair: Any, pattern: str = "{:.3f}") -> str:
    if pair is None:
        return "-"
    return f"{pattern.format(pair[0])} ± {pattern.format(pair[1])}"


def _metric_cell(s: dict[str, Any]) -> str:
    cell = _pm(s["metric"])
    if s["failed"]:
        cell += f" ({s['failed']}/{s['runs']} failed)"
    return cell


def table(report: dict[str, Any]) -> str:
    """The results page's table: one row per data set, mean ± sd over the seeds."""
    seeds = report["seeds"]
    lines = [
        f"Seeds {', '.join(str(s) for s in seeds)} (the split's and the config's); "
        f"{report['master']}, num_workers={report['num_workers']}; machine load "
        f"(`uptime`) before: {report['load_before']}; after: {report['load_after']}."
        + _tree_line(report.get("tree")),
        "",
        f"Our settings: {report['settings']}.",
        "",
        "| data set | rows × features | model | metric | sparktrain, new defaults "
        "| sparktrain, old defaults | MLlib defaults | MLlib − new | fit s: new / old / MLlib |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for w in report["workloads"]:
        head = f"| {w['name']} | {w.get('shape', '-')} | `{w['model']}` | {w['metric']} "
        if w.get("not_measured"):
            lines.append(head + f"| not measured: {w['not_measured']} | | | | |")
            continue
        s = w["summary"]
        gap = w.get("shortfall")
        flag = " ⚠" if gap is not None and gap > SHORTFALL else ""
        gap_cell = "-" if gap is None else f"{gap:+.3f}{flag}"
        times = " / ".join(
            "-" if s[c]["fit_s"] is None else f"{s[c]['fit_s'][0]:.1f}" for c in CONTENDERS
        )
        lines.append(
            head + f"| {_metric_cell(s['new'])} | {_metric_cell(s['old'])} "
            f"| {_metric_cell(s['mllib'])} | {gap_cell} | {times} |"
        )
    errors = [
        f"- {w['name']}, {CONTENDER_TITLES[c]}: {e}"
        for w in report["workloads"]
        if not w.get("not_measured")
        for c in CONTENDERS
        for e in w["summary"][c]["errors"]
    ]
    if errors:
        lines += ["", "Failed runs:", "", *errors]
    flagged = [
        w for w in report["workloads"]
        if w.get("shortfall") is not None and w["shortfall"] > SHORTFALL
    ]  # fmt: skip
    if flagged:
        lines += [
            "",
            f"⚠ the new defaults fall short of MLlib's by more than {SHORTFALL}: "
            + "; ".join(f"{w['name']} by {w['shortfall']:.3f}" for w in flagged)
            + ".",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- configs
def defaults_landed(config_cls: Any = None) -> bool:
    """Whether ``TrainConfig``'s defaults are issue 34.1's (a ``feature_scaling`` field,
    Adam): then the bench passes nothing but the model, data, workers and loss."""
    if config_cls is None:
        from sparktrain.config import TrainConfig as config_cls
    names = {f.name for f in dataclasses.fields(config_cls)}
    if "feature_scaling" not in names:
        return False
    cfg = config_cls()
    return bool(cfg.optimizer == NEW_SETTINGS["optimizer"] and cfg.lr == NEW_SETTINGS["lr"])


def config_kwargs(
    contender: str, task: str, seed: int, num_workers: int, landed: bool, has_feature_scaling: bool
) -> dict[str, Any]:
    """The ``TrainConfig`` keywords of one of our fits."""
    kwargs: dict[str, Any] = {"num_workers": num_workers, "seed": seed, "progress": False}
    if task == "regression":
        kwargs["loss"] = "mse"
    if contender == "new":
        if not landed:  # the new settings that exist, until they are the defaults
            kwargs.update(NEW_SETTINGS)
            kwargs["label_scaling"] = task == "regression"
    elif contender == "old":
        kwargs.update(OLD_SETTINGS)
        kwargs["label_scaling"] = False
        if has_feature_scaling:
            kwargs["feature_scaling"] = False
    else:
        raise ConfigError(f"contender {contender!r} is not one of ours")
    return kwargs


def settings_line(landed: bool, has_feature_scaling: bool) -> str:
    old = ", ".join(f"{k}={v!r}" for k, v in OLD_SETTINGS.items())
    old += ", label_scaling=False" + (", feature_scaling=False" if has_feature_scaling else "")
    if landed:
        new = "TrainConfig's defaults (only num_workers, seed and, for regression, loss='mse')"
    else:
        new = (
            "the new defaults not yet in TrainConfig: passed explicitly "
            + ", ".join(f"{k}={v!r}" for k, v in NEW_SETTINGS.items())
            + ", label_scaling=True for mse; no feature_scaling (not in TrainConfig yet)"
        )
    return f"new: {new}; old: {old}"


# ---------------------------------------------------------------------- arguments
def validate(args: argparse.Namespace) -> None:
    """Refuse arguments the bench cannot measure with."""
    unknown = [d for d in args.datasets if d not in WORKLOADS]
    if unknown:
        raise ConfigError(
            f"--datasets: unknown {', '.join(unknown)}; known: {', '.join(WORKLOADS)}"
        )
    if not args.seeds:
        raise ConfigError("--seeds needs at least one seed")
    if args.num_workers < 1:
        raise ConfigError("--num-workers must be at least 1")
    if not 0 < args.test_fraction < 1:
        raise ConfigError("--test-fraction must be between 0 and 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--datasets", nargs="+", default=list(WORKLOADS), metavar="NAME",
        help=f"data sets (default all: {', '.join(WORKLOADS)})",
    )  # fmt: skip
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0, 1, 2], help="split and config seeds"
    )
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--test-fraction", type=float, default=0.25)
    parser.add_argument(
        "--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS),
        help="which fits to run (default all)",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    parser.add_argument("--master", help="Spark master (default local[num-workers])")


# ---------------------------------------------------------------------- the run
def load(workload: Workload) -> tuple[Any, Any]:
    """``(X, y)`` as scikit-learn returns them (raises OSError/URLError where the loader
    needs a download that cannot happen)."""
    import socket

    import sklearn.datasets

    loader: Callable[..., Any] = getattr(sklearn.datasets, workload.loader)
    # a download fails fast where there is no network; only here: py4j's sockets must
    # keep no timeout (a long MLlib fit would break the gateway's connection)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)
    try:
        bunch = loader()
    finally:
        socket.setdefaulttimeout(previous)
    return bunch.data, bunch.target


def _uptime() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


def tree_state(root: Path | None = None) -> dict[str, Any]:
    """The checkout the figures come from: ``HEAD`` and the files under ``sparktrain/``
    that differ from it (the defaults measured may be uncommitted)."""
    import subprocess

    root = root or Path(__file__).resolve().parents[1]

    def git(*argv: str) -> str:
        try:
            done = subprocess.run(
                ["git", *argv], cwd=root, capture_output=True, text=True, timeout=60, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout if done.returncode == 0 else ""

    changed = [line[3:] for line in git("status", "--porcelain", "--", "sparktrain").splitlines()]
    return {"head": git("rev-parse", "HEAD").strip() or None, "uncommitted": changed}


def _tree_line(tree: dict[str, Any] | None) -> str:
    if not tree or not tree.get("head"):
        return ""
    line = f" sparktrain at {tree['head'][:10]}"
    changed = tree.get("uncommitted") or []
    if changed:
        line += f" with {len(changed)} uncommitted file{'s' if len(changed) > 1 else ''} "
        line += "under sparktrain/"
        mine = [f.removeprefix("sparktrain/") for f in DEFAULTS_FILES if f in changed]
        if mine:
            line += f" ({', '.join(mine)} among them)"
    return line + "."


def _frames(spark: Any, x: Any, y: Any, num_workers: int) -> tuple[Any, list[str]]:
    import pandas as pd

    cols = [f"x{i}" for i in range(x.shape[1])]
    pdf = pd.DataFrame(x.astype("float64"), columns=cols)
    pdf["label"] = y.astype("float64")
    df = spark.createDataFrame(pdf).repartition(num_workers).cache()
    df.count()
    return df, cols


def _ours(
    spark: Any, workload: Workload, train: Any, cols: list[str], x_test: Any, y_test: Any,
    cfg_kwargs: dict[str, Any],
) -> tuple[float, float]:  # fmt: skip
    import numpy as np
    import torch
    from pyspark.sql import functions as F

    from sparktrain import TrainConfig, Trainer

    df = train.select(F.array(*cols).alias("features"), "label")
    trainer = Trainer(
        workload.model_fn, TrainConfig(**cfg_kwargs), model_kwargs=workload.model_kwargs,
        spark=spark,
    )  # fmt: skip
    started = time.perf_counter()
    result = trainer.fit(df)
    fit_s = time.perf_counter() - started
    model = result.model.eval()
    with torch.no_grad():
        out = model(torch.from_numpy(np.asarray(x_test, dtype=np.float32))).double().numpy()
    if workload.task == "classification":
        return float((out.argmax(axis=1) == y_test).mean()), fit_s
    return r2(y_test, out.reshape(-1)), fit_s


def _mllib(
    workload: Workload, train: Any, test: Any, cols: list[str], y_test: Any
) -> tuple[float, float]:
    import numpy as np
    from pyspark.ml.classification import LogisticRegression
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.regression import LinearRegression

    assembler = VectorAssembler(inputCols=cols, outputCol="features")
    vtrain = assembler.transform(train).select("features", "label").cache()
    vtest = assembler.transform(test).select("features", "label")
    vtrain.count()
    estimator = LogisticRegression() if workload.task == "classification" else LinearRegression()
    started = time.perf_counter()
    model = estimator.fit(vtrain)
    fit_s = time.perf_counter() - started
    vtrain.unpersist()
    rows = model.transform(vtest).select("prediction", "label").collect()
    pred = np.array([r.prediction for r in rows])
    label = np.array([r.label for r in rows])
    if workload.task == "classification":
        return float((pred == label).mean()), fit_s
    return r2(label, pred), fit_s


def r2(y: Any, pred: Any) -> float:
    """The coefficient of determination (scikit-learn's ``r2_score``)."""
    import numpy as np

    y, pred = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return 1.0 - ss_res / ss_tot


def warm_up(spark: Any, num_workers: int) -> None:
    """One untimed fit of each kind on a slice of digits: Spark's Python workers import
    torch, the JVM compiles MLlib's and our query paths, so the first timed fit pays no
    more than the others."""
    x, y = load(WORKLOADS["digits"])
    train, cols = _frames(spark, x[:400], y[:400], num_workers)
    kwargs = config_kwargs("old", "classification", 0, num_workers, True, False)
    _ours(spark, WORKLOADS["digits"], train, cols, x[:10], y[:10], {**kwargs, "epochs": 1})
    _mllib(WORKLOADS["digits"], train, train, cols, y[:400])
    train.unpersist()


def run_workload(
    spark: Any, workload: Workload, args: argparse.Namespace, landed: bool, has_fs: bool
) -> dict[str, Any]:
    from sklearn.model_selection import train_test_split

    entry: dict[str, Any] = {
        "name": workload.name,
        "task": workload.task,
        "metric": workload.metric,
        "model": workload.model_call,
    }
    try:
        x, y = load(workload)
    except Exception as exc:  # a loader that must download, offline
        print(f"{workload.name}: not measured ({exc!r})", flush=True)
        entry["not_measured"] = "no download here"
        entry["load_error"] = repr(exc)
        return entry
    entry["shape"] = f"{x.shape[0]:,} × {x.shape[1]}"
    runs: list[dict[str, Any]] = []
    for seed in args.seeds:
        stratify = y if workload.task == "classification" else None
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=args.test_fraction, random_state=seed, stratify=stratify
        )
        train, cols = _frames(spark, x_tr, y_tr, args.num_workers)
        test, _ = _frames(spark, x_te, y_te, args.num_workers)
        for contender in args.contenders:
            run: dict[str, Any] = {"contender": contender, "seed": seed}
            try:
                if contender == "mllib":
                    metric, fit_s = _mllib(workload, train, test, cols, y_te)
                else:
                    kwargs = config_kwargs(
                        contender, workload.task, seed, args.num_workers, landed, has_fs
                    )
                    run["config"] = {k: v for k, v in kwargs.items() if k != "progress"}
                    metric, fit_s = _ours(spark, workload, train, cols, x_te, y_te, kwargs)
                run.update(metric=metric, fit_s=fit_s)
            except Exception as exc:  # a diverged or failed fit is a figure
                run.update(metric=None, fit_s=None, error=f"{type(exc).__name__}: {exc}"[:300])
            print(
                f"{workload.name} seed {seed} {contender}: "
                + (f"{run['metric']:.4f} in {run['fit_s']:.1f} s" if run.get("metric")
                   is not None else run["error"]),
                flush=True,
            )  # fmt: skip
            runs.append(run)
        train.unpersist(), test.unpersist()
    entry["runs"] = runs
    entry["summary"] = summarise(runs)
    entry["shortfall"] = shortfall(entry["summary"])
    return entry


def main(args: argparse.Namespace) -> int:
    validate(args)
    from sparktrain.config import TrainConfig
    from sparktrain.session import get_or_create_session

    landed = defaults_landed(TrainConfig)
    has_fs = "feature_scaling" in {f.name for f in dataclasses.fields(TrainConfig)}
    master = args.master or f"local[{args.num_workers}]"
    spark = get_or_create_session(master, app_name="sparktrain-bench-defaults")
    report: dict[str, Any] = {
        "command": COMMAND,
        "master": master,
        "num_workers": args.num_workers,
        "seeds": list(args.seeds),
        "test_fraction": args.test_fraction,
        "defaults_landed": landed,
        "settings": settings_line(landed, has_fs),
        "load_before": _uptime(),
        "tree": tree_state(),
    }
    warm_up(spark, args.num_workers)
    report["workloads"] = [
        run_workload(spark, WORKLOADS[name], args, landed, has_fs) for name in args.datasets
    ]
    report["load_after"] = _uptime()
    print(table(report))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report written to {path}")
    return 0
