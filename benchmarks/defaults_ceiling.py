"""How far conventional training settings take the default model (issue 34.1's diabetes
gap): an emulation of ``bench defaults``' fits in plain torch, against a linear model.

    sparktrain bench defaults-ceiling --json docs/results/defaults_ceiling.json
    sparktrain bench defaults-ceiling --inits 5        # 5 init seeds per split, averaged

``bench defaults`` (benchmarks/defaults.py) finds sparktrain's defaults short of MLlib's
``LinearRegression`` on diabetes (R² 0.386 against 0.415). Is that the defaults' training
settings or the model? This bench answers without Spark, in one process on one thread:
it emulates the same fit in plain torch and tries a small set of conventional settings
on it, on the same data sets, splits and models as ``bench defaults``:

* the data: ``diabetes`` (R²), ``digits`` and ``breast_cancer`` (accuracy), as
  ``benchmarks.defaults.load`` returns them, split 75/25 by
  ``train_test_split(random_state=seed)`` (stratified for classification) for the seeds
  0, 1, 2; the models of ``benchmarks.defaults.WORKLOADS`` (``mlp(in_features=10,
  out_features=1)`` for diabetes, ``digits_mlp``, ``mlp(in_features=30, out_features=2)``);
* the scaling sparktrain's defaults apply (``feature_scaling`` and, for ``loss="mse"``,
  ``label_scaling``): features and labels standardised with the training rows' mean and
  population standard deviation (``stddev_pop``; a constant feature keeps scale 1), the
  predictions mapped back to label units before R²;
* the fit: ``torch.manual_seed(init seed)`` before the model is built, a reshuffle every
  epoch, mini-batches of 64 rows, standing for ``num_workers=2`` x ``batch_size=32`` with
  the two workers' gradients averaged (the emulation draws each batch from all the
  training rows, where each worker draws from its own partition, so its figures match
  the bench's closely, not exactly).

The candidates, each for 50 epochs at lr 1e-3: the shipped defaults (Adam); AdamW with
``weight_decay=0.1``; early stopping on the validation loss of a 10 % hold-out of the
training rows (patience 5 and 10, the best epoch's weights restored); a cosine decay of the
rate to 0 over all the steps (torch's ``CosineAnnealingLR``, stepped after every step). The
linear reference stands for MLlib's defaults: scikit-learn's ``LinearRegression`` (least
squares, as MLlib's ``LinearRegression`` with ``regParam=0``) or an unregularised
``LogisticRegression`` on standardised features. The *oracle* row is the defaults' best
test metric over epochs 1..50 of the same run, the epoch chosen with the test set: not a
setting anyone could ship, an upper bound on any stopping rule for these fits.

``--inits N`` fits each split with N init (and shuffle) seeds, ``seed + 100 k``, and
reports their mean per split (1: the split's own seed, as the bench seeds its config).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.defaults import (
    NEW_SETTINGS,
    WORKLOADS,
    Workload,
    _tree_line,
    _uptime,
    load,
    r2,
    tree_state,
)
from sparktrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

COMMAND = "sparktrain bench defaults-ceiling --json docs/results/defaults_ceiling.json"
DEFAULT_JSON = "docs/results/defaults_ceiling.json"
DATASETS = ("diabetes", "digits", "breast_cancer")
NUM_WORKERS = 2  # as bench defaults
BATCH_SIZE = 32  # TrainConfig's default, per worker
GLOBAL_BATCH = NUM_WORKERS * BATCH_SIZE
EPOCHS = int(NEW_SETTINGS["epochs"])
LR = float(NEW_SETTINGS["lr"])
HOLDOUT = 0.1  # early stopping's validation fraction of the training rows
INIT_STRIDE = 100  # init seeds of a split: seed, seed + 100, ...
SHUFFLE_OFFSET = 1000  # the shuffle generator's seed: init seed + 1000


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One set of training settings for the default model."""

    key: str
    title: str
    optimizer: str = "adam"  # "adam" | "adamw"
    weight_decay: float = 0.0
    cosine: bool = False  # CosineAnnealingLR to 0 over every step of the run
    patience: int | None = None  # early stopping on a HOLDOUT of the training rows


CANDIDATES: dict[str, Candidate] = {
    c.key: c
    for c in (
        Candidate("defaults", "shipped defaults: Adam, lr 1e-3, 50 epochs"),
        Candidate("adamw", "AdamW, weight_decay 0.1", optimizer="adamw", weight_decay=0.1),
        Candidate("early_stop_5", "early stopping, 10 % hold-out, patience 5", patience=5),
        Candidate("early_stop_10", "early stopping, 10 % hold-out, patience 10", patience=10),
        Candidate("cosine", "cosine decay to 0 (CosineAnnealingLR over all steps)", cosine=True),
    )
}
LINEAR_TITLE = "linear reference (OLS / unregularised logistic), MLlib's stand-in"
ORACLE_TITLE = "oracle: the defaults' best test epoch (chosen on the test set: a bound)"


# ---------------------------------------------------------------------- the pieces
def standardise(
    train: np.ndarray, *others: np.ndarray
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """``train`` and ``others`` standardised with ``train``'s mean and population standard
    deviation per column (sparktrain's ``stddev_pop``; a constant column keeps scale 1),
    and those figures."""
    train = np.asarray(train, dtype=np.float64)
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    scaled = [(np.asarray(a, dtype=np.float64) - mean) / std for a in (train, *others)]
    return scaled, mean, std


def split(
    workload: Workload, x: np.ndarray, y: np.ndarray, seed: int, test_fraction: float = 0.25
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, x_test, y_train, y_test)`` as ``bench defaults`` splits them."""
    from sklearn.model_selection import train_test_split

    stratify = y if workload.task == "classification" else None
    parts = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=stratify)
    x_tr, x_te, y_tr, y_te = (np.asarray(p) for p in parts)
    return x_tr, x_te, y_tr, y_te


def build_model(workload: Workload) -> torch.nn.Module:
    """The workload's model, built as sparktrain builds it from ``model_fn`` and keywords."""
    from sparktrain.builders import resolve_model_fn

    return resolve_model_fn(workload.model_fn, workload.model_kwargs)()


def build_optimizer(
    params: Any, candidate: Candidate, lr: float, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler | None]:
    """The candidate's optimizer, built as sparktrain builds ``optimizer`` with
    ``optimizer_kwargs``, and, for a cosine decay, its schedule over ``total_steps``
    optimizer steps (to 0 after the last)."""
    import torch

    from sparktrain import builders

    if candidate.optimizer not in ("adam", "adamw"):  # the candidates the table explains
        raise ConfigError(f"candidate {candidate.key!r}: unknown optimizer {candidate.optimizer}")
    kwargs = {"weight_decay": candidate.weight_decay}
    opt = builders.build_optimizer(candidate.optimizer, params, lr, kwargs)
    sched = None
    if candidate.cosine:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps, eta_min=0.0)
    return opt, sched


def holdout_indices(rows: int, seed: int) -> tuple[Any, Any]:
    """``(validation, training)`` row indices: a seeded HOLDOUT of ``rows`` (at least 1)."""
    import torch

    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(HOLDOUT * rows))
    return perm[:n_val], perm[n_val:]


def _score(
    workload: Workload, out: np.ndarray, y_test: np.ndarray, label: tuple[float, float]
) -> float:
    if workload.task == "classification":
        return float((out.argmax(axis=1) == y_test).mean())
    return r2(y_test, out.reshape(-1) * label[1] + label[0])


def fit(
    workload: Workload,
    data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    candidate: Candidate,
    split_seed: int,
    init_seed: int,
    epochs: int = EPOCHS,
    lr: float = LR,
    batch: int = GLOBAL_BATCH,
    curve: bool = False,
) -> dict[str, Any]:
    """One emulated fit: its test metric, the epoch it stopped after and, with ``curve``,
    the test metric after every epoch (of the trained weights, not the restored ones)."""
    import torch
    from torch import nn

    x_tr, x_te, y_tr, y_te = data
    regression = workload.task == "regression"
    (xs_tr, xs_te), _, _ = standardise(x_tr, x_te)
    label = (0.0, 1.0)
    if regression:
        (ys_tr,), mean, std = standardise(np.asarray(y_tr, dtype=np.float64).reshape(-1, 1))
        label = (float(mean[0]), float(std[0]))
        targets = torch.tensor(ys_tr.reshape(-1), dtype=torch.float32)
    else:
        targets = torch.tensor(np.asarray(y_tr), dtype=torch.long)
    inputs = torch.tensor(xs_tr, dtype=torch.float32)
    test_inputs = torch.tensor(xs_te, dtype=torch.float32)
    val: tuple[torch.Tensor, torch.Tensor] | None = None
    if candidate.patience is not None:
        val_idx, train_idx = holdout_indices(len(inputs), split_seed)
        val = (inputs[val_idx], targets[val_idx])
        inputs, targets = inputs[train_idx], targets[train_idx]
    shuffle = torch.Generator().manual_seed(SHUFFLE_OFFSET + init_seed)
    torch.manual_seed(init_seed)
    model = build_model(workload)
    loss_fn: nn.Module = nn.MSELoss() if regression else nn.CrossEntropyLoss()

    def loss_of(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out = model(x)
        loss: torch.Tensor = loss_fn(out.squeeze(-1) if regression else out, t)
        return loss

    def test_metric() -> float:
        model.eval()
        with torch.no_grad():
            out = model(test_inputs).double().numpy()
        model.train()
        return _score(workload, out, y_te, label)

    steps = math.ceil(len(inputs) / batch)
    opt, sched = build_optimizer(model.parameters(), candidate, lr, epochs * steps)
    best, best_state, bad, stopped = math.inf, None, 0, epochs
    history: list[float] = []
    model.train()
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(inputs), generator=shuffle)
        for start in range(0, len(inputs), batch):
            idx = order[start : start + batch]
            loss = loss_of(inputs[idx], targets[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
        if curve:
            history.append(test_metric())
        if val is not None and candidate.patience is not None:
            model.eval()
            with torch.no_grad():
                v = float(loss_of(*val))
            model.train()
            if v < best:
                best, best_state, bad = v, copy.deepcopy(model.state_dict()), 0
            else:
                bad += 1
                if bad >= candidate.patience:
                    stopped = epoch
                    break
    if best_state is not None:
        model.load_state_dict(best_state)
    result: dict[str, Any] = {"metric": test_metric(), "stopped": stopped}
    if curve:
        result["curve"] = history
    return result


def linear_reference(
    workload: Workload, data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
) -> float:
    """MLlib's defaults' stand-in: least squares (R²) or unregularised logistic regression
    on standardised features (accuracy)."""
    from sklearn.linear_model import LinearRegression, LogisticRegression

    x_tr, x_te, y_tr, y_te = data
    (a, b), _, _ = standardise(x_tr, x_te)
    if workload.task == "regression":
        return r2(y_te, LinearRegression().fit(a, y_tr).predict(b))
    model = LogisticRegression(C=math.inf, max_iter=10_000).fit(a, y_tr)
    return float(model.score(b, y_te))


# ---------------------------------------------------------------------- the run
def run_dataset(
    name: str, seeds: Sequence[int], inits: int, test_fraction: float
) -> dict[str, Any]:
    workload = WORKLOADS[name]
    x, y = load(workload)
    entry: dict[str, Any] = {
        "name": name,
        "metric": workload.metric,
        "model": workload.model_call,
        "shape": f"{x.shape[0]:,} × {x.shape[1]}",
        "linear": {"splits": []},
        "oracle": {"splits": [], "epochs": []},
        "candidates": {key: {"splits": [], "runs": []} for key in CANDIDATES},
    }
    for seed in seeds:
        data = split(workload, x, y, seed, test_fraction)
        entry["linear"]["splits"].append(linear_reference(workload, data))
        best: list[float] = []
        best_epochs: list[int] = []
        for key, candidate in CANDIDATES.items():
            metrics = []
            for k in range(inits):
                init = seed + INIT_STRIDE * k
                out = fit(workload, data, candidate, seed, init, curve=key == "defaults")
                metrics.append(out["metric"])
                mine = entry["candidates"][key]
                mine["runs"].append(
                    {"seed": seed, "init": init, "metric": out["metric"], "stopped": out["stopped"]}
                )
                if "curve" in out:
                    best.append(max(out["curve"]))
                    best_epochs.append(int(np.argmax(out["curve"])) + 1)
            entry["candidates"][key]["splits"].append(statistics.fmean(metrics))
            print(f"{name} split {seed} {key}: {statistics.fmean(metrics):.4f}", flush=True)
        entry["oracle"]["splits"].append(statistics.fmean(best))
        entry["oracle"]["epochs"].append(best_epochs)
    return entry


def machine() -> dict[str, Any]:
    """What the figures ran on: CPUs, platform and the versions they depend on."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **{name: installed(name) for name in ("torch", "numpy", "scikit-learn")},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": COMMAND,
        "seeds": list(args.seeds),
        "inits": args.inits,
        "test_fraction": args.test_fraction,
        "emulation": {
            "num_workers": NUM_WORKERS,
            "batch_size": BATCH_SIZE,
            "global_batch": GLOBAL_BATCH,
            "epochs": EPOCHS,
            "lr": LR,
            "holdout": HOLDOUT,
            "torch_threads": torch.get_num_threads(),
        },
        "candidates": [{"key": c.key, "title": c.title} for c in CANDIDATES.values()],
        "machine": machine(),
        "load_before": _uptime(),
        "tree": tree_state(),
    }
    report["datasets"] = [
        run_dataset(name, args.seeds, args.inits, args.test_fraction) for name in args.datasets
    ]
    report["load_after"] = _uptime()
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


# ---------------------------------------------------------------------- the table
def _cells(splits: Sequence[float]) -> str:
    return f"{' / '.join(f'{v:.3f}' for v in splits)} | {statistics.fmean(splits):.3f}"


def table(data: dict[str, Any]) -> str:
    """The results page's table: one row per candidate, per split and mean per data set."""
    datasets = data["datasets"]
    em = data["emulation"]
    inits = data["inits"]
    lines = [
        f"Splits {', '.join(str(s) for s in data['seeds'])} "
        f"({1 - data['test_fraction']:.0%}/{data['test_fraction']:.0%}); "
        f"{inits} init seed{'s' if inits > 1 else ''} per split"
        + (" (per split: their mean)" if inits > 1 else "")
        + f"; plain torch, one process, {em['torch_threads']} thread, global batch "
        f"{em['global_batch']} ({em['num_workers']} workers × {em['batch_size']}), "
        f"lr {em['lr']:g}, {em['epochs']} epochs; {data['seconds']:.0f} s in all; machine "
        f"load (`uptime`) before: {data['load_before']}; after: {data['load_after']}."
        + _tree_line(data.get("tree")),
        "",
        "| candidate | "
        + " | ".join(f"{d['name']} {d['metric']} per split | mean" for d in datasets)
        + " | epochs run (early stopping) or best epoch (oracle) |",
        "|---|" + "---|---:|" * len(datasets) + "---|",
    ]

    def row(title: str, per_set: list[Sequence[float]], note: str = "") -> str:
        return f"| {title} | " + " | ".join(_cells(s) for s in per_set) + f" | {note} |"

    lines.append(row(LINEAR_TITLE, [d["linear"]["splits"] for d in datasets]))
    for c in data["candidates"]:
        note = ""
        if c["key"].startswith("early_stop"):
            note = "; ".join(
                f"{d['name']} "
                + ",".join(str(r["stopped"]) for r in d["candidates"][c["key"]]["runs"])
                for d in datasets
            )
        lines.append(row(c["title"], [d["candidates"][c["key"]]["splits"] for d in datasets], note))
    epochs = "; ".join(
        f"{d['name']} best at " + ",".join(str(e) for per in d["oracle"]["epochs"] for e in per)
        for d in datasets
    )
    lines.append(row(ORACLE_TITLE, [d["oracle"]["splits"] for d in datasets], epochs))
    return "\n".join(lines)


# ---------------------------------------------------------------------- entry
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--datasets", nargs="+", choices=DATASETS, default=list(DATASETS), metavar="NAME",
        help=f"data sets (default all: {', '.join(DATASETS)})",
    )  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="split seeds")
    parser.add_argument(
        "--inits", type=int, default=1,
        help="init seeds per split (seed, seed+100, ...; default 1: the split's seed)",
    )  # fmt: skip
    parser.add_argument("--test-fraction", type=float, default=0.25)
    parser.add_argument(
        "--json", metavar="PATH", default=DEFAULT_JSON, help=f"write here (default {DEFAULT_JSON})"
    )


def validate(args: argparse.Namespace) -> None:
    if args.inits < 1:
        raise ConfigError("--inits must be at least 1")
    if not args.seeds:
        raise ConfigError("--seeds needs at least one seed")
    if not 0 < args.test_fraction < 1:
        raise ConfigError("--test-fraction must be between 0 and 1")


def main(args: argparse.Namespace) -> int:
    validate(args)
    report = run(args)
    print(table(report))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"report written to {path}")
    return 0
