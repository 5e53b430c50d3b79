"""Strangers must not delay authenticated clients (the pre-auth gate, no Spark).

A stranger connects from another loopback address (127.0.0.2 and up work on Linux
without setup) and then says nothing, or sends garbage. Every listener kind is covered:
a driver service, a parameter-server shard and a rank's mesh listener; plus the caps,
the drop-oldest rule, the pre-auth deadline and the client's retry of a dropped
handshake.

No test reads a stopwatch. Where a stranger must not have delayed a client, the gates
give strangers :data:`LONG` instead of the pre-auth deadline, longer than the test may
run: a client that had to wait for a stranger would time the test out, and the strangers
it found pending are all still pending after it was served. The deadline itself is
checked on a clock of the test's own.
"""

from __future__ import annotations

import contextlib
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from sparktrain.config import TrainConfig
from sparktrain.errors import ConfigError, HandshakeError
from sparktrain.models import mlp
from sparktrain.strategies.ps.server import start_parameter_server
from sparktrain.wire import (
    DRIVER_RANK,
    KIND_CONTROL,
    CommStats,
    Connection,
    Mesh,
    accept,
    address_of,
    connect,
    open_listener,
    parse_address,
    preauth,
)
from sparktrain.wire.handshake import HELLO_PREFIX
from sparktrain.wire.service import DriverService

HOST = "127.0.0.1"
SECRET = secrets.token_bytes(32)
JOB = "job"

pytestmark = pytest.mark.timeout(60)

LONG = 600.0
"""A pre-auth deadline for strangers that outlasts the test (see the module docstring)."""


def patient_gates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gates made from now on give a stranger :data:`LONG`, not the pre-auth deadline."""
    monkeypatch.setitem(preauth.PreauthGate.__init__.__kwdefaults__, "deadline_s", LONG)


def until(predicate: Callable[[], object]) -> None:
    """Poll ``predicate`` until it holds (the test's timeout bounds the wait)."""
    while not predicate():
        time.sleep(0.01)


class Echo(DriverService):
    """A driver service that answers one control message with the same bytes."""

    name = "echo"

    def __init__(self, attempt: int | Callable[[], int] = 0) -> None:
        super().__init__(HOST, secret=SECRET, job_id=JOB, attempt=attempt)
        self.handlers: list[threading.Thread] = []  # the threads that served a client
        self.start()

    def handle(self, conn: Connection) -> None:
        self.handlers.append(threading.current_thread())
        with contextlib.closing(conn):
            _, payload = conn.recv_bytes(KIND_CONTROL)
            conn.send_bytes(payload, KIND_CONTROL)


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Iterator[Echo]:
    """An echo service whose gate gives strangers :data:`LONG`."""
    patient_gates(monkeypatch)
    srv = Echo()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def strangers() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def open_stranger(address: str, source: str, junk: bytes = b"") -> socket.socket:
    """A TCP connection to ``address`` from ``source`` that sends ``junk`` (or nothing)."""
    host, port = parse_address(address)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    sock.bind((source, 0))
    sock.connect((host, port))
    if junk:
        sock.sendall(junk)
    return sock


def flood(
    address: str, out: list[socket.socket], count: int, sources: int = 1, first: int = 2
) -> list[socket.socket]:
    """``count`` silent strangers, spread round-robin over ``sources`` addresses."""
    mine = [open_stranger(address, f"127.0.0.{first + i % sources}") for i in range(count)]
    out.extend(mine)
    return mine


def closed_by_server(sock: socket.socket, wait: float) -> bool:
    """True once the server closed ``sock`` (it never sends first, so readable = closed)."""
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        if not sel.select(wait):
            return False
    try:
        return sock.recv(1) == b""
    except OSError:  # reset
        return True


def wait_closed(socks: list[socket.socket]) -> None:
    """Wait until the server closed every one of ``socks`` (the test's timeout bounds it)."""
    for s in socks:
        assert closed_by_server(s, None)


def echo_client(srv: DriverService, timeout: float = 8.0, *, attempt: int = 0) -> None:
    """Connect as rank 0 and round-trip one message."""
    conn = connect(
        srv.address,
        secret=SECRET,
        job_id=JOB,
        attempt=attempt,
        my_rank=0,
        peer_rank=DRIVER_RANK,
        timeout=timeout,
        stats=CommStats(),
    )
    with contextlib.closing(conn):
        conn.send_bytes(b"hello", KIND_CONTROL)
        assert conn.recv_bytes(KIND_CONTROL)[1] == b"hello"


# ------------------------------------------------------------ strangers vs. real clients


def test_silent_strangers_do_not_delay_a_driver_service_client(
    echo: Echo, strangers: list[socket.socket]
) -> None:
    # today's main handshakes in the accept loop, 10 s each: the client waits for all
    flood(echo.address, strangers, 20)
    for s in flood(echo.address, strangers, 20, first=3):
        s.sendall(HELLO_PREFIX + b"\x01\x00")  # a partial hello: waits for the rest
    until(lambda: echo._gate.pending == 40)  # every stranger accepted before the client dials
    # served while every stranger still holds its slot: none had to go (a stranger
    # holding the client up would have held it for LONG)
    echo_client(echo)
    assert echo._gate.pending == 40
    for t in echo.handlers:  # the client's own handshake thread may still be closing
        t.join(5)
    # a stranger that is silent, or stops mid-hello, costs a selector entry, not a
    # thread (today's main: a thread for each partial hello)
    handshakes = [t for t in threading.enumerate() if t.name == "sparktrain-echo-preauth"]
    assert handshakes == []


def test_silent_strangers_do_not_delay_a_parameter_server_client(
    strangers: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    patient_gates(monkeypatch)
    cfg = TrainConfig(strategy="ps", ps_shards=1, comm_timeout=10.0, num_workers=1)
    server = start_parameter_server(
        mlp(4, (8,), 3), cfg, host=HOST, secret=SECRET, job_id=JOB, attempt=0, world_size=1
    )
    try:
        flood(server.addresses[0], strangers, 30, sources=2)
        gate = server.shards[0]._gate
        until(lambda: gate.pending == 30)
        conn = connect(
            server.addresses[0],
            secret=SECRET,
            job_id=JOB,
            attempt=0,
            my_rank=0,
            peer_rank=DRIVER_RANK,
            timeout=8.0,
            stats=CommStats(),
        )
        conn.close()
        assert gate.pending == 30  # it got in past every stranger, none evicted or expired
    finally:
        server.stop()


def test_silent_strangers_do_not_keep_a_lower_rank_out_of_a_mesh(
    strangers: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    # today's main refuses new clients once 2 * world + 8 handshakes are pending,
    # and a pending one holds its slot for the whole comm timeout
    patient_gates(monkeypatch)
    listeners = [open_listener(HOST) for _ in range(2)]
    addresses = [address_of(s) for s in listeners]
    meshes = [
        Mesh(r, 2, listeners[r], addresses, SECRET, JOB, attempt=0, timeout=10.0) for r in range(2)
    ]
    try:
        flood(addresses[1], strangers, 40, sources=4)
        until(lambda: meshes[1]._gate.pending == 40)
        accepted: list[Any] = []
        t = threading.Thread(target=lambda: accepted.append(meshes[1].connection(0)))
        t.start()
        meshes[0].connect_all([1])
        t.join()
        assert accepted and accepted[0].peer_rank == 0
        # the mesh is complete: its gate let go of every stranger (long before LONG)
        wait_closed(strangers)
    finally:
        for m in meshes:
            m.close()


# ------------------------------------------------------------ caps, drop-oldest, deadline


def test_one_source_keeps_at_most_its_cap_and_loses_its_oldest_first(
    echo: Echo, strangers: list[socket.socket]
) -> None:
    cap, extra = preauth.MAX_PENDING_PER_SOURCE, 6
    others = flood(echo.address, strangers, 4, first=9)  # another host, older
    mine = flood(echo.address, strangers, cap + extra, first=2)
    wait_closed(mine[:extra])  # evicted: no deadline comes within the test
    assert not any(closed_by_server(s, 0.0) for s in mine[extra:])
    assert not any(closed_by_server(s, 0.0) for s in others)  # a flood never evicts others
    assert echo._gate.pending_from("127.0.0.2") == cap


def test_when_full_the_oldest_stranger_is_dropped_not_the_new_client(
    strangers: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    # every loopback address is one prefix: lift its cap to reach the total one from here
    monkeypatch.setattr(preauth, "MAX_PENDING_PER_PREFIX", preauth.MAX_PENDING)
    patient_gates(monkeypatch)
    echo = Echo()
    try:
        _fill_then_dial(echo, strangers)
    finally:
        echo.stop()


def _fill_then_dial(echo: Echo, strangers: list[socket.socket]) -> None:
    total, extra = preauth.MAX_PENDING, 5
    sources = -(-total // preauth.MAX_PENDING_PER_SOURCE) + 1  # no source at its own cap
    oldest = flood(echo.address, strangers, extra, first=2)
    rest = flood(echo.address, strangers, total, sources=sources, first=3)
    wait_closed(oldest)  # evicted: no deadline comes within the test
    assert not any(closed_by_server(s, 0.0) for s in rest[extra:])
    assert echo._gate.pending == total
    # the newest connection is never the one refused
    echo_client(echo)


class GateClock:
    """The gate's clock (:mod:`time` in wire/preauth.py), moved by the test only;
    ``calls`` counts the gate's looks at it (it looks at least once a turn)."""

    def __init__(self) -> None:
        self.now = time.monotonic()
        self.calls = 0

    def monotonic(self) -> float:
        self.calls += 1
        return self.now

    def turns(self) -> None:
        """Return once the gate has been round its loop since the call (a turn looks at
        the clock at most twice, plus once per accept; the last look is its expiry)."""
        seen = self.calls
        until(lambda: self.calls >= seen + 3)


def test_a_silent_stranger_is_closed_after_the_pre_auth_deadline(
    strangers: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    # today's main gives it 10 s (the old handshake timeout)
    clock = GateClock()
    monkeypatch.setattr(
        preauth, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep)
    )
    echo = Echo()
    try:
        (sock,) = flood(echo.address, strangers, 1)
        until(lambda: echo._gate.pending == 1)
        clock.now += preauth.PREAUTH_DEADLINE_S - 0.01
        clock.turns()
        assert not closed_by_server(sock, 0.0)  # not before its deadline
        assert echo._gate.pending == 1
        clock.now += 0.02
        wait_closed([sock])  # the gate's next turn closes it
        assert echo._gate.pending == 0
    finally:
        echo.stop()


def test_a_garbage_stranger_is_closed_at_once(echo: Echo, strangers: list[socket.socket]) -> None:
    sock = open_stranger(echo.address, "127.0.0.2", secrets.token_bytes(200))
    strangers.append(sock)
    wait_closed([sock])  # for its garbage: no deadline comes within the test


def test_the_gate_rejects_bad_limits() -> None:
    with socket.socket() as s, pytest.raises(ValueError, match="positive"):
        preauth.PreauthGate(
            s, name="x", handshake=lambda *a: None, on_ready=lambda r: None, max_pending=0
        )


class _CloseMidStep(preauth.PreauthGate[None]):
    """A gate whose close() comes from another thread while a step has a pending
    socket in hand: after its first peek, before it goes into the selector."""

    def _look(self, key: int, entry: Any) -> bool:
        closer = threading.Thread(target=self.close)
        closer.start()
        closer.join(5)
        return False  # its first message is not complete yet: the step registers it


def test_a_close_from_another_thread_mid_step_leaves_the_gate_thread_whole() -> None:
    # a close() that closed the socket under the step would raise "ValueError: Invalid
    # file descriptor: -1" out of serve() as the step registers it, ending the gate's thread
    listener = socket.create_server((HOST, 0))
    gate = _CloseMidStep(
        listener, name="race", handshake=lambda *a: None, on_ready=lambda r: None, poll_s=0.05
    )
    client = socket.create_connection(listener.getsockname(), timeout=5)
    try:
        gate.serve(lambda: False)  # returns once close() set the gate closed; raises nothing
        assert client.recv(1) == b""  # and the pending stranger was dropped on the way out
    finally:
        client.close()
        listener.close()


class Moving(Echo):
    """An echo service that lives across stage attempts (as a parameter-server shard)."""

    name = "moving"

    def __init__(self) -> None:
        self.current = 0
        self.ticks = 0
        super().__init__(attempt=lambda: self.current)

    def tick(self) -> None:
        self.ticks += 1


def test_a_service_across_attempts_proves_the_current_attempt_and_ticks() -> None:
    srv = Moving()
    try:
        echo_client(srv)
        srv.current = 1  # read by every handshake that starts from now on
        with pytest.raises(HandshakeError):
            echo_client(srv, attempt=0)
        echo_client(srv, attempt=1)
        assert srv.ticks > 0  # the accept loop's housekeeping runs on every turn
    finally:
        srv.stop()


# ------------------------------------------------------------ the client retries a drop


@pytest.mark.parametrize("how", ["reset", "eof"])
def test_a_dial_dropped_during_the_handshake_is_retried(how: str) -> None:
    listener = open_listener(HOST, timeout=5.0)
    served: list[Any] = []

    def server() -> None:
        first, _ = listener.accept()
        first.recv(16)  # the client's hello is on its way: drop it mid-handshake
        if how == "reset":
            first.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        first.close()
        served.append(
            accept(
                listener,
                secret=SECRET,
                job_id=JOB,
                attempt=0,
                my_rank=DRIVER_RANK,
                timeout=5.0,
                stats=CommStats(),
            )
        )

    t = threading.Thread(target=server)
    t.start()
    try:
        conn = connect(
            address_of(listener),
            secret=SECRET,
            job_id=JOB,
            attempt=0,
            my_rank=0,
            peer_rank=DRIVER_RANK,
            timeout=5.0,
            stats=CommStats(),
        )
        t.join(5)
        assert served and served[0].peer_rank == 0
        assert conn.timeout == 5.0  # the caller's timeout, not what was left of it
        conn.close()
        served[0].close()
    finally:
        t.join(5)
        listener.close()


def test_an_authentication_rejection_is_not_retried() -> None:
    listener = open_listener(HOST, timeout=5.0)
    seen: list[str] = []

    def server() -> None:
        with contextlib.suppress(HandshakeError):
            accept(
                listener,
                secret=SECRET,
                job_id=JOB,
                attempt=0,
                my_rank=DRIVER_RANK,
                timeout=2.0,
                stats=CommStats(),
            )
        seen.append("refused")
        listener.settimeout(1.0)
        with contextlib.suppress(TimeoutError):  # a retry would show up here
            again, _ = listener.accept()
            again.close()
            seen.append("dialed again")

    t = threading.Thread(target=server)
    t.start()
    try:
        with pytest.raises(HandshakeError, match="rejected"):
            connect(
                address_of(listener),
                secret=secrets.token_bytes(32),
                job_id=JOB,
                attempt=0,
                my_rank=0,
                peer_rank=DRIVER_RANK,
                timeout=5.0,
                stats=CommStats(),
            )
        t.join(5)
        assert seen == ["refused"]  # one refused handshake, then nobody
    finally:
        t.join(5)
        listener.close()


# ------------------------------------------------------------ IPv4-mapped wildcards


@pytest.mark.parametrize("host", ["::ffff:0.0.0.0", "[::ffff:0.0.0.0]", "::ffff:0:0"])
def test_an_ipv4_mapped_wildcard_is_refused(host: str) -> None:
    # today's main binds it: on a dual-stack host that is every IPv4 interface
    with pytest.raises(ConfigError, match="wildcard"):
        open_listener(host)
