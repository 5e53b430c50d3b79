"""A hung peer in a tree allreduce whose world is not a power of two is named by every
rank: the ranks waiting on a partner that is itself waiting (on a folded rank, or in an
earlier round) wait a little longer, so the partner's own timeout and abort notice,
which name the rank that really stopped answering, reach them first. The waits stay
bounded: no receive is given more than ``1 + PATIENCE_STEP * (rounds + 1)`` timeouts
(checked on the timeouts the connections are given, not on a stopwatch)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from sparktrain.errors import PeerLostError
from sparktrain.wire import Connection, Mesh, make_allreduce
from sparktrain.wire.tree import PATIENCE_STEP, TreeAllreduce

from . import fixtures

TIMEOUT = 1.0


def _run_with_a_hung_rank(world: int, hung: int, op: str) -> list[Any]:
    release = threading.Event()

    def body(rank: int, mesh: Mesh) -> Any:
        tree = make_allreduce("tree", mesh)
        assert isinstance(tree, TreeAllreduce)
        tree.allreduce_(np.ones(8))  # every link up, every rank in step
        if rank == hung:
            release.wait(20 * TIMEOUT)  # alive, sockets open, but never answers
            return "hung"
        try:
            if op == "allreduce":
                tree.allreduce_(np.ones(1000))
            else:
                tree.allgather(np.arange(16, dtype=np.uint8), 1 << 10)
        except PeerLostError as exc:
            return exc
        finally:
            with lock:
                done[0] += 1
                if done[0] == world - 1:  # everyone else gave up: let the hung rank go
                    release.set()
        return "no error"

    lock, done = threading.Lock(), [0]
    results = fixtures.run_mesh_ranks(world, body, timeout=TIMEOUT, join_timeout=30.0)
    release.set()
    return results


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("world", "hung", "op"),
    [
        (3, 1, "allreduce"),  # rank 2 waits for the total from rank 0, which waits on 1
        (3, 2, "allreduce"),  # rank 1 waits on rank 0, which waits on its folded rank 2
        (3, 1, "allgather"),
        (3, 2, "allgather"),
        (6, 4, "allreduce"),  # a chain: 5 -> 1 -> 0 -> 4, and 2 -> 0, 3 -> 1
    ],
)
def test_every_rank_names_the_rank_that_hung(
    world: int, hung: int, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    given: list[float] = []  # every timeout a connection is given, by any rank
    set_timeout = Connection.set_timeout

    def recorded(conn: Connection, timeout: float) -> None:
        given.append(timeout)
        set_timeout(conn, timeout)

    monkeypatch.setattr(Connection, "set_timeout", recorded)
    results = _run_with_a_hung_rank(world, hung, op)
    for rank, result in enumerate(results):
        if rank == hung:
            assert result == "hung"
            continue
        assert isinstance(result, PeerLostError), f"rank {rank}: {result!r}"
        assert result.rank == hung, f"rank {rank} blamed rank {result.rank}: {result}"
    # bounded: the longest wait is (1 + PATIENCE_STEP * (rounds + 1)) timeouts, the
    # folded ranks' wait for the total
    rounds = (1 << (world.bit_length() - 1)).bit_length() - 1
    assert max(given) == pytest.approx(TIMEOUT * (1 + PATIENCE_STEP * (rounds + 1)))
