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
from sparktrain.wire.frames import FRAME_HEADER, HEADER_BYTES, MAX_NDIM
from sparktrain.wire.handshake import PROTOCOL_VERSION, AcceptTimeout

from . import fixtures

pytestmark = pytest.mark.timeout(30)


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
@pytest.mark.timing
def test_wrong_credentials_rejected_on_both_sides(client_kw: dict[str, Any]) -> None:
    started = time.monotonic()
    client, server = fixtures.pair(10.0, client_kw=client_kw)
    assert isinstance(client, HandshakeError), client
    assert isinstance(server, HandshakeError), server
    assert "rejected" in str(client)
    assert time.monotonic() - started < 5.0  # promptly, not at the timeout


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
        started = time.monotonic()
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
        return info.value, time.monotonic() - started
    finally:
        raw.close()


@pytest.mark.timing
def test_garbage_client_rejected_promptly() -> None:
    listener = open_listener("127.0.0.1")
    try:
        exc, elapsed = _raw_client(listener, os.urandom(4096), timeout=10.0)
        assert "not a sparktrain hello" in str(exc)
        assert elapsed < 5.0  # promptly, not at the timeout
        # A plausible hello followed by a wrong proof.
        hello = handshake._HELLO.pack(b"STH1", PROTOCOL_VERSION, 0, 0, os.urandom(32))
        exc, elapsed = _raw_client(listener, hello + os.urandom(32), timeout=10.0)
        assert "rejected" in str(exc)
        assert elapsed < 5.0
    finally:
        listener.close()


@pytest.mark.timing
@pytest.mark.parametrize("payload", [None, b"STH1\x01"], ids=["silent", "partial-hello"])
def test_silent_client_times_out(payload: bytes | None) -> None:
    listener = open_listener("127.0.0.1")
    try:
        exc, elapsed = _raw_client(listener, payload, timeout=0.5)
        assert "did not complete the handshake" in str(exc)
        assert 0.4 < elapsed < 5.0
    finally:
        listener.close()


@pytest.mark.timing
def test_silent_server_and_no_server() -> None:
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
        started = time.monotonic()
        with pytest.raises(PeerLostError) as info:
            connect(address_of(listener), timeout=0.5, **kw)
        assert info.value.rank == 4
        assert time.monotonic() - started < 5.0
        address = address_of(listener)
    finally:
        listener.close()
    # Nothing listening any more: connection refused is retried until the deadline.
    started = time.monotonic()
    with pytest.raises(PeerLostError, match="could not connect"):
        connect(address, timeout=0.5, **kw)
    assert 0.4 < time.monotonic() - started < 5.0


@pytest.mark.timing
def test_accept_with_nobody_connecting() -> None:
    listener = open_listener("127.0.0.1", timeout=0.2)
    kw: dict[str, Any] = dict(
        secret=fixtures.SECRET, job_id=fixtures.JOB, attempt=0, my_rank=1, stats=CommStats()
    )
    try:
        started = time.monotonic()
        with pytest.raises(AcceptTimeout):
            accept(listener, timeout=30.0, **kw)  # the listener's shorter timeout wins
        assert time.monotonic() - started < 10.0
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
        wire_bytes = raw + len(ARRAYS) * HEADER_BYTES
        assert client.stats.wire_bytes_sent == server.stats.wire_bytes_recv
        assert server.stats.wire_bytes_sent == client.stats.wire_bytes_recv
        assert client.stats.wire_bytes_sent > wire_bytes  # plus the handshake
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


def _attack(frames: bytes, receive: Any) -> tuple[BaseException, float, int]:
    """Send raw ``frames`` after a valid handshake; return the receiver's error (and how
    long it took: well under the connection's 10 s timeout, it was not a timeout)."""
    client, server = _ok_pair(timeout=10.0)
    try:
        client._sock.sendall(frames)
        started = time.monotonic()
        tracemalloc.start()
        try:
            with pytest.raises(CommError) as info:
                receive(server)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return info.value, time.monotonic() - started, peak
    finally:
        client.close()
        server.close()


@pytest.mark.timing
@pytest.mark.parametrize("via", ["recv_bytes", "recv_into"])
def test_huge_length_prefix_rejected_without_allocating(via: str) -> None:
    header = _raw_header(code=1, shape=(1 << 40,), length=1 << 40)

    def receive(conn: Connection) -> None:
        if via == "recv_bytes":
            conn.recv_bytes()
        else:
            conn.recv_into(np.empty(16, dtype=np.uint8))

    exc, elapsed, peak = _attack(header, receive)
    assert isinstance(exc, FrameError) and "cap" in str(exc)
    assert elapsed < 5.0
    assert peak < 1 << 20


@pytest.mark.timing
def test_bad_magic_and_malformed_headers() -> None:
    cases = [
        (_raw_header(magic=b"HTTP"), "magic"),
        (_raw_header(code=200), "dtype code"),
        (_raw_header(shape=(5,), length=16), "does not match"),
        (b"GET / HTTP/1.1\r\n" + b"x" * HEADER_BYTES, "magic"),
    ]
    for frames, match in cases:
        exc, elapsed, _ = _attack(frames, lambda c: c.recv_into(np.empty(4, np.float32)))
        assert isinstance(exc, FrameError) and match in str(exc), exc
        assert elapsed < 5.0


@pytest.mark.timing
def test_replayed_frame_rejected() -> None:
    frame = _raw_header(seq=0) + np.arange(4, dtype=np.float32).tobytes()
    got: list[np.ndarray] = []

    def receive(conn: Connection) -> None:
        for _ in range(2):
            out = np.empty(4, np.float32)
            conn.recv_into(out)
            got.append(out)

    exc, elapsed, _ = _attack(frame + frame, receive)
    assert len(got) == 1 and got[0].tolist() == [0, 1, 2, 3]
    assert isinstance(exc, FrameError) and "sequence number 0, expected 1" in str(exc)
    assert elapsed < 5.0


@pytest.mark.timing
def test_truncated_frame_then_silence_times_out() -> None:
    client, server = _ok_pair(timeout=0.5)
    try:
        client._sock.sendall(_raw_header()[:40])
        started = time.monotonic()
        with pytest.raises(PeerLostError, match="no progress") as info:
            server.recv_into(np.empty(4, np.float32))
        assert info.value.rank == 0
        assert time.monotonic() - started < 5.0
    finally:
        client.close()
        server.close()


@pytest.mark.timing
def test_peer_closing_is_peer_lost() -> None:
    client, server = _ok_pair(timeout=10.0)
    client.close()
    started = time.monotonic()
    with pytest.raises(PeerLostError, match="closed the connection") as info:
        server.recv_bytes()
    assert info.value.rank == 0
    assert time.monotonic() - started < 5.0  # at once, not at the timeout
    with pytest.raises(PeerLostError):
        server.send_array(np.zeros(3))


@pytest.mark.timing
def test_close_wakes_a_blocked_receiver() -> None:
    client, server = _ok_pair(timeout=30.0)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            server.recv_bytes()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    started = time.monotonic()
    server.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - started < 10.0
    assert isinstance(errors[0], PeerLostError)
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
