"""The wire: handshake, framing, limits and failures, fuzzed from raw sockets."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
import tracemalloc
from typing import Any

import numpy as np
import pytest

from sparktrain.errors import (
    CommError,
    ConfigError,
    FrameError,
    HandshakeError,
    PeerLostError,
)
from sparktrain.wire import (
    DRIVER_RANK,
    KIND_CONTROL,
    KIND_DATA,
    KIND_METRICS,
    CommStats,
    Connection,
    accept,
    address_of,
    connect,
    handshake,
    open_listener,
    parse_address,
)
from sparktrain.wire.frames import FRAME_HEADER, HEADER_BYTES, MAX_NDIM, SHORT_HEADER_BYTES
from sparktrain.wire.handshake import PROTOCOL_VERSION, AcceptTimeout

from . import fixtures

pytestmark = pytest.mark.timeout(30)

LONG = 600.0
"""A comm timeout that outlasts the test's own: an error that comes at all did not wait
for it."""


class _Clock:
    """A stand-in for :mod:`time` in wire/handshake.py: its clock moves only by the
    sleeps asked of it (recorded in ``sleeps``)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _ok_pair(timeout: float = 2.0, **kw: Any) -> tuple[Connection, Connection]:
    client, server = fixtures.pair(timeout, **kw)
    assert isinstance(client, Connection), client
    assert isinstance(server, Connection), server
    return client, server


def _raw_header(
    kind: int = KIND_DATA,
    code: int = 10,
    shape: tuple[int, ...] = (4,),
    length: int = 16,
    seq: int = 0,
    magic: bytes = b"STF1",
) -> bytes:
    dims = list(shape) + [0] * (MAX_NDIM - len(shape))
    return FRAME_HEADER.pack(magic, kind, code, len(shape), 0, seq, length, *dims)


# ----------------------------------------------------------------------------- listeners


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "[::]", "*"])
def test_listener_refuses_wildcard_addresses(host: str) -> None:
    with pytest.raises(ConfigError, match="own address"):
        open_listener(host)


def test_listener_and_addresses() -> None:
    listener = open_listener("127.0.0.1")
    try:
        assert (listener.gettimeout() or 0) > 0
        host, port = parse_address(address_of(listener))
        assert host == "127.0.0.1" and port == listener.getsockname()[1]
    finally:
        listener.close()
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("node-7.example:4040") == ("node-7.example", 4040)


@pytest.mark.parametrize(
    "bad",
    ["", "127.0.0.1", "127.0.0.1:", ":80", "host:http", "h:0", "h:70000", "::1:80", "[::1:80"],
)
def test_parse_address_rejects_bad_input(bad: str) -> None:
    with pytest.raises(ConfigError, match="address"):
        parse_address(bad)


def test_secret_must_be_32_bytes() -> None:
    listener = open_listener("127.0.0.1")
    try:
        with pytest.raises(ConfigError, match="32"):
            connect(
                address_of(listener),
                secret=b"x" * 16,
                job_id="j",
                attempt=0,
                my_rank=0,
                peer_rank=1,
                timeout=1.0,
                stats=CommStats(),
            )
    finally:
        listener.close()


# ----------------------------------------------------------------------------- handshake


def test_handshake_proves_ranks_and_counts_bytes() -> None:
    client, server = _ok_pair()
    try:
        assert client.peer_rank == 1 and server.peer_rank == 0
        assert client.stats.wire_bytes_sent > 0
        assert client.stats.wire_bytes_sent == server.stats.wire_bytes_recv
        assert server.stats.wire_bytes_sent == client.stats.wire_bytes_recv
        assert client.stats.frames_sent == 0 and client.stats.raw_bytes_sent == 0
    finally:
        client.close()
        server.close()


def test_driver_rank_handshake() -> None:
    client, server = _ok_pair(
        client_kw={"peer_rank": DRIVER_RANK}, server_kw={"my_rank": DRIVER_RANK}
    )
    assert client.peer_rank == DRIVER_RANK and server.peer_rank == 0
    client.send_bytes(b'{"type": "step"}', KIND_METRICS)
    assert server.recv_bytes(KIND_METRICS) == (KIND_METRICS, b'{"type": "step"}')
    client.close()
    server.close()


@pytest.mark.parametrize(
    "client_kw",
    [
        {"secret": os.urandom(32)},
        {"job_id": "another-job"},
        {"attempt": 1},
    ],
    ids=["secret", "job_id", "attempt"],
)
def test_wrong_credentials_rejected_on_both_sides(client_kw: dict[str, Any]) -> None:
    # promptly, not at the timeout: waiting for it would outlast the test's own timeout
    client, server = fixtures.pair(LONG, client_kw=client_kw)
    assert isinstance(client, HandshakeError), client
    assert isinstance(server, HandshakeError), server
    assert "rejected this rank" in str(client)
    assert "rejected a client claiming rank 0" in str(server)


def test_unexpected_rank_rejected() -> None:
    client, server = fixtures.pair(2.0, server_kw={"expect_rank": 5})
    assert isinstance(client, HandshakeError), client
    assert isinstance(server, HandshakeError), server


def test_client_detects_wrong_server_rank() -> None:
    client, server = fixtures.pair(2.0, client_kw={"peer_rank": 3})
    assert isinstance(client, HandshakeError) and "rank 1, not rank 3" in str(client)
    assert isinstance(server, HandshakeError)  # the client hung up mid-handshake


def _raw_client(listener: socket.socket, payload: bytes | None, timeout: float) -> Any:
    """Connect a raw socket, send ``payload`` (or nothing) and run accept() against it."""
    raw = socket.create_connection(listener.getsockname()[:2], timeout=5)
    try:
        if payload:
            raw.sendall(payload)
        with pytest.raises(HandshakeError) as info:
            accept(
                listener,
                secret=fixtures.SECRET,
                job_id=fixtures.JOB,
                attempt=0,
                my_rank=1,
                timeout=timeout,
                stats=CommStats(),
            )
        return info.value
    finally:
        raw.close()


def test_garbage_client_rejected_promptly() -> None:
    listener = open_listener("127.0.0.1")
    try:
        # promptly, not at the timeout: waiting for it would outlast the test's own timeout
        exc = _raw_client(listener, os.urandom(4096), timeout=LONG)
        assert "not a sparktrain hello" in str(exc)
        # A plausible hello followed by a wrong proof.
        hello = handshake._HELLO.pack(b"STH1", PROTOCOL_VERSION, 0, 0, os.urandom(32))
        exc = _raw_client(listener, hello + os.urandom(32), timeout=LONG)
        assert "rejected a client claiming rank 0" in str(exc)
    finally:
        listener.close()


@pytest.mark.parametrize("payload", [None, b"STH1\x01"], ids=["silent", "partial-hello"])
def test_silent_client_times_out(payload: bytes | None) -> None:
    listener = open_listener("127.0.0.1")
    try:
        exc = _raw_client(listener, payload, timeout=0.5)
        assert "did not complete the handshake: TimeoutError" in str(exc)
        assert isinstance(exc.__cause__, TimeoutError)
    finally:
        listener.close()


def test_silent_server_and_no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    # A listener nobody accepts on: TCP connects, the handshake gets no answer.
    listener = open_listener("127.0.0.1")
    kw: dict[str, Any] = dict(
        secret=fixtures.SECRET,
        job_id=fixtures.JOB,
        attempt=0,
        my_rank=0,
        peer_rank=4,
        stats=CommStats(),
    )
    try:
        with pytest.raises(PeerLostError, match="failed: TimeoutError") as info:
            connect(address_of(listener), timeout=0.5, **kw)
        assert info.value.rank == 4
        address = address_of(listener)
    finally:
        listener.close()
    # Nothing listening any more: connection refused is retried until the deadline, on a
    # clock that only the dial's pauses move.
    clock = _Clock()
    monkeypatch.setattr(handshake, "time", clock)
    with pytest.raises(PeerLostError, match="could not connect.*ConnectionRefusedError"):
        connect(address, timeout=0.5, **kw)
    assert len(clock.sleeps) > 3 and clock.sleeps[:3] == [0.005, 0.01, 0.02]  # backing off
    assert sum(clock.sleeps) == pytest.approx(0.5)  # to the deadline, not one refusal


def test_accept_with_nobody_connecting() -> None:
    listener = open_listener("127.0.0.1", timeout=0.2)
    kw: dict[str, Any] = dict(
        secret=fixtures.SECRET, job_id=fixtures.JOB, attempt=0, my_rank=1, stats=CommStats()
    )
    try:
        with pytest.raises(AcceptTimeout, match="no peer connected within 0.2 s"):
            accept(listener, timeout=LONG, **kw)  # the listener's shorter timeout wins
        assert listener.gettimeout() == 0.2
        with pytest.raises(PeerLostError) as info:
            accept(listener, timeout=0.1, expect_rank=3, **kw)
        assert info.value.rank == 3
    finally:
        listener.close()


# ----------------------------------------------------------------------------- frames


ARRAYS: list[np.ndarray] = [
    np.arange(10, dtype=np.float32),
    np.arange(12, dtype=np.float64).reshape(3, 4),
    np.arange(24, dtype=np.int64).reshape(2, 3, 4),
    np.array(3.5, dtype=np.float64),  # 0-d
    np.zeros(0, dtype=np.float32),  # empty
    np.array([True, False, True]),
    np.arange(7, dtype=np.uint8),
    np.arange(5, dtype=np.float16),
    np.arange(4, dtype=np.int32) - 2,
    (np.arange(3) + 1j).astype(np.complex64),
    np.random.default_rng(0).standard_normal(300_000).astype(np.float32),  # > socket chunks
]


def test_array_round_trips() -> None:
    client, server = _ok_pair()
    handshake_bytes = client.stats.wire_bytes_sent
    try:
        for arr in ARRAYS:
            client.send_array(arr)
            out = np.empty_like(arr)
            server.recv_into(out)
            assert out.dtype == arr.dtype and out.shape == arr.shape
            assert out.tobytes() == arr.tobytes()
            # and back, the other way, into a 1-D buffer of the same length
            server.send_array(arr, kind=KIND_CONTROL)
            flat = np.empty(arr.size, dtype=arr.dtype)
            client.recv_into(flat, kind=KIND_CONTROL)
            assert flat.tobytes() == arr.tobytes()
        raw = sum(a.nbytes for a in ARRAYS)
        assert client.stats.raw_bytes_sent == raw  # KIND_DATA only
        assert server.stats.raw_bytes_sent == 0  # KIND_CONTROL is not counted as raw
        assert client.stats.frames_sent == server.stats.frames_recv == len(ARRAYS)
        # 1-D frames carry the short header, the others the long one
        headers = [SHORT_HEADER_BYTES if a.ndim == 1 else HEADER_BYTES for a in ARRAYS]
        assert client.stats.wire_bytes_sent == server.stats.wire_bytes_recv
        assert server.stats.wire_bytes_sent == client.stats.wire_bytes_recv
        assert client.stats.wire_bytes_sent - handshake_bytes == raw + sum(headers)
    finally:
        client.close()
        server.close()


def test_bytes_round_trip_and_limits() -> None:
    client, server = _ok_pair()
    try:
        client.send_bytes(b'{"a": 1}', KIND_CONTROL)
        client.send_bytes(b"", KIND_CONTROL)
        assert server.recv_bytes() == (KIND_CONTROL, b'{"a": 1}')
        assert server.recv_bytes(KIND_CONTROL) == (KIND_CONTROL, b"")
        client.send_bytes(b"x" * 100, KIND_CONTROL)
        with pytest.raises(FrameError, match="limit"):
            server.recv_bytes(KIND_CONTROL, max_bytes=99)
        assert server.closed
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize(
    ("out", "kind", "match"),
    [
        (np.empty(4, np.float64), KIND_DATA, "dtype"),
        (np.empty(5, np.float32), KIND_DATA, "payload bytes"),
        (np.empty(3, np.float32), KIND_DATA, "payload bytes"),
        (np.empty(4, np.float32), KIND_CONTROL, "kind"),
    ],
)
def test_recv_into_mismatch_is_a_frame_error(out: np.ndarray, kind: int, match: str) -> None:
    client, server = _ok_pair()
    try:
        client.send_array(np.arange(4, dtype=np.float32))
        with pytest.raises(FrameError, match=match):
            server.recv_into(out, kind)
        assert server.closed
        with pytest.raises(PeerLostError):  # a broken stream is not reused
            server.recv_into(np.empty(4, np.float32))
    finally:
        client.close()
        server.close()


def test_send_side_checks() -> None:
    client, server = _ok_pair(client_kw={"max_frame_bytes": 64})
    try:
        with pytest.raises(FrameError, match="C-contiguous"):
            client.send_array(np.arange(10.0)[::2])
        with pytest.raises(FrameError, match="cannot be sent"):
            client.send_array(np.array(["a"], dtype=object))
        with pytest.raises(FrameError, match="cap"):
            client.send_array(np.zeros(100))
        client.send_array(np.zeros(8))  # still usable: nothing was sent
        out = np.empty(8)
        server.recv_into(out)
    finally:
        client.close()
        server.close()


def _attack(frames: bytes, receive: Any) -> tuple[BaseException, int]:
    """Send raw ``frames`` after a valid handshake; return the receiver's error and its
    peak allocation. The connection's timeout outlasts the test's: the error is the
    frames', never a timeout's."""
    client, server = _ok_pair(timeout=LONG)
    try:
        client._sock.sendall(frames)
        tracemalloc.start()
        try:
            with pytest.raises(CommError) as info:
                receive(server)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return info.value, peak
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("via", ["recv_bytes", "recv_into"])
def test_huge_length_prefix_rejected_without_allocating(via: str) -> None:
    header = _raw_header(code=1, shape=(1 << 40,), length=1 << 40)

    def receive(conn: Connection) -> None:
        if via == "recv_bytes":
            conn.recv_bytes()
        else:
            conn.recv_into(np.empty(16, dtype=np.uint8))

    exc, peak = _attack(header, receive)
    assert isinstance(exc, FrameError) and "cap" in str(exc)
    assert peak < 1 << 20


def test_bad_magic_and_malformed_headers() -> None:
    cases = [
        (_raw_header(magic=b"HTTP"), "magic"),
        (_raw_header(code=200), "dtype code"),
        (_raw_header(shape=(5,), length=16), "does not match"),
        (b"GET / HTTP/1.1\r\n" + b"x" * HEADER_BYTES, "magic"),
    ]
    for frames, match in cases:
        exc, _ = _attack(frames, lambda c: c.recv_into(np.empty(4, np.float32)))
        assert isinstance(exc, FrameError) and match in str(exc), exc


def test_replayed_frame_rejected() -> None:
    frame = _raw_header(seq=0) + np.arange(4, dtype=np.float32).tobytes()
    got: list[np.ndarray] = []

    def receive(conn: Connection) -> None:
        for _ in range(2):
            out = np.empty(4, np.float32)
            conn.recv_into(out)
            got.append(out)

    exc, _ = _attack(frame + frame, receive)
    assert len(got) == 1 and got[0].tolist() == [0, 1, 2, 3]
    assert isinstance(exc, FrameError) and "sequence number 0, expected 1" in str(exc)


def test_truncated_frame_then_silence_times_out() -> None:
    client, server = _ok_pair(timeout=0.5)
    try:
        client._sock.sendall(_raw_header()[:40])
        with pytest.raises(PeerLostError, match="no progress for 0.5 s") as info:
            server.recv_into(np.empty(4, np.float32))
        assert info.value.rank == 0
    finally:
        client.close()
        server.close()


def test_peer_closing_is_peer_lost() -> None:
    client, server = _ok_pair(timeout=LONG)  # at once, not at the timeout
    client.close()
    with pytest.raises(PeerLostError, match="the peer closed the connection") as info:
        server.recv_bytes()
    assert info.value.rank == 0
    with pytest.raises(PeerLostError):
        server.send_array(np.zeros(3))


def test_close_wakes_a_blocked_receiver() -> None:
    client, server = _ok_pair(timeout=LONG)  # only close() can end the wait in time
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            server.recv_bytes()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    while not server._recv_lock.locked():  # the receiver is in recv_bytes
        time.sleep(0.01)
    time.sleep(0.1)  # and, very likely, blocked on the socket
    server.close()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], PeerLostError), errors
    assert "closed on this side" in str(errors[0])
    client.close()


def test_abort_notice_names_the_lost_rank() -> None:
    client, server = _ok_pair()
    assert client.notify_abort(7)
    with pytest.raises(PeerLostError, match="reported that it lost contact with rank 7") as info:
        server.recv_into(np.empty(3))
    assert info.value.rank == 7
    client.close()


# ----------------------------------------------------------------------------- stats


def test_comm_stats_merge_dict_and_pickle() -> None:
    a = CommStats(raw_bytes_sent=1, wire_bytes_sent=2, wire_bytes_recv=3, frames_sent=4)
    b = CommStats(frames_recv=5)
    a.merge(b)
    a.add_sent(10, 5, 1)
    assert a.as_dict() == {
        "raw_bytes_sent": 6,
        "wire_bytes_sent": 12,
        "wire_bytes_recv": 3,
        "frames_sent": 5,
        "frames_recv": 5,
    }
    c = pickle.loads(pickle.dumps(a))
    assert c.as_dict() == a.as_dict()
    c.add_recv(1)  # the lock came back
    assert c == CommStats(**{**a.as_dict(), "wire_bytes_recv": 4})


def test_comm_stats_thread_safe() -> None:
    stats = CommStats()

    def bump() -> None:
        for _ in range(20_000):
            stats.add_sent(1, 1, 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert stats.wire_bytes_sent == stats.raw_bytes_sent == stats.frames_sent == 80_000
