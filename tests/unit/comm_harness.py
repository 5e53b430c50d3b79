"""Helpers for the comm tests: ranks as threads (or processes), connection pairs.

No Spark: a "world" is N threads (or processes) on loopback, each with its own
listener and :class:`Mesh`, the addresses exchanged in a plain list.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sparktrain.comm import (
    CommStats,
    Connection,
    Mesh,
    accept,
    address_of,
    connect,
    make_allreduce,
    open_listener,
)

SECRET = bytes(range(32))
JOB = "test-job"
HOST = "127.0.0.1"


def open_listeners(world: int) -> tuple[list[Any], list[str]]:
    listeners = [open_listener(HOST) for _ in range(world)]
    return listeners, [address_of(lst) for lst in listeners]


def run_ranks(
    world: int,
    fn: Callable[[int, Mesh], Any],
    *,
    timeout: float = 5.0,
    join_timeout: float = 30.0,
    listeners: tuple[list[Any], list[str]] | None = None,
    ranks: list[int] | None = None,
) -> list[Any]:
    """Run ``fn(rank, mesh)`` on one thread per rank; returns results or exceptions.

    ``ranks`` limits which ranks run (the others never show up). Meshes are closed
    when ``fn`` returns or raises.
    """
    listeners_, addresses = listeners if listeners is not None else open_listeners(world)
    results: list[Any] = [None] * world

    def body(rank: int) -> None:
        try:
            mesh = Mesh(rank, world, listeners_[rank], addresses, SECRET, JOB, 0, timeout)
        except BaseException as exc:
            results[rank] = exc
            return
        try:
            results[rank] = fn(rank, mesh)
        except BaseException as exc:
            results[rank] = exc
        finally:
            mesh.close()

    threads = [
        threading.Thread(target=body, args=(r,), daemon=True)
        for r in (ranks if ranks is not None else range(world))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        assert not t.is_alive(), "a rank thread hung"
    return results


def raise_first(results: list[Any]) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


def pair(
    timeout: float = 2.0,
    *,
    client_kw: dict[str, Any] | None = None,
    server_kw: dict[str, Any] | None = None,
) -> tuple[Connection | BaseException, Connection | BaseException]:
    """Connect a client (rank 0) to a server (rank 1); returns (client, server) or errors."""
    listener = open_listener(HOST)
    addr = address_of(listener)
    server: list[Connection | BaseException] = []

    def serve() -> None:
        kw: dict[str, Any] = dict(
            secret=SECRET, job_id=JOB, attempt=0, my_rank=1, timeout=timeout, stats=CommStats()
        )
        kw.update(server_kw or {})
        try:
            server.append(accept(listener, **kw))
        except BaseException as exc:
            server.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    kw: dict[str, Any] = dict(
        secret=SECRET,
        job_id=JOB,
        attempt=0,
        my_rank=0,
        peer_rank=1,
        timeout=timeout,
        stats=CommStats(),
    )
    kw.update(client_kw or {})
    try:
        client: Connection | BaseException = connect(addr, **kw)
    except BaseException as exc:
        client = exc
    t.join(timeout + 5)
    listener.close()
    assert server, "the server side hung"
    return client, server[0]


def process_rank(rank: int, world: int, conn: Any) -> None:
    """Entry point of one rank in a separate process (multiprocessing spawn).

    Runs three ring then three tree allreduces of rank-seeded data on one mesh and
    sends back the last result of each.
    """
    try:
        listener = open_listener(HOST)
        conn.send(address_of(listener))
        addresses = conn.recv()
        rng = np.random.default_rng(100 + rank)
        buf = rng.standard_normal(10_007).astype(np.float32)
        outs = {}
        with Mesh(rank, world, listener, addresses, SECRET, JOB, 0, 10.0) as mesh:
            for algo, opts in (("ring", {"chunk_bytes": 4096}), ("tree", {})):
                reducer = make_allreduce(algo, mesh, **opts)
                for _ in range(3):
                    out = buf.copy()
                    reducer.allreduce_(out)
                outs[algo] = out.tobytes()
        conn.send(("ok", outs))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
