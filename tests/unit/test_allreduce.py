"""Ring and tree allreduce against a numpy reference, with threads and processes."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import random
import threading
import time
from typing import Any

import numpy as np
import pytest

from sparktrain.errors import CommError, ConfigError, PeerLostError
from sparktrain.wire import ALLREDUCE_ALGOS, CommStats, Mesh, make_allreduce, open_listener
from sparktrain.wire.ring import RingAllreduce, ring_raw_bytes_sent, ring_segments
from sparktrain.wire.tree import TreeAllreduce

from . import fixtures

LENGTHS = [0, 1, 2, 1001, 5000]  # 5000 float32 > the 1 KiB chunks: many chunks per segment
TOL: dict[Any, float] = {np.float32: 1e-5, np.float64: 1e-12}  # rtol = atol


def _options(algo: str) -> dict[str, Any]:
    return {"chunk_bytes": 1024} if algo == "ring" else {}


def _data(world: int, length: int, dtype: Any, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 7919 * length)
    return [rng.standard_normal(length).astype(dtype) for _ in range(world)]


def _reference(data: list[np.ndarray]) -> np.ndarray:
    return np.sum(np.stack([d.astype(np.float64) for d in data]), axis=0)


def _check(outs: list[np.ndarray], data: list[np.ndarray], dtype: Any) -> None:
    ref = _reference(data)
    for out in outs:
        assert out.dtype == dtype
        np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype])
        # Every rank must hold the same bits: they all take the same optimizer step.
        assert out.tobytes() == outs[0].tobytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("algo", ["ring", "tree"])
def test_matches_numpy_reference(algo: str, world: int, dtype: Any) -> None:
    datasets = {n: _data(world, n, dtype) for n in LENGTHS}

    def body(rank: int, mesh: Mesh) -> dict[int, np.ndarray]:
        reducer = make_allreduce(algo, mesh, **_options(algo))
        outs = {}
        for n in LENGTHS:  # several lengths on one mesh: frames stay in step
            buf = datasets[n][rank].copy()
            reducer.allreduce_(buf)
            outs[n] = buf
        return outs

    results = fixtures.run_mesh_ranks(world, body)
    fixtures.raise_first(results)
    for n in LENGTHS:
        _check([r[n] for r in results], datasets[n], dtype)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("algo", "world", "length"),
    [("ring", 2, 300_000), ("ring", 3, 200_001), ("tree", 2, 100_000), ("tree", 3, 100_003)],
)
def test_large_buffers_use_the_sender_thread(algo: str, world: int, length: int) -> None:
    # Above the inline limits (a few hundred KiB) both algorithms send from the
    # background sender while receiving: exercise that path too.
    data = _data(world, length, np.float32)
    opts = {"chunk_bytes": 64 << 10} if algo == "ring" else {}

    def body(rank: int, mesh: Mesh) -> np.ndarray:
        reducer = make_allreduce(algo, mesh, **opts)
        buf = data[rank].copy()
        reducer.allreduce_(buf)
        again = data[rank].copy()
        reducer.allreduce_(again)
        assert again.tobytes() == buf.tobytes()
        return buf

    results = fixtures.run_mesh_ranks(world, body)
    fixtures.raise_first(results)
    _check(results, data, np.float32)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ["ring", "tree"])
def test_repeated_calls_on_one_mesh(algo: str) -> None:
    world, calls = 3, 5
    data = [_data(world, 777, np.float64, seed=i) for i in range(calls)]

    def body(rank: int, mesh: Mesh) -> list[np.ndarray]:
        reducer = make_allreduce(algo, mesh, **_options(algo))
        outs = []
        for i in range(calls):
            buf = data[i][rank].copy()
            reducer.allreduce_(buf)
            outs.append(buf)
        return outs

    results = fixtures.run_mesh_ranks(world, body)
    fixtures.raise_first(results)
    for i in range(calls):
        _check([r[i] for r in results], data[i], np.float64)


@pytest.mark.timeout(60)
def test_ring_and_tree_share_a_mesh() -> None:
    data = _data(4, 999, np.float32)

    def body(rank: int, mesh: Mesh) -> list[np.ndarray]:
        ring, tree = RingAllreduce(mesh, chunk_bytes=512), TreeAllreduce(mesh)
        outs = []
        for reducer in (ring, tree, ring):
            buf = data[rank].copy()
            reducer.allreduce_(buf)
            outs.append(buf)
        return outs

    results = fixtures.run_mesh_ranks(4, body)
    fixtures.raise_first(results)
    for i in range(3):
        _check([r[i] for r in results], data, np.float32)


@pytest.mark.timeout(60)
def test_processes_world_3() -> None:
    world = 3
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(world):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=fixtures.process_rank, args=(rank, world, child), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        addresses = []
        for p in pipes:
            assert p.poll(40), "a rank process did not start"
            addresses.append(p.recv())
        for p in pipes:
            p.send(addresses)
        results = []
        for p in pipes:
            assert p.poll(30), "a rank process hung"
            status, payload = p.recv()
            assert status == "ok", payload
            results.append(payload)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    data = [
        np.random.default_rng(100 + r).standard_normal(10_007).astype(np.float32)
        for r in range(world)
    ]
    for algo in ("ring", "tree"):
        _check([np.frombuffer(r[algo], dtype=np.float32) for r in results], data, np.float32)


# ----------------------------------------------------------------------------- failures


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ["ring", "tree"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_peer_dying_mid_way_is_named(algo: str, world: int) -> None:
    dead = world - 1 if world < 4 else 2
    timeout = 2.0

    def body(rank: int, mesh: Mesh) -> Any:
        reducer = make_allreduce(algo, mesh, **_options(algo))
        buf = np.ones(5000, dtype=np.float32)
        reducer.allreduce_(buf)  # everyone connected and in step
        if rank == dead:
            mesh.close()  # dies between two collectives
            return "died"
        try:
            reducer.allreduce_(buf)
        except PeerLostError as exc:
            return exc
        return "no error"

    results = fixtures.run_mesh_ranks(world, body, timeout=timeout)
    for rank, result in enumerate(results):
        if rank == dead:
            assert result == "died"
            continue
        assert isinstance(result, PeerLostError), f"rank {rank}: {result!r}"
        assert result.rank == dead, f"rank {rank}: {result}"
        assert f"rank {dead}" in str(result)


@pytest.mark.timeout(60)
def test_peer_dying_during_a_large_ring_allreduce() -> None:
    # Rank 2 vanishes while megabytes are in flight through the sender threads.
    world, dead = 3, 2
    dead_mesh: list[Mesh] = []

    def body(rank: int, mesh: Mesh) -> Any:
        reducer = RingAllreduce(mesh, chunk_bytes=16 << 10)
        buf = np.ones(2_000_000, dtype=np.float32)
        reducer.allreduce_(np.ones(10, dtype=np.float32))  # connect everybody first
        if rank == dead:
            dead_mesh.append(mesh)
        try:
            reducer.allreduce_(buf)
        except CommError as exc:
            return exc
        return "no error"

    def killer() -> None:
        deadline = time.monotonic() + 10
        while not dead_mesh and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.005)
        if dead_mesh:
            dead_mesh[0].close()

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    results = fixtures.run_mesh_ranks(world, body, timeout=2.0)
    t.join(15)
    for rank in (0, 1):
        exc = results[rank]
        assert isinstance(exc, PeerLostError), f"rank {rank}: {exc!r}"
        assert exc.rank == dead, f"rank {rank}: {exc}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("algo", "listening"), [("ring", False), ("ring", True), ("tree", True)])
def test_peer_that_never_shows_up(algo: str, listening: bool) -> None:
    # Rank 2's address was gathered, but its task never builds a mesh: either its
    # listener is gone (connection refused) or it listens but never answers.
    world, missing = 3, 2
    listeners, addresses = fixtures.open_listeners(world)
    if not listening:
        listeners[missing].close()

    def body(rank: int, mesh: Mesh) -> Any:
        try:
            make_allreduce(algo, mesh).allreduce_(np.ones(10, dtype=np.float64))
        except PeerLostError as exc:
            return exc
        return "no error"

    results = fixtures.run_mesh_ranks(
        world, body, timeout=2.0, listeners=(listeners, addresses), ranks=[0, 1]
    )
    listeners[missing].close()
    for rank in (0, 1):
        exc = results[rank]
        assert isinstance(exc, PeerLostError), f"rank {rank}: {exc!r}"
        assert exc.rank == missing, f"rank {rank}: {exc}"


@pytest.mark.timeout(60)
def test_failed_mesh_keeps_raising_the_first_error() -> None:
    def body(rank: int, mesh: Mesh) -> Any:
        reducer = make_allreduce("tree", mesh)
        reducer.allreduce_(np.ones(3))
        if rank == 1:
            mesh.close()
            return None
        errors = []
        for _ in range(2):
            try:
                reducer.allreduce_(np.ones(3))
            except PeerLostError as exc:
                errors.append(exc)
        return errors

    results = fixtures.run_mesh_ranks(2, body, timeout=2.0)
    first, second = results[0]
    assert first is second and first.rank == 1
    assert results[0] and isinstance(results[0][0], PeerLostError)


# ----------------------------------------------------------------------------- stats


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "length"), [(2, 1000), (3, 1000), (4, 4096), (5, 1001)])
def test_ring_byte_counts(world: int, length: int) -> None:
    def body(rank: int, mesh: Mesh) -> dict[str, int]:
        reducer = RingAllreduce(mesh, chunk_bytes=1024)
        reducer.allreduce_(np.ones(1, dtype=np.float32))  # connect first
        before = mesh.stats.as_dict()
        reducer.allreduce_(np.ones(length, dtype=np.float32))
        after = mesh.stats.as_dict()
        return {k: after[k] - before[k] for k in after}

    results = fixtures.run_mesh_ranks(world, body)
    fixtures.raise_first(results)
    for rank, delta in enumerate(results):
        expected = ring_raw_bytes_sent(length, world, rank, 4)
        assert delta["raw_bytes_sent"] == expected
        assert delta["wire_bytes_sent"] > delta["raw_bytes_sent"]
        assert delta["frames_sent"] == delta["frames_recv"] > 0
    if length % world == 0:
        assert results[0]["raw_bytes_sent"] == 2 * (world - 1) * length * 4 // world
    # What one rank sends, its successor receives.
    total_sent = sum(d["wire_bytes_sent"] for d in results)
    assert total_sent == sum(d["wire_bytes_recv"] for d in results)


def test_ring_segments_cover_the_buffer() -> None:
    for length in (0, 1, 5, 1001):
        for world in (1, 2, 3, 7):
            segs = ring_segments(length, world)
            assert segs[0][0] == 0 and segs[-1][1] == length
            assert all(a[1] == b[0] for a, b in itertools.pairwise(segs))
            sizes = [b - a for a, b in segs]
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.timeout(60)
def test_shared_stats_object() -> None:
    listeners, addresses = fixtures.open_listeners(2)
    shared = CommStats()
    results: list[Any] = [None, None]

    def body(rank: int) -> None:
        with Mesh(
            rank, 2, listeners[rank], addresses, fixtures.SECRET, fixtures.JOB, 0, 5.0, shared
        ) as m:
            make_allreduce("tree", m).allreduce_(np.ones(100))
            results[rank] = m.stats

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results[0] is shared and results[1] is shared
    assert shared.raw_bytes_sent == 2 * 800
    assert shared.wire_bytes_sent == shared.wire_bytes_recv


# ----------------------------------------------------------------------------- API


def test_registry_and_errors() -> None:
    assert set(ALLREDUCE_ALGOS) == {"ring", "tree"}
    listener = open_listener("127.0.0.1")
    with Mesh(0, 1, listener, ["127.0.0.1:1"], fixtures.SECRET, fixtures.JOB, 0, 1.0) as mesh:
        with pytest.raises(ConfigError, match="ring, tree"):
            make_allreduce("butterfly", mesh)
        with pytest.raises(ConfigError, match="chunk_size"):
            make_allreduce("ring", mesh, chunk_size=10)
        reducer = make_allreduce("ring", mesh)
        assert reducer.name == "ring"
        buf = np.arange(5, dtype=np.float32)
        reducer.allreduce_(buf)  # world 1: no-op
        assert buf.tolist() == [0, 1, 2, 3, 4]
        for bad in (np.ones((2, 2), np.float32), np.ones(4, np.int32), np.ones(8)[::2]):
            with pytest.raises(ConfigError):
                reducer.allreduce_(bad)
        with pytest.raises(ConfigError):
            mesh.connection(0)  # itself


def test_mesh_rejects_bad_arguments() -> None:
    listener = open_listener("127.0.0.1")
    try:
        addrs = ["127.0.0.1:1", "127.0.0.1:2"]
        with pytest.raises(ConfigError):
            Mesh(2, 2, listener, addrs, fixtures.SECRET, fixtures.JOB, 0, 1.0)
        with pytest.raises(ConfigError):
            Mesh(0, 3, listener, addrs, fixtures.SECRET, fixtures.JOB, 0, 1.0)
        with pytest.raises(ConfigError):
            Mesh(0, 2, listener, addrs, b"short", fixtures.JOB, 0, 1.0)
        with pytest.raises(ConfigError):
            Mesh(0, 2, listener, ["nonsense", "127.0.0.1:2"], fixtures.SECRET, fixtures.JOB, 0, 1.0)
        with pytest.raises(ConfigError):
            Mesh(0, 2, listener, addrs, fixtures.SECRET, fixtures.JOB, 0, 0.0)
    finally:
        listener.close()


@pytest.mark.timeout(60)
def test_connections_in_any_order_do_not_deadlock() -> None:
    world = 5

    def body(rank: int, mesh: Mesh) -> list[int]:
        peers = [p for p in range(world) if p != rank]
        random.Random(rank).shuffle(peers)
        for p in peers:
            conn = mesh.connection(p)
            assert conn.peer_rank == p
        assert mesh.connection(peers[0]) is mesh.connection(peers[0])
        return peers

    results = fixtures.run_mesh_ranks(world, body)
    fixtures.raise_first(results)


def test_close_is_idempotent() -> None:
    listener = open_listener("127.0.0.1")
    mesh = Mesh(
        1, 2, listener, ["127.0.0.1:1", "127.0.0.1:2"], fixtures.SECRET, fixtures.JOB, 0, 1.0
    )
    mesh.close()
    mesh.close()
    with pytest.raises(CommError):
        mesh.connection(0)
