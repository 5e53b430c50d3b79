"""The driver-hosted all-gather that replaces Spark's polled allGather (no Spark here)."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator

import pytest

from sparktrain.driver.services.rendezvous import RendezvousServer, all_gather
from sparktrain.errors import CommError, HandshakeError, PeerLostError
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_CONTROL
from sparktrain.wire.handshake import DRIVER_RANK, connect
from sparktrain.wire.stats import CommStats

from .fixtures import run_ranks

HOST = "127.0.0.1"
SECRET = secrets.token_bytes(32)
LONG = 900.0  # a comm timeout that outlasts the test's own (600 s)


@pytest.fixture
def server() -> Iterator[RendezvousServer]:
    srv = RendezvousServer(HOST, secret=SECRET, job_id="job", attempt=0, world_size=3)
    try:
        yield srv
    finally:
        srv.stop()


def gather(srv: RendezvousServer, rank: int, message: str, **kw: object) -> list[str]:
    args: dict[str, object] = {
        "secret": SECRET,
        "job_id": "job",
        "attempt": 0,
        "rank": rank,
        "message": message,
        "timeout": 10.0,
        **kw,
    }
    return all_gather(srv.address, **args)  # type: ignore[arg-type]


def test_every_rank_gets_every_message_in_rank_order(server: RendezvousServer) -> None:
    # the answer comes with the last rank's message, not at a timeout (the ranks' outlasts
    # the test's); how much sooner than Spark's once-a-second allGather poll is a
    # benchmark's question (time to the first step: python -m benchmarks train)
    out = run_ranks(3, lambda rank, _: gather(server, rank, f"m{rank}", timeout=LONG))
    assert out == [["m0", "m1", "m2"]] * 3
    assert server.rounds_completed == 1


def test_a_task_without_the_job_secret_is_refused(server: RendezvousServer) -> None:
    with pytest.raises(HandshakeError):
        gather(server, 0, "m0", secret=secrets.token_bytes(32))
    with pytest.raises(HandshakeError):
        gather(server, 0, "m0", attempt=1)  # a straggler of another attempt
    # the refusals left nothing behind: the real ranks still meet
    assert run_ranks(3, lambda rank, _: gather(server, rank, str(rank)), timeout=20)[0] == [
        "0",
        "1",
        "2",
    ]


def test_a_rank_outside_the_world_is_told_so(server: RendezvousServer) -> None:
    with pytest.raises(CommError, match="outside world size 3"):
        gather(server, 5, "m5")


def test_missing_peers_end_in_a_comm_error_at_the_timeout(server: RendezvousServer) -> None:
    with pytest.raises(CommError, match=r"did not all reach the rendezvous within 0\.5 s") as err:
        gather(server, 0, "m0", timeout=0.5)
    cause = err.value.__cause__
    assert isinstance(cause, PeerLostError) and "no progress for 0.5 s" in str(cause)


def test_a_dead_task_never_joins_a_round(server: RendezvousServer) -> None:
    # rank 0 of a stage that was then killed: sent its message, closed its socket
    conn = connect(
        server.address,
        secret=SECRET,
        job_id="job",
        attempt=0,
        my_rank=0,
        peer_rank=DRIVER_RANK,
        timeout=5,
        stats=CommStats(),
    )
    conn.send_bytes(json.dumps({"message": "stale"}).encode(), KIND_CONTROL)
    time.sleep(0.2)
    conn.close()
    time.sleep(0.2)

    # the retried stage: ranks 1 and 2 first, then the new rank 0
    def retried(rank: int, _: object) -> list[str]:
        time.sleep(0.3 if rank == 0 else 0.0)
        return gather(server, rank, f"new{rank}")

    out = run_ranks(3, retried, timeout=20)
    assert out == [["new0", "new1", "new2"]] * 3


def test_stop_releases_a_waiting_task_promptly() -> None:
    srv = RendezvousServer(HOST, secret=SECRET, job_id="job", attempt=0, world_size=2)
    waiting = threading.Event()
    handle = srv.handle

    def handle_then_tell(conn: Connection) -> None:
        handle(conn)  # rank 0's message is in: it waits for rank 1
        waiting.set()

    srv.handle = handle_then_tell  # type: ignore[method-assign]
    stopper = threading.Thread(target=lambda: (waiting.wait(), srv.stop()), daemon=True)
    stopper.start()
    try:
        # at the stop, not the timeout (which outlasts the test)
        with pytest.raises(CommError, match="did not all reach the rendezvous") as err:
            gather(srv, 0, "m0", timeout=LONG)
    finally:
        srv.stop()
    assert "the peer closed the connection" in str(err.value.__cause__)


def test_refuses_to_listen_on_every_interface() -> None:
    from sparktrain.errors import ConfigError

    with pytest.raises(ConfigError):
        RendezvousServer("0.0.0.0", secret=SECRET, job_id="job", attempt=0, world_size=2)
