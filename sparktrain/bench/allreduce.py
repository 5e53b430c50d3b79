"""Allreduce benchmark: our ring and tree between Spark barrier tasks against
torch.distributed's Gloo between plain processes, in the same run.

    sparktrain bench allreduce --world 2 4 --sizes 4K 1M 16M 64M --algos ring tree gloo \
        --json runs/bench_allreduce.json

Records are ``{algo, world, bytes, time_s, algbw, busbw}``; busbw (GB/s) follows
nccl-tests: ``bytes * 2(n-1)/n / time``. Each figure is the median over timed iterations
of the slowest rank, after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sparktrain.errors import ConfigError

OURS = ("ring", "tree")
ALGOS = (*OURS, "gloo")
_SIZE = re.compile(r"^(\d+)([KMG]?)$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``4K`` -> 4096 bytes, ``16M`` -> 16 MiB; a multiple of 4 (float32 elements)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise ConfigError(f"size {text!r} not understood; use e.g. 4K, 1M, 64M")
    value = (
        int(match.group(1))
        * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[match.group(2).upper()]
    )
    if value % 4:
        raise ConfigError(f"size {text!r} must be a multiple of 4 bytes (float32 elements)")
    return value


def iterations_for(nbytes: int, budget_bytes: int = 1 << 30, low: int = 5, high: int = 300) -> int:
    """Enough repetitions for a stable median, bounded in count and in moved bytes."""
    return max(low, min(high, budget_bytes // max(nbytes, 1)))


def record(algo: str, world: int, nbytes: int, time_s: float) -> dict[str, Any]:
    algbw = nbytes / time_s / 1e9 if time_s > 0 else 0.0
    busbw = algbw * 2 * (world - 1) / world
    return {
        "algo": algo,
        "world": world,
        "bytes": nbytes,
        "time_s": time_s,
        "algbw": algbw,
        "busbw": busbw,
    }


# ---------------------------------------------------------------------- ours, in Spark
def _spark_task(sizes: Sequence[int], algos: Sequence[str], timeout: float) -> Any:
    """The function each barrier task runs; returns per-iteration times per (algo, size)."""

    def task(partition: Iterator[Any]) -> Iterator[str]:
        import secrets as _secrets

        from sparktrain.comm import Mesh, address_of, make_allreduce, open_listener
        from sparktrain.launch.barrier import worker_context

        ctx = worker_context(None)
        listener = open_listener(ctx.host)
        # The secret and job id come from rank 0 through allGather (benchmark only).
        token = _secrets.token_hex(32) if ctx.rank == 0 else ""
        gathered = [
            json.loads(s) for s in ctx.all_gather(json.dumps([address_of(listener), token]))
        ]
        secret = bytes.fromhex(gathered[0][1])
        mesh = Mesh(
            ctx.rank,
            ctx.world_size,
            listener,
            [g[0] for g in gathered],
            secret=secret,
            job_id="bench",
            attempt=0,
            timeout=timeout,
        )
        out: dict[str, list[float]] = {}
        try:
            for algo in algos:
                reducer = make_allreduce(algo, mesh)
                for nbytes in sizes:
                    buf = np.ones(nbytes // 4, dtype=np.float32)
                    for _ in range(2):
                        reducer.allreduce_(buf)
                    times = []
                    for _ in range(iterations_for(nbytes)):
                        t = time.perf_counter()
                        reducer.allreduce_(buf)
                        times.append(time.perf_counter() - t)
                    out[f"{algo}:{nbytes}"] = times
        finally:
            mesh.close()
        yield json.dumps({"rank": ctx.rank, "times": out})

    return task


def bench_ours(
    spark: Any, world: int, sizes: Sequence[int], algos: Sequence[str]
) -> list[dict[str, Any]]:
    rows = (
        spark.sparkContext.parallelize(range(world), world)
        .barrier()
        .mapPartitions(_spark_task(sizes, algos, timeout=120.0))
        .collect()
    )
    per_rank = [json.loads(r)["times"] for r in rows]
    results = []
    for algo in algos:
        for nbytes in sizes:
            key = f"{algo}:{nbytes}"
            # iteration i takes as long as its slowest rank
            slowest = [max(ts) for ts in zip(*(r[key] for r in per_rank), strict=True)]
            results.append(record(algo, world, nbytes, statistics.median(slowest)))
    return results


# ---------------------------------------------------------------------- gloo
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_rank(rank: int, world: int, port: int, sizes: Sequence[int], queue: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for nbytes in sizes:
            t = torch.ones(nbytes // 4, dtype=torch.float32)
            for _ in range(2):
                dist.all_reduce(t)
            times = []
            for _ in range(iterations_for(nbytes)):
                start = time.perf_counter()
                dist.all_reduce(t)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                times.append(elapsed)
            stacked = torch.cat(times)
            dist.all_reduce(stacked, op=dist.ReduceOp.MAX)  # slowest rank per iteration
            if rank == 0:
                queue.put((nbytes, stacked.tolist()))
    finally:
        dist.destroy_process_group()


def bench_gloo(world: int, sizes: Sequence[int], timeout: float = 600.0) -> list[dict[str, Any]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_gloo_rank, args=(r, world, port, list(sizes), queue))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    results = []
    deadline = time.monotonic() + timeout
    try:
        for _ in sizes:
            nbytes, times = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            results.append(record("gloo", world, nbytes, statistics.median(times)))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return sorted(results, key=lambda r: r["bytes"])


# ---------------------------------------------------------------------- report
def table(records: list[dict[str, Any]]) -> str:
    """A Markdown table with the ratio to Gloo (busbw for ring, time for the rest)."""
    gloo = {(r["world"], r["bytes"]): r for r in records if r["algo"] == "gloo"}
    lines = [
        "| world | size | algo | time | busbw GB/s | vs Gloo |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in sorted(records, key=lambda r: (r["world"], r["bytes"], r["algo"])):
        ref = gloo.get((r["world"], r["bytes"]))
        ratio = ""
        if ref is not None and r["algo"] != "gloo":
            ratio = (
                f"{r['busbw'] / ref['busbw']:.2f}x busbw, {r['time_s'] / ref['time_s']:.2f}x time"
                if ref["busbw"] > 0
                else f"{r['time_s'] / ref['time_s']:.2f}x time"
            )
        lines.append(
            f"| {r['world']} | {_human(r['bytes'])} | {r['algo']} | {_duration(r['time_s'])} "
            f"| {r['busbw']:.3f} | {ratio} |"
        )
    return "\n".join(lines)


def _human(nbytes: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """busbw against message size, one panel per world size, one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in records if r["world"] > 1})
    if not worlds:
        return
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 3.6), squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        for algo in sorted({r["algo"] for r in records}):
            rows = sorted(
                (r for r in records if r["algo"] == algo and r["world"] == world),
                key=lambda r: r["bytes"],
            )
            if rows:
                ax.plot(
                    [r["bytes"] for r in rows], [r["busbw"] for r in rows], marker="o", label=algo
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["bytes"] for r in records if r["world"] == world])
        ax.set_xticklabels([_human(r["bytes"]) for r in records if r["world"] == world])
        ax.set_title(f"world {world}")
        ax.set_xlabel("message size")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["4K", "1M", "16M", "64M"])
    parser.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    parser.add_argument("--json", metavar="PATH", help="write the records here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG here (default: beside --json)")
    parser.add_argument("--master", help="Spark master (default local[max(world)])")


def main(args: argparse.Namespace) -> int:
    from sparktrain.session import get_or_create_session

    sizes = [parse_size(s) for s in args.sizes]
    if any(w < 1 for w in args.world):
        raise ConfigError("--world sizes must be >= 1")
    ours = [a for a in args.algos if a in OURS]
    records: list[dict[str, Any]] = []
    if ours:
        master = args.master or f"local[{max(args.world)}]"
        spark = get_or_create_session(master, app_name="sparktrain-bench-allreduce")
        for world in args.world:
            records += bench_ours(spark, world, sizes, ours)
            print(f"ours, world {world}: done", flush=True)
    if "gloo" in args.algos:
        for world in args.world:
            records += bench_gloo(world, sizes)
            print(f"gloo, world {world}: done", flush=True)
    print(table(records))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1) + "\n")
        print(f"records written to {path}")
    plot_path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot_path:
        plot(records, Path(plot_path))
        print(f"plot written to {plot_path}")
    return 0
