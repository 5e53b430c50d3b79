"""Sparse embeddings (issue 20): a two-tower recommender with a 1M x 64 item table on
synthetic Zipf(1.1) click data, trained in one run by the dense ring, the sparse ring,
the sparse parameter server and DDP under pyspark's ``TorchDistributor`` (dense, and
with ``sparse=True`` embeddings, which Gloo allreduces as sparse tensors).

    sparktrain bench sparse --json docs/results/bench_sparse.json
    sparktrain bench sparse --table 20000 --users 2000 --steps 12 --warmup 2 \\
        --contenders dense-ring ddp                            # small, quick

Contenders (the same model, :func:`sparktrain.models.two_tower`, the same data, plain
SGD at ``--lr``, ``--batch`` rows per worker per step, ``--workers`` workers):

* ``dense-ring``: the model built with ``sparse=False``, ``strategy="ring"``: the whole
  table's gradient crosses the ring every step;
* ``sparse-ring``: ``sparse=True``, ``strategy="ring"``, ``sparse_embeddings="auto"``;
* ``sparse-ring+fp16``, ``sparse-ring+int8-ef``, ``sparse-ring+int8row-ef`` (issue
  21): the sparse ring with the tables' rows compressed (``compression`` a policy
  ``{"*.weight" = spec, "*" = "none"}``: ``fp16``, ``int8+ef`` with a scale per 1024
  values, ``int8:chunk=<dim>+ef`` with a scale per row; docs/sparse.md); ``derived``
  compares each with the uncompressed sparse ring of the same run (wire bytes, step
  time, final loss, time to the target loss). Row ids are delta-coded in every
  sparse-ring contender;
* ``sparse-ps``: ``sparse=True``, ``strategy="ps"``, ``sparse_embeddings="auto"``;
* ``ddp``, ``ddp-sparse``: ``DistributedDataParallel`` over Gloo in
  ``TorchDistributor(local_mode=True, num_processes=--workers, use_gpu=False)``, with
  ``sparse=False`` and ``sparse=True`` tables.

sparktrain's contenders run through :func:`sparktrain.run` with :func:`sparktrain_steps`
as the training function, so that the loss and the time of every step are recorded
(the built-in loop reports per epoch). Every contender takes ``--steps`` steps on
``--batch`` rows of its rank's part of the same click data and records, per step, the
batch loss averaged over the ranks and the step's wall time on rank 0 (batch, forward,
backward, exchange, optimizer step). A contender that fails is recorded with its error
and the bench goes on.

Figures per run: ``step_s`` (median step time after the first ``--warmup`` steps),
``wire_bytes_per_step`` (sparktrain: the summary's ``wire_bytes``, every byte its sockets
wrote, all ranks, over the steps; DDP: the bytes its processes wrote during the steps,
``/proc/self/io``'s ``wchar``, which counts Gloo's ``writev`` to its sockets (see
:func:`written_bytes`), all ranks; where that file is missing, an estimate:
``2 (N-1)`` times the parameters' bytes per step for a dense ring allreduce, and for
sparse tables each rank's distinct touched rows (8-byte index plus the row) sent to the
``N-1`` others, as Gloo's sparse allreduce gathers them; the estimate is kept beside the
measurement either way), the loss curve, and the time
from the first step until the loss, smoothed over ``--smooth`` steps, first reached the
target. The target is ``--target-loss`` or, by default, the highest of the contenders'
final smoothed losses (medians over runs): a loss every contender reached.

Runs are interleaved: ``--repeats`` rounds per seed in ``--seeds``, each round every
contender once, the order rotated each round. ``derived`` holds dense-ring/sparse step
time and wire bytes ratios (targets >= 20 and >= 100), the gap between each sparse
contender's loss curve and the dense ring's against the gap between the dense ring's own
seeds (the seed noise), and time to the target loss against DDP's best configuration.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.plots import pyplot, save_figure
from benchmarks.torchdist import rank0_everywhere, run_local
from sparktrain.errors import ConfigError

# the sparse ring with its rows compressed (issue 21): the tables' values through the
# named compressor (a policy over the tables only: the dense bias stays exact), the row
# ids delta-coded in every sparse-ring contender
COMPRESSED = {
    "sparse-ring+fp16": "fp16",
    "sparse-ring+int8-ef": "int8+ef",  # one scale per 1024 values (16 rows of 64)
    "sparse-ring+int8row-ef": "int8:chunk={dim}+ef",  # one scale per row
}
CONTENDERS = ("dense-ring", "sparse-ring", *COMPRESSED, "sparse-ps", "ddp", "ddp-sparse")
SPARKTRAIN = ("dense-ring", "sparse-ring", *COMPRESSED, "sparse-ps")
UNCOMPRESSED = "sparse-ring"
DDP = ("ddp", "ddp-sparse")
BASELINE = "dense-ring"
STEP_TARGET = 20.0  # dense-ring step time / sparse step time, at least
BYTES_TARGET = 100.0  # dense-ring wire bytes / sparse wire bytes, at least
INDEX_BYTES = 8  # an int64 row index on Gloo's sparse allreduce


def contender_keys(name: str, dim: int = 64) -> tuple[bool, dict[str, Any]]:
    """(whether the model's tables are ``sparse=True``, TrainConfig keys) of a
    contender (``dim``: the tables' width, for a row-wise scale); DDP's keys are empty."""
    if name in COMPRESSED:
        spec = COMPRESSED[name].format(dim=dim)
        policy = {"*.weight": spec, "*": "none"}
        return True, {"strategy": "ring", "sparse_embeddings": "auto", "compression": policy}
    table: dict[str, tuple[bool, dict[str, Any]]] = {
        "dense-ring": (False, {"strategy": "ring", "sparse_embeddings": "off"}),
        "sparse-ring": (True, {"strategy": "ring", "sparse_embeddings": "auto"}),
        "sparse-ps": (True, {"strategy": "ps", "sparse_embeddings": "auto"}),
        "ddp": (False, {}),
        "ddp-sparse": (True, {}),
    }
    if name not in table:
        raise ConfigError(f"unknown contender {name!r}; use {', '.join(CONTENDERS)}")
    return table[name]


# ---------------------------------------------------------------------- the workers
def _model(spec: dict[str, Any], sparse: bool) -> Any:
    from sparktrain.models import two_tower

    return two_tower(spec["users"], spec["table"], spec["dim"], sparse)


def sparktrain_steps(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """The training function of sparktrain's contenders (``functools.partial(
    sparktrain_steps, spec)`` for :func:`sparktrain.run`): ``spec["steps"]`` steps of
    ``bce_with_logits`` with the config's optimizer; returns the ranks' mean loss per
    step and rank 0's step times."""
    import torch

    from sparktrain.builders import build_optimizer
    from sparktrain.data.batch import forward

    cfg = ctx.config
    torch.manual_seed(cfg.seed)  # every rank the same weights: no broadcast needed
    model = _model(spec, spec["sparse"])
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.lr, cfg.optimizer_kwargs)
    model, optimizer = ctx.distributed(model, optimizer)
    steps = int(spec["steps"])
    losses: list[float] = []
    times: list[float] = []
    epochs = math.ceil(steps / max(1, ctx.steps_per_epoch))  # bounded: the data run out
    batches = (b for epoch in range(epochs) for b in ctx.batches(epoch))
    for _ in range(steps):
        started = time.perf_counter()
        batch = next(batches)
        out = forward(model, batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out, batch.y.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # .item() syncs; the step is done anyway
        times.append(time.perf_counter() - started)
    curve = ctx.allreduce(torch.tensor(losses, dtype=torch.float64), op="mean")
    return {"loss": curve.tolist(), "step_times_s": times}


def ddp_steps(spec: dict[str, Any]) -> dict[str, Any]:
    """The DDP training function TorchDistributor runs in each process: the same model,
    data (every ``world``-th row, in order) and optimizer; returns rank 0's step times,
    the ranks' mean loss per step and the estimated bytes per step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparktrain import datasets

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # as sparktrain's tasks on local[N]
    data = datasets.clicks(spec["rows"], spec["users"], spec["table"], seed=spec["data_seed"])
    user = torch.from_numpy(data.user[rank::world])
    item = torch.from_numpy(data.item[rank::world])
    label = torch.from_numpy(data.label[rank::world])
    torch.manual_seed(spec["seed"])
    module = _model(spec, spec["sparse"])
    model = DistributedDataParallel(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    batch, steps = int(spec["batch"]), int(spec["steps"])
    if len(user) < batch * steps:
        raise ConfigError(f"rank {rank} holds {len(user)} rows, fewer than {batch * steps}")
    losses: list[float] = []
    times: list[float] = []
    touched: list[int] = []  # distinct rows times their row width, every table, this rank
    written = written_bytes()
    for step in range(steps):
        started = time.perf_counter()
        rows = slice(step * batch, (step + 1) * batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(user[rows], item[rows]), label[rows]
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - started)
        if spec["sparse"]:
            n_users = len(torch.unique(user[rows]))
            n_items = len(torch.unique(item[rows]))
            # per distinct id: its row of the dim-wide table and of the bias table,
            # each with its own index
            touched.append((n_users + n_items) * (2 * INDEX_BYTES + 4 * (spec["dim"] + 1)))
    after = written_bytes()
    # this rank's bytes written during the steps (Gloo's sockets; nothing else writes)
    sent = torch.tensor(
        [after - written if after is not None and written is not None else -1.0],
        dtype=torch.float64,
    )
    curve = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(curve)
    dist.all_reduce(sent)
    curve /= world
    dense_bytes = sum(
        p.numel() * p.element_size()
        for m in module.modules()
        for p in m.parameters(recurse=False)
        if not (spec["sparse"] and isinstance(m, torch.nn.Embedding))
    )
    # each rank's distinct rows go to the N-1 others (Gloo's sparse allreduce is an
    # allgather of the coalesced rows); dense parameters: a ring, 2(N-1)/N per rank
    sparse_sent = torch.tensor(touched or [0] * steps, dtype=torch.float64) * (world - 1)
    dist.all_reduce(sparse_sent)
    per_step = sparse_sent + 2.0 * (world - 1) * dense_bytes
    record = {
        "loss": curve.tolist(),
        "step_times_s": times,
        "wire_bytes_per_step_each": per_step.tolist(),
        # a rank without /proc/self/io makes the sum negative: not measured
        "written_bytes_per_step": float(sent) / steps if float(sent) >= 0 else None,
    }
    out: dict[str, Any] = rank0_everywhere(record)
    return out


# ---------------------------------------------------------------------- one run
def run_sparktrain(
    spark: Any, frame: Any, spec: dict[str, Any], name: str, seed: int
) -> dict[str, Any]:
    """One sparktrain contender: :func:`sparktrain.run` of :func:`sparktrain_steps`."""
    import sparktrain
    from sparktrain import TrainConfig

    sparse, keys = contender_keys(name, spec["dim"])
    cfg = TrainConfig(
        num_workers=spec["workers"],
        batch_size=spec["batch"],
        lr=spec["lr"],
        optimizer="sgd",
        seed=seed,
        epochs=1,
        progress=False,
        comm_timeout=300.0,
        **keys,
    )
    started = time.perf_counter()
    result = sparktrain.run(
        functools.partial(sparktrain_steps, {**spec, "sparse": sparse}),
        frame,
        columns={"user": "user", "item": "item"},
        label_col="label",
        config=cfg,
        spark=spark,
    )
    call_s = time.perf_counter() - started
    steps = spec["steps"]
    return {
        "loss": result.value["loss"],
        "step_times_s": result.value["step_times_s"],
        "wire_bytes_per_step": result.summary["wire_bytes"] / steps,
        "raw_bytes_per_step": result.summary["bytes_sent"] / steps,
        "wire_bytes_source": "measured: summary wire_bytes (all ranks, whole stage) / steps",
        "call_s": call_s,
        "sparse_rows_ratio": result.summary.get("sparse_rows_ratio"),
    }


def run_ddp(spec: dict[str, Any], name: str, seed: int) -> dict[str, Any]:
    """One DDP contender under TorchDistributor."""
    sparse, _ = contender_keys(name)
    started = time.perf_counter()
    out = run_local(ddp_steps, {**spec, "sparse": sparse, "seed": seed}, workers=spec["workers"])
    call_s = time.perf_counter() - started
    estimate = statistics.fmean(out["wire_bytes_per_step_each"])
    measured = out.get("written_bytes_per_step")
    return {
        "loss": out["loss"],
        "step_times_s": out["step_times_s"],
        "wire_bytes_per_step": measured if measured is not None else estimate,
        "wire_bytes_estimated_per_step": estimate,
        "raw_bytes_per_step": None,
        "wire_bytes_source": "measured: bytes the DDP processes wrote during the steps "
        "(/proc/self/io wchar: Gloo writes its sockets with writev)"
        if measured is not None
        else "estimated from the parameters' sizes and the distinct rows touched",
        "call_s": call_s,
    }


def written_bytes() -> float | None:
    """Bytes this process has passed to write()/writev() so far (``wchar`` of
    ``/proc/self/io``), or None where the file is missing. Gloo's TCP transport writes
    its sockets with ``writev``, which the kernel counts there (``send``/``sendmsg``,
    which sparktrain's sockets use, it does not), so over the training steps of a DDP
    process, which writes no file meanwhile, the delta is Gloo's bytes sent."""
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key == "wchar":
                    return float(value)
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------- figures
def rounds(
    contenders: tuple[str, ...], seeds: list[int], repeats: int
) -> Iterator[tuple[str, int]]:
    """The runs' order: per seed, ``repeats`` rounds of every contender, rotated by one
    each round (over all rounds), so no contender always runs first."""
    n, r = len(contenders), 0
    for seed in seeds:
        for _ in range(repeats):
            for i in range(n):
                yield contenders[(r + i) % n], seed
            r += 1


def smooth(curve: list[float], window: int) -> list[float]:
    """The trailing mean over ``window`` steps (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(curve):
        total += v
        if i >= window:
            total -= curve[i - window]
        out.append(total / min(i + 1, window))
    return out


def time_to_loss(
    curve: list[float], times: list[float], target: float, window: int
) -> float | None:
    """Seconds from the first step's start until the end of the first step whose
    smoothed loss is at most ``target``; None when none is."""
    elapsed = 0.0
    for loss, t in zip(smooth(curve, window), times, strict=True):
        elapsed += t
        if loss <= target:
            return elapsed
    return None


def measure(record: dict[str, Any], warmup: int) -> dict[str, Any]:
    """A run's step time: the median after the first ``warmup`` steps."""
    times = record["step_times_s"]
    steady = times[warmup:] or times
    return {"step_s": statistics.median(steady)}


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ok(runs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in runs if r["contender"] == name and "error" not in r]


def median_curve(runs: list[dict[str, Any]]) -> list[float]:
    """The step-by-step median of the runs' loss curves (the shortest's length)."""
    if not runs:
        return []
    n = min(len(r["loss"]) for r in runs)
    return [statistics.median(r["loss"][i] for r in runs) for i in range(n)]


def curve_gap(a: list[float], b: list[float], window: int) -> float | None:
    """The mean absolute difference of two smoothed loss curves, step by step."""
    n = min(len(a), len(b))
    if n == 0:
        return None
    sa, sb = smooth(a[:n], window), smooth(b[:n], window)
    return statistics.fmean(abs(x - y) for x, y in zip(sa, sb, strict=True))


def seed_noise(runs: list[dict[str, Any]], window: int) -> float | None:
    """The curve gap between the baseline's runs of different seeds (medians per seed):
    the mean over seed pairs; None with fewer than two seeds."""
    by_seed: dict[int, list[dict[str, Any]]] = {}
    for r in _ok(runs, BASELINE):
        by_seed.setdefault(r["seed"], []).append(r)
    curves = [median_curve(v) for _, v in sorted(by_seed.items())]
    gaps = [
        curve_gap(curves[i], curves[j], window)
        for i in range(len(curves))
        for j in range(i + 1, len(curves))
    ]
    return _median(gaps)


def target_loss(runs: list[dict[str, Any]], window: int, given: float | None) -> float | None:
    """``given``, or the highest final smoothed loss of the contenders' median curves: a
    loss every contender that ran reached."""
    if given is not None:
        return given
    finals = []
    for name in {r["contender"] for r in runs}:
        curve = median_curve(_ok(runs, name))
        if curve:
            finals.append(smooth(curve, window)[-1])
    return max(finals) if finals else None


def derive(runs: list[dict[str, Any]], window: int, given_target: float | None) -> dict[str, Any]:
    """Per contender medians and the issue's ratios; fills each run's
    ``time_to_loss_s`` against the common target."""
    target = target_loss(runs, window, given_target)
    for r in runs:
        if "error" not in r:
            r["time_to_loss_s"] = (
                time_to_loss(r["loss"], r["step_times_s"], target, window)
                if target is not None
                else None
            )
    names = list(dict.fromkeys(r["contender"] for r in runs))
    per: dict[str, dict[str, Any]] = {}
    for name in names:
        ok = _ok(runs, name)
        errors = [r["error"] for r in runs if r["contender"] == name and "error" in r]
        curve = median_curve(ok)
        per[name] = {
            "runs": len(ok),
            "errors": len(errors),
            "first_error": errors[0] if errors else None,
            "step_s": _median([r["step_s"] for r in ok]),
            "wire_bytes_per_step": _median([r["wire_bytes_per_step"] for r in ok]),
            "wire_bytes_source": ok[0]["wire_bytes_source"] if ok else None,
            "time_to_loss_s": _median([r["time_to_loss_s"] for r in ok]),
            "reached": sum(r["time_to_loss_s"] is not None for r in ok),
            "final_loss": smooth(curve, window)[-1] if curve else None,
            "call_s": _median([r["call_s"] for r in ok]),
            "sparse_rows_ratio": _median([r.get("sparse_rows_ratio") for r in ok]),
        }
    base = per.get(BASELINE, {})
    base_curve = median_curve(_ok(runs, BASELINE))
    ddp_best_name = min(
        (n for n in DDP if per.get(n, {}).get("time_to_loss_s") is not None),
        key=lambda n: per[n]["time_to_loss_s"],
        default=None,
    )
    ddp_best = per[ddp_best_name]["time_to_loss_s"] if ddp_best_name else None
    noise = seed_noise(runs, window)
    ratios: dict[str, dict[str, Any]] = {}
    for name in names:
        if name == BASELINE:
            continue
        step = _ratio(base.get("step_s"), per[name]["step_s"])
        wire = _ratio(base.get("wire_bytes_per_step"), per[name]["wire_bytes_per_step"])
        gap = curve_gap(median_curve(_ok(runs, name)), base_curve, window)
        vs_ddp = _ratio(per[name]["time_to_loss_s"], ddp_best)
        ratios[name] = {
            "step_speedup_vs_dense_ring": step,
            "step_met": step is not None and step >= STEP_TARGET,
            "wire_bytes_reduction_vs_dense_ring": wire,
            "bytes_met": wire is not None and wire >= BYTES_TARGET,
            "curve_gap_vs_dense_ring": gap,
            "curve_within_seed_noise": (
                gap <= noise if gap is not None and noise is not None else None
            ),
            "time_to_loss_vs_ddp_best": vs_ddp,
            "ddp_met": (vs_ddp is not None and vs_ddp < 1.0) if name in SPARKTRAIN else None,
        }
        if name in COMPRESSED:
            ratios[name].update(vs_uncompressed(per, name))
    return {
        "target_loss": target,
        "seed_noise": noise,
        "ddp_best": ddp_best_name,
        "ddp_best_time_to_loss_s": ddp_best,
        "contenders": per,
        "ratios": ratios,
    }


def vs_uncompressed(per: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """A compressed sparse-ring contender against the uncompressed sparse ring of the
    same run: wire bytes (uncompressed / compressed), step time (compressed /
    uncompressed), final smoothed loss (compressed - uncompressed) and time to the
    common target loss (compressed / uncompressed)."""
    base, c = per.get(UNCOMPRESSED, {}), per[name]
    gap = (
        c["final_loss"] - base["final_loss"]
        if c.get("final_loss") is not None and base.get("final_loss") is not None
        else None
    )
    return {
        "wire_bytes_reduction_vs_sparse_ring": _ratio(
            base.get("wire_bytes_per_step"), c["wire_bytes_per_step"]
        ),
        "step_time_vs_sparse_ring": _ratio(c["step_s"], base.get("step_s")),
        "final_loss_gap_vs_sparse_ring": gap,
        "time_to_loss_vs_sparse_ring": _ratio(c["time_to_loss_s"], base.get("time_to_loss_s")),
    }


# ---------------------------------------------------------------------- output
def _fmt(value: Any, pattern: str, missing: str = "-") -> str:
    return missing if value is None else pattern.format(value)


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} B"


def table(report: dict[str, Any]) -> str:
    """The results page's table: one row per contender (medians), then the ratios."""
    s, d = report["spec"], report["derived"]
    lines = [
        f"Two-tower recommender, {s['table']:,} x {s['dim']} item table and "
        f"{s['users']:,} x {s['dim']} user table (plus bias tables), Zipf({s['zipf']}) ids, "
        f"batch {s['batch']} per worker, {s['workers']} workers, SGD lr {s['lr']}, "
        f"{s['steps']} steps (step time: median after {s['warmup']}), seeds "
        f"{report['seeds']} x {report['repeats']} interleaved repeats; load average "
        f"{report['load_before']} before, {report['load_after']} after; target loss "
        f"{_fmt(d['target_loss'], '{:.4f}')} (smoothed over {s['smooth']} steps).",
        "",
        "| contender | runs | step time | wire bytes / step | time to target loss "
        "| final loss | whole call |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in d["contenders"].items():
        if not c["runs"]:
            lines.append(f"| {name} | 0 ({c['errors']} failed) | error | - | - | - | - |")
            continue
        est = " (est.)" if (c["wire_bytes_source"] or "").startswith("estimated") else ""
        failed = f" ({c['errors']} failed)" if c["errors"] else ""
        lines.append(
            f"| {name} | {c['runs']}{failed} | {c['step_s'] * 1e3:.1f} ms "
            f"| {_bytes(c['wire_bytes_per_step'])}{est} "
            f"| {_fmt(c['time_to_loss_s'], '{:.2f} s', 'not reached')} "
            f"| {_fmt(c['final_loss'], '{:.4f}')} | {c['call_s']:.1f} s |"
        )
    lines.append("")
    for name, r in d["ratios"].items():
        parts = [
            f"step time dense-ring/{name} {_fmt(r['step_speedup_vs_dense_ring'], '{:.2f}')}",
            f"wire bytes {_fmt(r['wire_bytes_reduction_vs_dense_ring'], '{:.1f}')}",
            f"loss curve gap {_fmt(r['curve_gap_vs_dense_ring'], '{:.4f}')}",
            f"time to loss / DDP best {_fmt(r['time_to_loss_vs_ddp_best'], '{:.2f}')}",
        ]
        if name in COMPRESSED:
            parts += [
                f"vs sparse-ring: wire bytes "
                f"{_fmt(r.get('wire_bytes_reduction_vs_sparse_ring'), '{:.2f}')}x fewer",
                f"step time {_fmt(r.get('step_time_vs_sparse_ring'), '{:.2f}')}x",
                f"final loss {_fmt(r.get('final_loss_gap_vs_sparse_ring'), '{:+.4f}')}",
                f"time to loss {_fmt(r.get('time_to_loss_vs_sparse_ring'), '{:.2f}')}x",
            ]
        lines.append(f"- {name}: " + ", ".join(parts))
    lines.append(
        f"- seed noise (dense ring's curves between seeds): {_fmt(d['seed_noise'], '{:.4f}')}; "
        f"DDP's best: {d['ddp_best'] or '-'}; goals: step time >= {STEP_TARGET:.0f}x, "
        f"wire bytes >= {BYTES_TARGET:.0f}x fewer, curve gap within seed noise, time to "
        "loss below DDP's best."
    )
    errors = {n: c["first_error"] for n, c in d["contenders"].items() if c["first_error"]}
    for name, err in errors.items():
        lines.append(f"- {name} failed: `{err[:300]}`")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Loss curves by step (medians per contender, smoothed), step time and wire bytes
    bars (log scales)."""
    plt = pyplot()

    runs, d = report["runs"], report["derived"]
    window = report["spec"]["smooth"]
    fig, (left, right, wire) = plt.subplots(1, 3, figsize=(15, 4))
    for name in d["contenders"]:
        curve = median_curve(_ok(runs, name))
        if curve:
            left.plot(range(1, len(curve) + 1), smooth(curve, window), label=name)
    if d["target_loss"] is not None:
        left.axhline(d["target_loss"], color="grey", linestyle=":", label="target")
    left.set_xlabel("step")
    left.set_ylabel(f"training loss (BCE, mean of {window} steps)")
    left.legend(fontsize=8)
    bars = [(n, c["step_s"]) for n, c in d["contenders"].items() if c["step_s"] is not None]
    right.barh([b[0] for b in bars], [b[1] * 1e3 for b in bars], color="tab:blue")
    right.set_xscale("log")
    right.set_xlabel("median step time, ms (log)")
    right.invert_yaxis()
    sent = [
        (n + (" (est.)" if (c["wire_bytes_source"] or "").startswith("estimated") else ""),
         c["wire_bytes_per_step"])
        for n, c in d["contenders"].items()
        if c["wire_bytes_per_step"] is not None
    ]  # fmt: skip
    wire.barh([b[0] for b in sent], [b[1] / 1e6 for b in sent], color="tab:orange")
    wire.set_xscale("log")
    wire.set_xlabel("wire bytes per step, MB, both ranks (log)")
    wire.invert_yaxis()
    save_figure(fig, path)


# ---------------------------------------------------------------------- entry
def validate(args: argparse.Namespace) -> None:
    """Refuse arguments the bench cannot measure with."""
    for name in ("table", "users", "dim", "batch", "workers", "repeats", "smooth"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1")
    if args.steps <= args.warmup or args.warmup < 0:
        raise ConfigError(
            f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) and --warmup be >= 0: "
            "the step time is the median of the steps after the warm-up"
        )
    if args.lr <= 0 or args.zipf <= 0:
        raise ConfigError("--lr and --zipf must be positive")
    if not args.seeds:
        raise ConfigError("--seeds needs at least one seed")
    for name in args.contenders:
        contender_keys(name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--contenders", nargs="+", default=list(CONTENDERS), help=f"of {', '.join(CONTENDERS)}"
    )
    parser.add_argument("--table", type=int, default=1_000_000, help="item table rows")
    parser.add_argument("--users", type=int, default=100_000, help="user table rows")
    parser.add_argument("--dim", type=int, default=64, help="embedding width")
    parser.add_argument("--zipf", type=float, default=1.1, help="the ids' Zipf exponent")
    parser.add_argument("--batch", type=int, default=512, help="rows per worker per step")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of step time")
    parser.add_argument("--lr", type=float, default=3.0, help="SGD learning rate")
    parser.add_argument("--smooth", type=int, default=5, help="loss smoothing window (steps)")
    parser.add_argument("--target-loss", type=float, help="default: highest final loss")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds per seed")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default="docs/results/bench_sparse.json")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument(
        "--rederive",
        action="store_true",
        help="run nothing: recompute derived figures, table and plot of the --json file",
    )


def _load() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]


def write(report: dict[str, Any], path: Path, with_plot: bool) -> None:
    """Print the table, write the JSON and (``with_plot``) the PNG beside it."""
    print(table(report))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    if with_plot:
        plot(report, path.with_suffix(".png"))


def rederive(path: Path, given_target: float | None, with_plot: bool) -> None:
    """Recompute a written report's derived figures from its runs, and rewrite it."""
    if not path.exists():
        raise ConfigError(f"--rederive reads {path}, which does not exist: run the bench")
    report: dict[str, Any] = json.loads(path.read_text())
    report["derived"] = derive(report["runs"], report["spec"]["smooth"], given_target)
    write(report, path, with_plot)


def main(args: argparse.Namespace) -> int:
    validate(args)
    path = Path(args.json)
    if args.rederive:
        rederive(path, args.target_loss, not args.no_plot)
        return 0
    from sparktrain import datasets
    from sparktrain.session import get_or_create_session

    started = time.perf_counter()
    load_before = _load()
    spec: dict[str, Any] = {
        "table": args.table,
        "users": args.users,
        "dim": args.dim,
        "zipf": args.zipf,
        "batch": args.batch,
        "workers": args.workers,
        "steps": args.steps,
        "warmup": args.warmup,
        "lr": args.lr,
        "smooth": args.smooth,
        "data_seed": args.data_seed,
        # one step of every rank's rows per step, plus a batch of slack per rank so an
        # uneven split still leaves every rank its steps
        "rows": args.workers * args.batch * (args.steps + 1),
    }
    spark = get_or_create_session(f"local[{args.workers}]", app_name="sparktrain-bench-sparse")
    data = datasets.clicks(spec["rows"], args.users, args.table, args.zipf, args.data_seed)
    frame = datasets.clicks_dataframe(spark, data, args.workers).cache()
    frame.count()
    contenders = tuple(args.contenders)
    runs: list[dict[str, Any]] = []
    for name, seed in rounds(contenders, args.seeds, args.repeats):
        record: dict[str, Any] = {"contender": name, "seed": seed, "load": _load()}
        try:
            if name in DDP:
                record.update(run_ddp(spec, name, seed))
            else:
                record.update(run_sparktrain(spark, frame, spec, name, seed))
            record.update(measure(record, args.warmup))
            print(
                f"{name} seed {seed}: step {record['step_s'] * 1e3:.1f} ms, "
                f"{_bytes(record['wire_bytes_per_step'])}/step, "
                f"final loss {record['loss'][-1]:.4f}, load {record['load']}",
                flush=True,
            )
        except Exception as exc:  # one contender failing is a result, not the end
            record["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name} seed {seed}: {record['error'][:500]}", flush=True)
        runs.append(record)
    frame.unpersist()
    report: dict[str, Any] = {
        "spec": spec,
        "contenders": list(contenders),
        "seeds": args.seeds,
        "repeats": args.repeats,
        "master": f"local[{args.workers}]",
        "load_before": load_before,
        "load_after": _load(),
        "runs": runs,
    }
    report["derived"] = derive(runs, args.smooth, args.target_loss)
    report["bench_s"] = time.perf_counter() - started
    write(report, path, not args.no_plot)
    print(f"report written to {path} ({report['bench_s']:.0f} s)")
    return 0
