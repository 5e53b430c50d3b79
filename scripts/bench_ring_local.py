#!/usr/bin/env python
"""Micro-benchmark: sparktrain's ring and tree allreduce vs torch.distributed Gloo.

Runs N processes (default 2) on loopback and, in the same processes and the same run,
times ``RingAllreduce``, ``TreeAllreduce`` and ``torch.distributed.all_reduce`` on the
gloo backend for float32 buffers of 4 KiB, 1 MiB, 16 MiB and 64 MiB. Prints the
median time per call and the bus bandwidth ``bytes * 2 (n - 1) / n / time``.

    .venv/bin/python scripts/bench_ring_local.py [--world 2] [--rounds 3]

Not a test: a tool to tune the comm layer. No Spark involved.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [4 << 10, 1 << 20, 16 << 20, 64 << 20]


def _iterations(nbytes: int, scale: float) -> int:
    if nbytes <= 64 << 10:
        n = 2000
    elif nbytes <= 1 << 20:
        n = 200
    elif nbytes <= 16 << 20:
        n = 30
    else:
        n = 10
    return max(3, int(n * scale))


def _time_calls(fn: Any, iterations: int) -> list[float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iterations):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _worker(rank: int, world: int, conn: Any, opts: dict[str, Any]) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from sparktrain.comm import Mesh, address_of, make_allreduce, open_listener

    torch.set_num_threads(1)
    listener = open_listener("127.0.0.1")
    conn.send(address_of(listener))
    addresses, secret, gloo_port = conn.recv()
    results: dict[str, list[float]] = {}
    mesh = Mesh(rank, world, listener, addresses, secret, "bench", 0, timeout=60.0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world
    )
    try:
        for _round in range(opts["rounds"]):
            for nbytes in opts["sizes"]:
                iters = _iterations(nbytes, opts["scale"])
                buf = np.zeros(nbytes // 4, dtype=np.float32)  # zeros: no overflow
                for algo in ("ring", "tree"):
                    kwargs = {"chunk_bytes": opts["chunk_bytes"]} if algo == "ring" else {}
                    reducer = make_allreduce(algo, mesh, **kwargs)
                    times = _time_calls(lambda r=reducer: r.allreduce_(buf), iters)
                    results.setdefault(f"{algo}:{nbytes}", []).extend(times)
                tensor = torch.zeros(nbytes // 4, dtype=torch.float32)
                times = _time_calls(lambda t=tensor: dist.all_reduce(t), iters)
                results.setdefault(f"gloo:{nbytes}", []).extend(times)
    finally:
        mesh.close()
        dist.destroy_process_group()
    conn.send(results)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="repeat the whole sweep")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply iteration counts")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="ring chunk size")
    parser.add_argument(
        "--sizes", type=str, default=",".join(str(s) for s in SIZES), help="bytes, comma-sep"
    )
    args = parser.parse_args()
    from sparktrain.comm.ring import DEFAULT_CHUNK_BYTES

    opts = {
        "rounds": args.rounds,
        "scale": args.scale,
        "chunk_bytes": args.chunk_bytes or DEFAULT_CHUNK_BYTES,
        "sizes": [int(s) for s in args.sizes.split(",")],
    }
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(args.world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(rank, args.world, child, opts), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    addresses = [p.recv() for p in pipes]
    secret, port = secrets.token_bytes(32), _free_port()
    for p in pipes:
        p.send((addresses, secret, port))
    results = [p.recv() for p in pipes]
    for p in procs:
        p.join(30)

    n = args.world
    print(f"world {n}, float32, ring chunk {opts['chunk_bytes']} B, median of all calls")
    print(f"{'size':>8} {'algo':>5} {'time':>11} {'busbw GB/s':>11} {'speed vs gloo':>14}")
    for nbytes in opts["sizes"]:
        # A call ends when the slowest rank has its result: take the max over ranks.
        med: dict[str, float] = {}
        for algo in ("ring", "tree", "gloo"):
            key = f"{algo}:{nbytes}"
            per_call = [max(ts) for ts in zip(*(r[key] for r in results), strict=True)]
            med[algo] = statistics.median(per_call)
        for algo in ("ring", "tree", "gloo"):
            t = med[algo]
            busbw = nbytes * 2 * (n - 1) / n / t / 1e9
            label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            shown = f"{t * 1e6:8.1f} us" if t < 1e-3 else f"{t * 1e3:8.2f} ms"
            print(f"{label:>8} {algo:>5} {shown:>11} {busbw:11.3f} {med['gloo'] / t:13.2f}x")


if __name__ == "__main__":
    main()
