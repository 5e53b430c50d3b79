"""Data-path bench: worker memory and samples/s as a partition outgrows the worker's data
budget, in RAM against spilled to local disk, prefetch on and off, against a
single-process peer reading the same Parquet.

    sparktrain bench data --out docs/results
    sparktrain bench data --budget-mb 32 --factors 0.5 1 2 --repeats 1   # quicker

One run, one job: a synthetic Parquet dataset (int64 ``id``, a 64-float32 array
``features``, an int32 ``label`` in 0..9) written with pyarrow under a temporary folder
as equal shards, read back with ``spark.read.parquet``; a 64-128-10 MLP trained with the
ring on ``local[WORLD]`` through :class:`sparktrain.Trainer`. A partition's size is a
multiple (``--factors``) of the budget ``--budget-mb`` (``data_memory_mb``): rows per
worker = factor x budget / (64 x 4 bytes). Parts:

- **memory**: for every factor, one run with spilling allowed (``data_memory_mb`` =
  the budget) and one forced in RAM (``data_memory_mb`` = ``--in-ram-mb``, more than any
  partition); each rank's ``peak_anon_bytes_per_worker`` (``RssAnon``: anonymous memory,
  the memory map's page cache is not counted). Growth is relative to the smallest factor,
  per mode, on the largest rank's figure (target for the spilled path: +25 % at most).
- **throughput**: at ``--throughput-factor`` the spilled and the in-RAM runs again,
  ``--repeats`` rounds (the memory part's runs at that factor warmed the page cache),
  the order rotated each round; the ratio of the medians of ``samples_per_s``
  (target >= 0.9).
- **prefetch**: in the same rounds, the spilled path with ``prefetch_batches = 0``; the
  share of training time spent waiting for data, ``data_wait_s / train_s``, against the
  spilled runs with ``--prefetch`` (default 2).
- **peer**: the same files at the throughput factor through a plain ``pyarrow.dataset``
  batch reader (Petastorm 0.13.1 does not import on the pinned pyarrow; the run records
  why, see docs/data.md) into a single-process torch loop over the same model, batch
  size, epochs, optimizer and loss, in a fresh process (``spawn``); its samples/s
  (reading included, as streaming readers do) and its peak ``RssAnon`` (sampled every
  10 ms) next to the same figure before it read any data.

Python workers are not reused between runs (``spark.python.worker.reuse = false``), so
every run's ranks start from a fresh fork of the worker daemon and no run inherits
another's heap. Spill files go under the session's ``spark.local.dir``, a folder of the
temporary directory; after every run the bench records what is left there besides
Spark's own block-manager folders (``leftover_local_files``, expected 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.plots import pyplot, save_figure
from sparktrain.errors import ConfigError
from sparktrain.task.memory import anon_rss_bytes

WIDTH = 64  # features per row
CLASSES = 10
ROW_BYTES = WIDTH * 4  # float32 features: what a partition's size is counted in
MODEL = "sparktrain.models:mlp"
MIB = 1 << 20
SPILLED, IN_RAM, NO_PREFETCH = "spilled", "in_ram", "spilled_no_prefetch"
GROWTH_TARGET = 0.25  # spilled path: peak anon memory at most +25 % over the smallest case
THROUGHPUT_TARGET = 0.9  # spilled samples/s >= 0.9 x in RAM
DATA_KEYS = ("data_path", "data_spilled_bytes", "data_wait_s", "peak_anon_bytes_per_worker")


# ---------------------------------------------------------------------- sizes
def rows_per_worker(budget_mb: float, factor: float) -> int:
    """Rows whose float32 features take ``factor`` x ``budget_mb`` MiB."""
    return round(factor * budget_mb * MIB / ROW_BYTES)


def shard_plan(factors: Sequence[float], world: int) -> tuple[float, dict[float, int]]:
    """The unit factor (the smallest) and, per factor, how many shard files of
    ``unit`` x budget rows per worker it reads: ``world`` x factor / unit. Every factor
    must be a whole multiple of the smallest, so that each size reads a prefix of the
    same shards."""
    if not factors:
        raise ConfigError("--factors needs at least one value")
    if any(f <= 0 for f in factors):
        raise ConfigError("--factors must be > 0")
    unit = min(factors)
    plan = {}
    for f in factors:
        k = f / unit
        if abs(k - round(k)) > 1e-9:
            raise ConfigError(
                f"--factors: {f:g} is not a whole multiple of the smallest factor {unit:g}"
            )
        plan[f] = round(k) * world
    return unit, plan


def validate(args: argparse.Namespace) -> None:
    """Refuse arguments the bench cannot measure with (before any Spark starts)."""
    if args.world < 2:
        raise ConfigError("--world must be >= 2 (the ring needs two workers)")
    for name in ("repeats", "epochs", "batch"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1")
    if args.budget_mb <= 0:
        raise ConfigError("--budget-mb must be > 0 (0 spills every row: nothing to compare)")
    _, plan = shard_plan(args.factors, args.world)
    if args.throughput_factor not in plan:
        raise ConfigError(
            f"--throughput-factor {args.throughput_factor:g} must be one of --factors "
            f"({', '.join(f'{f:g}' for f in args.factors)})"
        )
    if args.throughput_factor <= 1:
        raise ConfigError("--throughput-factor must be > 1: below the budget nothing spills")
    biggest = max(args.factors) * args.budget_mb
    if args.in_ram_mb <= biggest:
        raise ConfigError(
            f"--in-ram-mb {args.in_ram_mb:g} must exceed the largest partition "
            f"({biggest:g} MiB) to keep it in RAM"
        )
    if args.prefetch < 1:
        raise ConfigError("--prefetch must be >= 1 (it is compared with 0)")


# ---------------------------------------------------------------------- data
def write_shards(folder: Path, shards: int, rows: int, seed: int = 0) -> list[Path]:
    """``shards`` Parquet files of ``rows`` rows each: ``id`` (int64, global), ``features``
    (list<float32>, WIDTH values drawn from N(0, 1)), ``label`` (int32 in 0..9, the
    argmax of a fixed random linear map of the features: learnable). Uncompressed, one
    row group per file: every shard has the same byte size, so Spark packs them evenly."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    weights = np.random.default_rng(seed).standard_normal((WIDTH, CLASSES)).astype(np.float32)
    paths = []
    for i in range(shards):
        rng = np.random.default_rng([seed, i + 1])
        x = rng.standard_normal((rows, WIDTH), dtype=np.float32)
        label = np.argmax(x @ weights, axis=1).astype(np.int32)
        offsets = pa.array(np.arange(0, (rows + 1) * WIDTH, WIDTH, dtype=np.int32))
        table = pa.table(
            {
                "id": pa.array(np.arange(i * rows, (i + 1) * rows, dtype=np.int64)),
                "features": pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1))),
                "label": pa.array(label),
            }
        )
        path = folder / f"part-{i:05d}.parquet"
        pq.write_table(table, path, compression="none", use_dictionary=False, row_group_size=rows)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------- memory
class AnonSampler:
    """The largest ``RssAnon`` seen by a background thread every ``interval`` seconds."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.peak = anon_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="anon-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, anon_rss_bytes())

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_rss_bytes())


# ---------------------------------------------------------------------- derived figures
def peak_of(record: dict[str, Any]) -> int | None:
    """The largest rank's peak anonymous memory in a run record (None: not reported)."""
    peaks = record.get("peak_anon_bytes_per_worker") or []
    return max(peaks) if peaks else None


def growth(records: Sequence[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Per factor (ascending), the memory part's runs of ``mode``: the largest rank's peak
    anonymous memory and its growth over the smallest factor's (``peak / first - 1``)."""
    rows = sorted(
        (r for r in records if r["part"] == "memory" and r["mode"] == mode),
        key=lambda r: r["factor"],
    )
    out: list[dict[str, Any]] = []
    first: int | None = None
    for r in rows:
        peak = peak_of(r)
        if first is None:
            first = peak
        out.append(
            {
                "factor": r["factor"],
                "rows_per_worker": r["rows_per_worker"],
                "partition_bytes": r["partition_bytes"],
                "peak_anon_bytes": peak,
                "growth": peak / first - 1.0 if peak is not None and first else None,
            }
        )
    return out


def slope(rows: Sequence[dict[str, Any]]) -> float | None:
    """Bytes of peak anonymous memory per byte of partition, smallest to largest factor
    (about 1 when the partition is held in RAM, about 0 when it is flat)."""
    pts = [(r["partition_bytes"], r["peak_anon_bytes"]) for r in rows]
    pts = [p for p in pts if p[1] is not None]
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def wait_share(record: dict[str, Any]) -> float | None:
    """The share of the training loop the training thread spent waiting for its next
    batch (``data_wait_s / train_s``)."""
    wait, train = record.get("data_wait_s"), record.get("train_s")
    if wait is None or not train:
        return None
    return float(wait) / float(train)


def derive(
    records: Sequence[dict[str, Any]], peer: dict[str, Any] | None, factor: float
) -> dict[str, Any]:
    """The verdicts: memory growth per mode, the spilled/in-RAM throughput ratio, the
    data-wait share with and without prefetch, sparktrain against the peer."""
    spilled, in_ram = growth(records, SPILLED), growth(records, IN_RAM)
    last = spilled[-1]["growth"] if spilled else None
    out: dict[str, Any] = {
        "memory": {
            "spilled": spilled,
            "in_ram": in_ram,
            "spilled_growth": last,
            "in_ram_growth": in_ram[-1]["growth"] if in_ram else None,
            "spilled_bytes_per_partition_byte": slope(spilled),
            "in_ram_bytes_per_partition_byte": slope(in_ram),
            "target": GROWTH_TARGET,
            "met": None if last is None else last <= GROWTH_TARGET,
        }
    }
    timed = [r for r in records if r["part"] == "throughput" and r["factor"] == factor]
    by_mode = {
        m: [r["samples_per_s"] for r in timed if r["mode"] == m]
        for m in (SPILLED, IN_RAM, NO_PREFETCH)
    }
    med = {m: _median(v) for m, v in by_mode.items()}
    spilled_sps, in_ram_sps = med[SPILLED], med[IN_RAM]
    ratio = spilled_sps / in_ram_sps if spilled_sps and in_ram_sps else None
    out["throughput"] = {
        "factor": factor,
        "samples_per_s": by_mode,
        "median_samples_per_s": med,
        "ratio": ratio,
        "target": THROUGHPUT_TARGET,
        "met": None if ratio is None else ratio >= THROUGHPUT_TARGET,
    }
    shares = {m: [wait_share(r) for r in timed if r["mode"] == m] for m in (SPILLED, NO_PREFETCH)}
    out["prefetch"] = {
        "factor": factor,
        "prefetch_batches": sorted(
            {r["prefetch_batches"] for r in timed if r["mode"] == SPILLED}, reverse=True
        ),
        "wait_share": shares,
        "median_wait_share": {m: _median(v) for m, v in shares.items()},
        "median_data_wait_s": {
            m: _median([r.get("data_wait_s") for r in timed if r["mode"] == m])
            for m in (SPILLED, NO_PREFETCH)
        },
    }
    losses: dict[float, set[float]] = {}
    for r in records:
        losses.setdefault(r["factor"], set()).add(r["final_loss"])
    out["checks"] = {
        # spilling and prefetch change where rows live and when they are gathered, never
        # which rows a batch holds: every run of one size ends with the same loss
        "same_loss_per_size": all(len(v) == 1 for v in losses.values()),
        "leftover_spill_files": sum(r.get("leftover_local_files", 0) for r in records),
        "input_partitions": sorted({r.get("input_partitions", 0) for r in records}),
    }
    if peer and peer.get("samples_per_s"):
        ours = [r for r in timed if r["mode"] == SPILLED]
        ours_peak = _median([peak_of(r) for r in ours])
        out["peer"] = {
            "kind": peer["kind"],
            "sparktrain_spilled_samples_per_s": med[SPILLED],
            "peer_samples_per_s": peer["samples_per_s"],
            "ratio": spilled_sps / peer["samples_per_s"] if spilled_sps else None,
            "sparktrain_spilled_peak_anon_bytes_per_worker": ours_peak,
            "peer_peak_anon_bytes": peer.get("peak_anon_bytes"),
            "peer_data_anon_bytes": peer.get("data_anon_bytes"),
        }
    return out


# ---------------------------------------------------------------------- Spark runs
def _train_config(args: argparse.Namespace, memory_mb: float, prefetch: int) -> Any:
    from sparktrain.config import TrainConfig

    values: dict[str, Any] = {
        "strategy": "ring",
        "epochs": args.epochs,
        "batch_size": args.batch,
        "lr": args.lr,
        "optimizer": "sgd",  # the figures in docs/data.md were taken under SGD
        "num_workers": args.world,
        "seed": 0,
        "progress": False,
        "data_memory_mb": memory_mb,
        "prefetch_batches": prefetch,
    }
    return TrainConfig(**values)


def leftover_local_files(local_dir: Path) -> list[str]:
    """Spill files left under ``local_dir``: anything inside a ``sparktrain-spill``
    folder (the workers put theirs in the application's folder under ``spark.local.dir``,
    beside the executors' ``blockmgr-*`` folders; see ``data.spill.local_root``)."""
    from sparktrain.data.spill import SPILL_DIR_NAME

    if not local_dir.exists():
        return []
    return sorted(
        str(p.relative_to(local_dir))
        for p in local_dir.rglob("*")
        if p.is_file() and SPILL_DIR_NAME in p.relative_to(local_dir).parts
    )


def run_fit(
    spark: Any,
    args: argparse.Namespace,
    paths: Sequence[Path],
    *,
    part: str,
    mode: str,
    factor: float,
    local_dir: Path,
) -> dict[str, Any]:
    """One fit over ``paths``; its record (the summary's data keys and timings)."""
    from sparktrain import Trainer

    memory_mb = args.budget_mb if mode != IN_RAM else args.in_ram_mb
    prefetch = 0 if mode == NO_PREFETCH else args.prefetch
    cfg = _train_config(args, memory_mb, prefetch)
    df = spark.read.parquet(*[str(p) for p in paths])
    partitions = df.rdd.getNumPartitions()
    kwargs = {"in_features": WIDTH, "hidden": list(args.hidden), "out_features": CLASSES}
    started = time.perf_counter()
    s = (
        Trainer(MODEL, cfg, model_kwargs=kwargs, spark=spark)
        .fit(df, features_col="features", label_col="label")
        .summary
    )
    elapsed = time.perf_counter() - started
    rows = rows_per_worker(args.budget_mb, factor)
    record = {
        "part": part,
        "mode": mode,
        "factor": factor,
        "rows_per_worker": rows,
        "partition_bytes": rows * ROW_BYTES,
        "data_memory_mb": memory_mb,
        "prefetch_batches": prefetch,
        "input_partitions": partitions,
        "train_rows_per_worker": s.get("train_rows_per_worker"),
        "samples_per_s": s["samples_per_s"],
        "train_s": s["train_s"],
        "wall_s": s["wall_s"],
        "fit_s": elapsed,
        "final_loss": s["final_loss"],
        "peak_rss_bytes_per_worker": s.get("peak_rss_bytes_per_worker"),
        **{k: s.get(k) for k in DATA_KEYS},
        "leftover_local_files": len(leftover_local_files(local_dir)),
    }
    print(_line(record), flush=True)
    return record


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f} MiB"


def _line(r: dict[str, Any]) -> str:
    share = wait_share(r)
    return (
        f"{r['part']:10s} {r['mode']:19s} x{r['factor']:<5g} {r['rows_per_worker']:>9,} rows/w "
        f"| anon {_mib(peak_of(r)):>11s} | {r['data_path'] or '?':7s} "
        f"spilled {_mib(r['data_spilled_bytes'])} | {r['samples_per_s']:,.0f} samples/s "
        f"| wait {('-' if share is None else f'{share:.1%}')} | fit {r['fit_s']:.1f} s"
    )


# ---------------------------------------------------------------------- the peer
def petastorm_status() -> str | None:
    """None when Petastorm's Spark converter imports, else why not."""
    try:
        from petastorm.spark import make_spark_converter  # noqa: F401
    except Exception as exc:  # ImportError, or one raised inside petastorm's own imports
        return f"{type(exc).__name__}: {exc}"
    return None


def peer_loop(
    paths: Sequence[str],
    *,
    epochs: int,
    batch: int,
    lr: float,
    hidden: Sequence[int],
    threads: int,
) -> dict[str, Any]:
    """The peer's training: a single-process torch loop over the same model, loss and
    optimizer; batches of ``batch`` rows streamed from the Parquet files, in file order,
    by ``pyarrow.dataset``. Samples/s counts the whole loop, reading included."""
    import numpy as np
    import pyarrow.dataset as ds
    import torch

    from sparktrain.models import mlp

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = mlp(WIDTH, tuple(hidden), CLASSES)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    dataset = ds.dataset([str(p) for p in paths], format="parquet")

    def from_parquet(_epoch: int) -> Any:
        for rb in dataset.to_batches(columns=["features", "label"], batch_size=batch):
            values = rb.column(0).flatten().to_numpy(zero_copy_only=False)
            x = torch.from_numpy(np.array(values, np.float32).reshape(-1, WIDTH))
            y = torch.from_numpy(rb.column(1).to_numpy().astype(np.int64))
            yield x, y

    baseline = anon_rss_bytes()
    samples = 0
    loss = torch.zeros(())
    with AnonSampler() as sampler:
        started = time.perf_counter()
        for epoch in range(epochs):
            for x, y in from_parquet(epoch):
                opt.zero_grad(set_to_none=False)
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                samples += int(y.shape[0])
        loop_s = time.perf_counter() - started
    return {
        "samples": samples,
        "loop_s": loop_s,
        "samples_per_s": samples / loop_s if loop_s > 0 else 0.0,
        "final_loss": float(loss.detach()),
        "baseline_anon_bytes": baseline,
        "peak_anon_bytes": sampler.peak,
        "data_anon_bytes": sampler.peak - baseline,
        "threads": threads,
    }


def _peer_process(job: dict[str, Any], out: Any) -> None:
    try:
        reason = petastorm_status()
        result = peer_loop(
            job["paths"],
            epochs=job["epochs"],
            batch=job["batch"],
            lr=job["lr"],
            hidden=job["hidden"],
            threads=job["threads"],
        )
        result["kind"] = "pyarrow.dataset"
        result["petastorm"] = (
            "imports here, but the peer is the pyarrow.dataset loop"
            if reason is None
            else f"not usable here ({reason}); the peer is a pyarrow.dataset loop"
        )
        out.put(("ok", result))
    except BaseException as exc:  # reported to the parent, which raises it
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def run_peer(job: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """The peer in a fresh process (``spawn``): its memory is its own."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_peer_process, args=(job, out), daemon=True)
    proc.start()
    try:
        kind, payload = out.get(timeout=timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if kind == "error":
        raise RuntimeError(f"the peer failed: {payload}")
    return dict(payload)


# ---------------------------------------------------------------------- output
def table(data: dict[str, Any]) -> str:
    """The results page's tables: memory per size, then the verdicts."""
    d = data["derived"]
    mem = d["memory"]
    runs = {(r["mode"], r["factor"]): r for r in data["records"] if r["part"] == "memory"}
    lines = [
        "| partition / budget | rows per worker | partition | spilled: peak anon "
        "| growth | data_path | spilled bytes | in RAM: peak anon | growth |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    in_ram = {r["factor"]: r for r in mem["in_ram"]}
    for s in mem["spilled"]:
        f = s["factor"]
        ram = in_ram.get(f, {})
        run = runs.get((SPILLED, f), {})
        spilled_bytes = run.get("data_spilled_bytes")
        lines.append(
            f"| {f:g}x | {s['rows_per_worker']:,} | {_mib(s['partition_bytes'])} "
            f"| {_mib(s['peak_anon_bytes'])} | {_pct(s['growth'])} "
            f"| {run.get('data_path') or '-'} | {_mib(spilled_bytes)} "
            f"| {_mib(ram.get('peak_anon_bytes'))} | {_pct(ram.get('growth'))} |"
        )
    t, p = d["throughput"], d["prefetch"]
    med = t["median_samples_per_s"]
    share = p["median_wait_share"]
    n = len(t["samples_per_s"][SPILLED])
    lines += [
        "",
        f"- memory: spilled peak anon memory grows {_pct(mem['spilled_growth'])} from the "
        f"smallest to the largest partition (target <= +{GROWTH_TARGET:.0%}: "
        f"{_verdict(mem['met'])}); in RAM {_pct(mem['in_ram_growth'])}. Per byte of "
        f"partition: spilled {_num(mem['spilled_bytes_per_partition_byte'], '{:.2f}')}, "
        f"in RAM {_num(mem['in_ram_bytes_per_partition_byte'], '{:.2f}')} bytes",
        f"- samples/s at {t['factor']:g}x the budget, median of {n}: spilled "
        f"{_num(med[SPILLED], '{:,.0f}')}, in RAM {_num(med[IN_RAM], '{:,.0f}')}, ratio "
        f"{_num(t['ratio'], '{:.2f}')} (target >= {THROUGHPUT_TARGET}: {_verdict(t['met'])})",
        f"- waiting for data, spilled path (data_wait_s / train_s, median): prefetch "
        f"{'/'.join(str(b) for b in p['prefetch_batches']) or '-'} "
        f"{_pct(share[SPILLED], sign=False)}, prefetch 0 {_pct(share[NO_PREFETCH], sign=False)}"
        f" ({_num(med[NO_PREFETCH], '{:,.0f}')} samples/s)",
    ]
    peer = d.get("peer")
    raw = data.get("peer") or {}
    if peer:
        lines.append(
            f"- peer ({peer['kind']}, one process, torch threads: {raw.get('threads', '?')}, "
            f"reading included): {peer['peer_samples_per_s']:,.0f} samples/s, peak anon "
            f"{_mib(peer['peer_peak_anon_bytes'])} ({_mib(peer['peer_data_anon_bytes'])} "
            f"over its start); sparktrain spilled / peer samples/s "
            f"{_num(peer['ratio'], '{:.2f}')}, sparktrain spilled peak anon per worker "
            f"{_mib(peer['sparktrain_spilled_peak_anon_bytes_per_worker'])}"
        )
    if raw.get("petastorm"):
        lines.append(f"- Petastorm: {raw['petastorm']}")
    checks = d.get("checks")
    if checks:
        lines.append(
            f"- every run of one size ended with the same loss (spilled, in RAM, prefetch "
            f"on or off): {'yes' if checks['same_loss_per_size'] else 'NO'}; spill files "
            f"left under spark.local.dir after the runs: {checks['leftover_spill_files']}"
        )
    return "\n".join(lines)


def _pct(value: float | None, sign: bool = True) -> str:
    if value is None:
        return "-"
    return f"{value:+.0%}" if sign else f"{value:.1%}"


def _num(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _verdict(flag: bool | None) -> str:
    return "not measured" if flag is None else ("met" if flag else "MISSED")


def plot(data: dict[str, Any], path: Path) -> None:
    """Peak anonymous memory per worker against the partition size, spilled and in RAM,
    with the budget, the +25 % band over the smallest spilled case and the peer."""
    plt = pyplot()

    mem = data["derived"]["memory"]
    setup = data["setup"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for mode, label, color in ((SPILLED, "spilled (budget)", "C0"), (IN_RAM, "in RAM", "C1")):
        pts = [(r["partition_bytes"], r["peak_anon_bytes"]) for r in mem[mode]]
        pts = [(x / MIB, y / MIB) for x, y in pts if y is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=label, color=color)
    first = mem["spilled"][0]["peak_anon_bytes"] if mem["spilled"] else None
    if first:
        ax.axhline(
            first * (1 + GROWTH_TARGET) / MIB,
            color="C0",
            ls=":",
            lw=1,
            label=f"smallest spilled +{GROWTH_TARGET:.0%}",
        )
    ax.axvline(setup["budget_mb"], color="0.5", ls="--", lw=1, label="data_memory_mb")
    peer = data.get("peer")
    if peer and peer.get("peak_anon_bytes"):
        x = setup["throughput_factor"] * setup["budget_mb"] * setup["world"]
        ax.plot(
            [x], [peer["peak_anon_bytes"] / MIB], "s", color="C2",
            label=f"peer ({peer['kind']}, one process, all rows)",
        )  # fmt: skip
    ax.set_xlim(left=0)
    ax.set_xlabel("partition per worker (MiB of float32 features)")
    ax.set_ylabel("peak RssAnon per worker (MiB)")
    ax.set_title(
        f"ring, {setup['world']} workers, budget {setup['budget_mb']:g} MiB, "
        f"{setup['epochs']} epoch(s), batch {setup['batch']}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save_figure(fig, path)


# ---------------------------------------------------------------------- entry
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="docs/results/", help="folder for JSON and PNG")
    parser.add_argument("--name", default="bench_data", help="file name stem")
    parser.add_argument("--world", type=int, default=2, help="workers, on local[WORLD]")
    parser.add_argument(
        "--budget-mb", type=float, default=64.0, help="data_memory_mb of the spilled runs"
    )
    parser.add_argument(
        "--in-ram-mb",
        type=float,
        default=1e6,
        help="data_memory_mb of the in-RAM runs (more than any partition)",
    )
    parser.add_argument(
        "--factors",
        type=float,
        nargs="+",
        default=[0.25, 1.0, 2.0, 4.0],
        help="partition sizes as multiples of the budget (whole multiples of the smallest)",
    )
    parser.add_argument(
        "--throughput-factor", type=float, default=2.0, help="the size samples/s is timed at"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--prefetch", type=int, default=2, help="prefetch_batches when on")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128])
    parser.add_argument("--peer-threads", type=int, default=1, help="the peer's torch threads")
    parser.add_argument("--no-peer", action="store_true", help="skip the single-process peer")
    parser.add_argument("--tmp", default=None, help="where the Parquet and spill files go")


def main(args: argparse.Namespace) -> int:
    validate(args)
    from sparktrain.session import get_or_create_session

    unit, plan = shard_plan(args.factors, args.world)
    shard_rows = rows_per_worker(args.budget_mb, unit)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparktrain-bench-data-", dir=args.tmp) as tmp:
        root = Path(tmp)
        local_dir = root / "local"
        local_dir.mkdir()
        paths = write_shards(root / "parquet", max(plan.values()), shard_rows)
        print(
            f"wrote {len(paths)} shards x {shard_rows:,} rows "
            f"({sum(p.stat().st_size for p in paths) / MIB:.0f} MiB) in "
            f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
        spark = get_or_create_session(
            f"local[{args.world}]",
            app_name="sparktrain-bench-data",
            conf={
                "spark.python.worker.reuse": "false",
                "spark.local.dir": str(local_dir),
                # one input partition per worker: the shards are equal, the split is half
                "spark.sql.files.maxPartitionBytes": str(1 << 40),
            },
        )
        records: list[dict[str, Any]] = []
        peer: dict[str, Any] | None = None
        try:

            def fit(part: str, mode: str, factor: float) -> None:
                records.append(
                    run_fit(
                        spark,
                        args,
                        paths[: plan[factor]],
                        part=part,
                        mode=mode,
                        factor=factor,
                        local_dir=local_dir,
                    )
                )

            for factor in sorted(args.factors):
                for mode in (SPILLED, IN_RAM):
                    fit("memory", mode, factor)
            modes = (SPILLED, IN_RAM, NO_PREFETCH)
            for r in range(args.repeats):
                for mode in modes[r % 3 :] + modes[: r % 3]:
                    fit("throughput", mode, args.throughput_factor)
        finally:
            spark.stop()
        if not args.no_peer:
            peer = run_peer(
                {
                    "paths": [str(p) for p in paths[: plan[args.throughput_factor]]],
                    "epochs": args.epochs,
                    "batch": args.batch,
                    "lr": args.lr,
                    "hidden": list(args.hidden),
                    "threads": args.peer_threads,
                }
            )
            print(
                f"peer {peer['kind']}: {peer['samples_per_s']:,.0f} samples/s, peak anon "
                f"{_mib(peer['peak_anon_bytes'])} ({_mib(peer['data_anon_bytes'])} over start)",
                flush=True,
            )
    data = build_result(args, records, peer, time.perf_counter() - started)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(data, out / f"{args.name}.png")
    print(table(data))
    print(f"wrote {out / (args.name + '.json')} and {out / (args.name + '.png')}")
    return 0


def build_result(
    args: argparse.Namespace,
    records: list[dict[str, Any]],
    peer: dict[str, Any] | None,
    elapsed: float,
) -> dict[str, Any]:
    """The JSON the bench writes: setup, every run's record, the peer, the verdicts."""
    setup = {
        "world": args.world,
        "budget_mb": args.budget_mb,
        "in_ram_mb": args.in_ram_mb,
        "factors": sorted(args.factors),
        "throughput_factor": args.throughput_factor,
        "repeats": args.repeats,
        "prefetch": args.prefetch,
        "epochs": args.epochs,
        "batch": args.batch,
        "lr": args.lr,
        "model": f"{MODEL} {WIDTH}-{'-'.join(map(str, args.hidden))}-{CLASSES}",
        "row_bytes": ROW_BYTES,
        "python_worker_reuse": False,
        "cpus": os.cpu_count(),
        "bench_s": elapsed,
    }
    return {
        "setup": setup,
        "records": records,
        "peer": peer,
        "derived": derive(records, peer, args.throughput_factor),
    }
