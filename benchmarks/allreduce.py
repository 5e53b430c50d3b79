"""Allreduce benchmark: our ring and tree between Spark barrier tasks against
torch.distributed's Gloo between plain processes, in the same run.

    sparktrain bench allreduce --world 2 4 --sizes 4K 1M 16M 64M --algos ring tree gloo \
        --json runs/bench_allreduce.json

Records are ``{algo, world, bytes, time_s, algbw, busbw}``; busbw (GB/s) follows
nccl-tests: ``bytes * 2(n-1)/n / time``. Each figure is the median over timed iterations
of the slowest rank, after warm-up.

``--algos ps`` adds the parameter server (:mod:`sparktrain.strategies.ps`, sync mode, SGD): for
each ``--shards`` count k the driver serves a flat model of ``bytes / 4`` float32
parameters in k shards, and every barrier task times push + pull rounds (its gradient
up, the shard's delta back: the whole model each way per rank). Rows are ``ps{k}``
with ``shards: k``; busbw uses the same formula so the rows compare with the ring's.

``--algos torch`` runs ``torch.distributed``'s Gloo allreduce *inside* the same barrier
tasks, bootstrapped from the rendezvous exactly as ``comm_backend = "torch"`` does
(:mod:`sparktrain.strategies.allreduce.task_torch`): the row compares it with our ring in the same
tasks, and with ``gloo`` (the same Gloo between plain processes, ``tcp://`` init) for what
Spark's Python workers cost it.

``--security none mac tls`` runs ring/tree once per wire security (plaintext, frame
MACs, TLS; :mod:`sparktrain.wire.security`) on a mesh each, in the same barrier tasks,
taking turns iteration by iteration: rows ``ring``, ``ring+mac``, ``ring+tls`` with
``security`` set (docs/security.md).
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

from benchmarks.plots import pyplot, save_figure
from sparktrain.errors import ConfigError

OURS = ("ring", "tree")
PS = "ps"
TORCH = "torch"
"""Gloo through comm_backend='torch''s bootstrap, in the barrier tasks."""
IN_TASKS = (*OURS, TORCH)
ALGOS = (*OURS, PS, "gloo", TORCH)
DEFAULT_ALGOS = (*OURS, "gloo")
"""What runs without ``--algos`` (the parameter server only when asked for)."""
PS_JOB_ID = "bench-ps"
SECURITIES = ("none", "mac", "tls")
PS_LR = 1e-12
"""The server's SGD step size: positive (as the config requires) and too small to matter."""
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
def _label(algo: str, security: str) -> str:
    return algo if security == "none" else f"{algo}+{security}"


def _spark_task(
    sizes: Sequence[int],
    algos: Sequence[str],
    timeout: float,
    securities: Sequence[str] = ("none",),
    iterations: int | None = None,
) -> Any:
    """The function each barrier task runs; returns per-iteration times per (algo, size).
    ``iterations``: timed iterations per size (default :func:`iterations_for`; a shaped
    link needs fewer)."""
    modes = list(securities)

    def task(partition: Iterator[Any]) -> Iterator[str]:
        import secrets as _secrets

        from sparktrain.driver.barrier import worker_context
        from sparktrain.wire import Mesh, address_of, make_allreduce, open_listener
        from sparktrain.wire.security import WireSecurity

        ctx = worker_context(None)
        out: dict[str, list[float]] = {}
        meshes: dict[str, Mesh] = {}
        try:
            for mode in modes:
                listener = open_listener(ctx.host)
                # The secret, job id and TLS certificate come from rank 0 through
                # allGather (benchmark only).
                token, sec = "", ""
                if ctx.rank == 0:
                    token = _secrets.token_hex(32)
                    sec = WireSecurity.for_job(
                        "tls" if mode == "tls" else "none", frame_integrity=mode == "mac"
                    ).to_text()
                gathered = [
                    json.loads(s)
                    for s in ctx.all_gather(json.dumps([address_of(listener), token, sec]))
                ]
                meshes[mode] = Mesh(
                    ctx.rank,
                    ctx.world_size,
                    listener,
                    [g[0] for g in gathered],
                    secret=bytes.fromhex(gathered[0][1]),
                    job_id="bench",
                    attempt=0,
                    timeout=timeout,
                    security=WireSecurity.from_text(gathered[0][2]),
                )
            for algo in algos:
                if algo == TORCH:  # no wire security of its own: one plaintext row
                    reducers: dict[str, Any] = {"none": _torch_allreduce(ctx, timeout)}
                else:
                    reducers = {mode: make_allreduce(algo, mesh) for mode, mesh in meshes.items()}
                for nbytes in sizes:
                    # ones double every allreduce: one buffer per mode keeps them finite
                    bufs = {mode: np.ones(nbytes // 4, dtype=np.float32) for mode in reducers}
                    for mode, reducer in reducers.items():
                        for _ in range(2):
                            reducer.allreduce_(bufs[mode])
                    # Modes take turns iteration by iteration, so a load that comes and
                    # goes on the machine weighs on each of them alike.
                    for _ in range(iterations or iterations_for(nbytes)):
                        for mode, reducer in reducers.items():
                            t = time.perf_counter()
                            reducer.allreduce_(bufs[mode])
                            elapsed = time.perf_counter() - t
                            out.setdefault(f"{_label(algo, mode)}:{nbytes}", []).append(elapsed)
        finally:
            for mesh in meshes.values():
                mesh.close()
            _destroy_torch_group()
        yield json.dumps({"rank": ctx.rank, "times": out})

    return task


def _torch_allreduce(ctx: Any, timeout: float) -> Any:
    """comm_backend='torch''s plain allreduce, its process group started as there."""

    from sparktrain.strategies.allreduce.task_torch import TorchSumAllreduce, init_process_group

    # no collective device: Gloo on the host buffers (a device asks for NCCL)
    init_process_group(ctx, None, timeout)
    return TorchSumAllreduce()


def _destroy_torch_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def bench_ours(
    spark: Any,
    world: int,
    sizes: Sequence[int],
    algos: Sequence[str],
    securities: Sequence[str] = ("none",),
    iterations: int | None = None,
) -> list[dict[str, Any]]:
    """Time ``algos`` between ``world`` barrier tasks; one record per (algo, size), the
    median over iterations of the slowest rank."""
    task = _spark_task(sizes, algos, timeout=120.0, securities=securities, iterations=iterations)
    rows = (
        spark.sparkContext.parallelize(range(world), world).barrier().mapPartitions(task).collect()
    )
    per_rank = [json.loads(r)["times"] for r in rows]
    results = []
    for mode in securities:
        for algo in algos:
            if algo == TORCH:
                continue
            for nbytes in sizes:
                key = f"{_label(algo, mode)}:{nbytes}"
                # iteration i takes as long as its slowest rank
                slowest = [max(ts) for ts in zip(*(r[key] for r in per_rank), strict=True)]
                row = record(_label(algo, mode), world, nbytes, statistics.median(slowest))
                if len(securities) > 1 or mode != "none":
                    row["security"] = mode
                results.append(row)
    if TORCH in algos:  # one plaintext row whatever --security says
        for nbytes in sizes:
            key = f"{TORCH}:{nbytes}"
            slowest = [max(ts) for ts in zip(*(r[key] for r in per_rank), strict=True)]
            results.append(record(TORCH, world, nbytes, statistics.median(slowest)))
    return results


# ---------------------------------------------------------------------- parameter server
def _ps_task(
    addresses: Sequence[str], secret_hex: str, job_id: str, nbytes: int, timeout: float
) -> Any:
    """The function each barrier task runs against the driver's parameter server: one
    full pull, 2 warm-up rounds, then ``iterations_for(nbytes)`` timed push + pull rounds.

    Only plain values are captured (addresses, the secret as hex, sizes)."""
    addrs = list(addresses)

    def task(partition: Iterator[Any]) -> Iterator[str]:
        import concurrent.futures as cf

        from sparktrain.driver.barrier import worker_context
        from sparktrain.strategies.ps.client import ShardClient, connect_shards
        from sparktrain.wire.stats import CommStats

        ctx = worker_context(None)
        n = nbytes // 4
        flat = np.zeros(n, dtype=np.float32)
        grad = np.full(n, 1e-3, dtype=np.float32)
        clients = connect_shards(
            addrs,
            rank=ctx.rank,
            secret=bytes.fromhex(secret_hex),
            job_id=job_id,
            attempt=0,
            timeout=timeout,
            stats=CommStats(),
            num_elements=n,
            dtype=np.dtype(np.float32),
        )
        pool = cf.ThreadPoolExecutor(len(clients)) if len(clients) > 1 else None
        clean = False

        def each(fn: Any) -> None:
            if pool is None:
                fn(clients[0])
                return
            for future in [pool.submit(fn, c) for c in clients]:
                future.result()

        def exchange(step: int) -> Any:
            def one(c: ShardClient) -> None:
                c.push(step, 1, grad[c.lo : c.hi])
                c.pull(step, flat[c.lo : c.hi])

            return one

        times: list[float] = []
        try:
            each(lambda c: c.pull(-1, flat[c.lo : c.hi]))  # the server's values
            step = 0
            for _ in range(2):
                each(exchange(step))
                step += 1
            for _ in range(iterations_for(nbytes)):
                t = time.perf_counter()
                each(exchange(step))
                times.append(time.perf_counter() - t)
                step += 1
            clean = True
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            for c in clients:
                c.bye(clean)
                c.close()
        yield json.dumps({"rank": ctx.rank, "times": times})

    return task


def ps_record(world: int, nbytes: int, shards: int, time_s: float) -> dict[str, Any]:
    return {**record(f"{PS}{shards}", world, nbytes, time_s), "shards": shards}


def bench_ps(
    spark: Any,
    world: int,
    sizes: Sequence[int],
    shards: Sequence[int],
    timeout: float = 120.0,
) -> list[dict[str, Any]]:
    """One driver-side parameter server per (size, shard count), stopped after each."""
    import secrets as _secrets

    import torch
    from torch import nn

    from sparktrain.config import TrainConfig
    from sparktrain.strategies.ps.server import start_parameter_server

    host = spark.sparkContext.getConf().get("spark.driver.host", "127.0.0.1")
    results = []
    for nbytes in sizes:
        for k in shards:
            if k > nbytes // 4:
                raise ConfigError(f"--shards {k} exceeds the {nbytes // 4} elements of {nbytes} B")
            model = nn.Module()
            model.register_parameter(
                "flat", nn.Parameter(torch.zeros(nbytes // 4, dtype=torch.float32))
            )
            cfg = TrainConfig(
                strategy="ps",
                ps_mode="sync",
                ps_shards=k,
                num_workers=world,
                optimizer="sgd",
                lr=PS_LR,
                comm_timeout=timeout,
            )
            secret = _secrets.token_bytes(32)
            server = start_parameter_server(
                model, cfg, host=host, secret=secret, job_id=PS_JOB_ID, attempt=0
            )
            try:
                task = _ps_task(tuple(server.addresses), secret.hex(), PS_JOB_ID, nbytes, timeout)
                rows = (
                    spark.sparkContext.parallelize(range(world), world)
                    .barrier()
                    .mapPartitions(task)
                    .collect()
                )
            finally:
                server.stop()
            per_rank = [json.loads(r)["times"] for r in rows]
            slowest = [max(ts) for ts in zip(*per_rank, strict=True)]
            results.append(ps_record(world, nbytes, k, statistics.median(slowest)))
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
    """A Markdown table with the ratio to Gloo (busbw for ring, time for the rest); for
    parameter-server rows also the ratio of their time to the ring's ("x ring time")."""
    gloo = {(r["world"], r["bytes"]): r for r in records if r["algo"] == "gloo"}
    ring = {(r["world"], r["bytes"]): r for r in records if r["algo"] == "ring"}
    has_ps = any(_is_ps(r) for r in records)
    last = "vs Gloo / ring" if has_ps else "vs Gloo"
    lines = [
        f"| world | size | algo | time | busbw GB/s | {last} |",
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
        ring_ref = ring.get((r["world"], r["bytes"]))
        if _is_ps(r) and ring_ref is not None and ring_ref["time_s"] > 0:
            vs_ring = f"{r['time_s'] / ring_ref['time_s']:.2f}x ring time"
            ratio = f"{ratio}; {vs_ring}" if ratio else vs_ring
        lines.append(
            f"| {r['world']} | {_human(r['bytes'])} | {r['algo']} | {_duration(r['time_s'])} "
            f"| {r['busbw']:.3f} | {ratio} |"
        )
    return "\n".join(lines)


def _is_ps(r: dict[str, Any]) -> bool:
    return "shards" in r or (r["algo"].startswith(PS) and r["algo"][len(PS) :].isdigit())


def _human(nbytes: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """busbw against message size, one panel per world size, one line per algorithm."""
    plt = pyplot()

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
    save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["4K", "1M", "16M", "64M"])
    parser.add_argument("--algos", nargs="+", default=list(DEFAULT_ALGOS), choices=ALGOS)
    parser.add_argument(
        "--shards",
        type=int,
        nargs="+",
        default=[1, 4],
        help="parameter-server shard counts for --algos ps (default: 1 4)",
    )
    parser.add_argument(
        "--security",
        nargs="+",
        default=["none"],
        choices=SECURITIES,
        help="wire security for ring/tree: none, mac (frame MACs), tls; several run one "
        "after another in the same tasks (default: none)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the records here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG here (default: beside --json)")
    parser.add_argument("--master", help="Spark master (default local[max(world)])")


def main(args: argparse.Namespace) -> int:
    from sparktrain.session import get_or_create_session

    sizes = [parse_size(s) for s in args.sizes]
    if any(w < 1 for w in args.world):
        raise ConfigError("--world sizes must be >= 1")
    ours = [a for a in args.algos if a in IN_TASKS]
    shards = list(getattr(args, "shards", None) or [1, 4])
    if PS in args.algos and any(k < 1 for k in shards):
        raise ConfigError("--shards counts must be >= 1")
    records: list[dict[str, Any]] = []
    if ours or PS in args.algos:
        master = args.master or f"local[{max(args.world)}]"
        spark = get_or_create_session(master, app_name="sparktrain-bench-allreduce")
        for world in args.world:
            if ours:
                securities = list(getattr(args, "security", None) or ["none"])
                records += bench_ours(spark, world, sizes, ours, securities)
                print(f"ours, world {world}: done", flush=True)
            if PS in args.algos:
                records += bench_ps(spark, world, sizes, shards)
                print(f"ps, world {world}: done", flush=True)
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
