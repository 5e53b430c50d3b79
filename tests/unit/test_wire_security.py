"""Wire security: frame MACs, TLS with a pinned certificate, delivery stamps, frame deadlines."""

from __future__ import annotations

import pickle
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from sparktrain.errors import FrameError, HandshakeError, PeerLostError
from sparktrain.wire import (
    KIND_ABORT,
    KIND_CONTROL,
    KIND_DATA,
    CommStats,
    Connection,
    Mesh,
    accept,
    address_of,
    connect,
    handshake,
    make_allreduce,
    open_listener,
    parse_address,
)
from sparktrain.wire import connection as connection_module
from sparktrain.wire.frames import (
    FLAG_STAMPED,
    FRAME_HEADER,
    MAX_NDIM,
    SHORT_HEADER_BYTES,
)
from sparktrain.wire.security import TAG_BYTES, LockedTlsSocket, WireSecurity

from . import fixtures

pytestmark = pytest.mark.timeout(60)

MAC = WireSecurity(frame_mac=True)


@pytest.fixture(scope="module")
def tls() -> WireSecurity:
    return WireSecurity.for_job("tls")


def _pair(security: WireSecurity | None, timeout: float = 2.0) -> tuple[Connection, Connection]:
    client, server = fixtures.pair(
        timeout, client_kw={"security": security}, server_kw={"security": security}
    )
    assert isinstance(client, Connection), client
    assert isinstance(server, Connection), server
    return client, server


def _header(seq: int, length: int = 16, flags: int = 0, stamp: int = 0) -> bytes:
    dims = [length // 4] + [0] * (MAX_NDIM - 1)
    dims[-1] = stamp
    return FRAME_HEADER.pack(b"STF1", KIND_DATA, 10, 1, flags, seq, length, *dims)


# ----------------------------------------------------------------------------- frame MAC


def _tamper_proxy(target: str, flip_at: int) -> tuple[socket.socket, threading.Thread]:
    """A listener that relays one client to ``target``, flipping the byte at offset
    ``flip_at`` of the client-to-server stream (an on-path attacker)."""
    listener = open_listener(fixtures.HOST)
    host, port = parse_address(target)

    def relay(src: socket.socket, dst: socket.socket, flip: int | None) -> None:
        seen = 0
        with src, dst:
            src.settimeout(5)
            while True:
                try:
                    data = bytearray(src.recv(65536))
                except OSError:
                    return
                if not data:
                    return
                if flip is not None and seen <= flip < seen + len(data):
                    data[flip - seen] ^= 0x01
                seen += len(data)
                try:
                    dst.sendall(data)
                except OSError:
                    return

    def run() -> None:
        client, _ = listener.accept()
        upstream = socket.create_connection((host, port), timeout=5)
        back = threading.Thread(target=relay, args=(upstream.dup(), client.dup(), None))
        back.start()
        relay(client, upstream, flip_at)
        back.join(5)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return listener, t


def test_a_frame_altered_in_transit_is_rejected() -> None:
    server_listener = open_listener(fixtures.HOST)
    # client -> server bytes: hello, handshake MAC, then the first frame (sealed header,
    # payload: a 1-D frame, so the short form); flip a payload bit.
    flip_at = handshake._HELLO.size + 32 + SHORT_HEADER_BYTES + TAG_BYTES + 5
    proxy, relay = _tamper_proxy(address_of(server_listener), flip_at)
    got: list[Any] = []

    def serve() -> None:
        try:
            conn = accept(
                server_listener,
                secret=fixtures.SECRET,
                job_id=fixtures.JOB,
                attempt=0,
                my_rank=1,
                timeout=5.0,
                stats=CommStats(),
                security=MAC,
            )
            out = np.empty(16, np.float32)
            conn.recv_into(out)
            got.append(out)
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client = connect(
        address_of(proxy),
        secret=fixtures.SECRET,
        job_id=fixtures.JOB,
        attempt=0,
        my_rank=0,
        peer_rank=1,
        timeout=5.0,
        stats=CommStats(),
        security=MAC,
    )
    try:
        client.send_array(np.arange(16, dtype=np.float32))
        t.join(10)
        assert isinstance(got[0], FrameError), got
        assert "MAC does not verify" in str(got[0])
    finally:
        client.close()
        proxy.close()
        server_listener.close()
        relay.join(10)


def test_an_injected_frame_with_the_right_sequence_number_is_rejected() -> None:
    client, server = _pair(MAC)
    try:
        client.send_array(np.ones(4, np.float32))  # seq 0, genuine
        out = np.empty(4, np.float32)
        server.recv_into(out)
        assert out.tolist() == [1, 1, 1, 1]
        # An attacker writes into the stream: seq 1 is right, the tag cannot be.
        forged = _header(seq=1) + bytes(TAG_BYTES) + np.zeros(4, np.float32).tobytes()
        client._sock.sendall(forged)
        with pytest.raises(FrameError, match="MAC does not verify"):
            server.recv_into(out)
        assert server.closed
    finally:
        client.close()
        server.close()


def test_a_frame_sealed_for_another_connection_is_rejected() -> None:
    """Keys are fresh per connection: a frame recorded on one does not verify on another."""
    a_client, a_server = _pair(MAC)
    b_client, b_server = _pair(MAC)
    try:
        payload = memoryview(np.zeros(4, np.float32).tobytes())
        sealed = bytes(a_client._frame_header(KIND_DATA, 10, (4,), 16, 0, 0, payload))
        b_client._sock.sendall(sealed + payload)
        with pytest.raises(FrameError, match="MAC"):
            b_server.recv_into(np.empty(4, np.float32))
    finally:
        for c in (a_client, a_server, b_client, b_server):
            c.close()


def test_a_forged_abort_notice_names_no_rank() -> None:
    client, server = _pair(MAC)
    try:
        dims = [7 + 2] + [0] * (MAX_NDIM - 1)
        header = FRAME_HEADER.pack(b"STF1", KIND_ABORT, 0, 1, 0, 0, 0, *dims)
        client._sock.sendall(header + bytes(TAG_BYTES))
        with pytest.raises(FrameError, match="MAC"):
            server.recv_bytes()
    finally:
        client.close()
        server.close()


def test_mac_connection_round_trips_and_abort_notice() -> None:
    client, server = _pair(MAC)
    try:
        arr = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
        client.send_array(arr)
        out = np.empty(15, np.float32)
        server.recv_into(out)
        assert np.array_equal(out, arr.reshape(-1))
        server.send_bytes(b'{"ok": 1}', KIND_CONTROL)
        client.send_bytes(b"", KIND_CONTROL)
        assert client.recv_bytes(KIND_CONTROL) == (KIND_CONTROL, b'{"ok": 1}')
        assert server.recv_bytes() == (KIND_CONTROL, b"")
        assert client.stats.wire_bytes_sent > 0
        assert client.notify_abort(7)
        with pytest.raises(PeerLostError, match="lost contact with rank 7"):
            server.recv_bytes()
    finally:
        client.close()
        server.close()


def test_mismatched_security_is_refused_with_a_clear_error(tls: WireSecurity) -> None:
    client, server = fixtures.pair(2.0, client_kw={"security": MAC}, server_kw={"security": None})
    assert isinstance(client, HandshakeError) and "frame_integrity" in str(client), client
    assert isinstance(server, HandshakeError)
    client, server = fixtures.pair(2.0, client_kw={"security": tls}, server_kw={"security": MAC})
    assert isinstance(client, HandshakeError | PeerLostError), client
    assert isinstance(server, HandshakeError) and "TLS" in str(server), server


# ----------------------------------------------------------------------------- TLS


def test_tls_connection_end_to_end(tls: WireSecurity) -> None:
    assert pickle.loads(pickle.dumps(tls)) == tls and tls.tls
    client, server = _pair(tls)
    try:
        assert isinstance(client._sock, LockedTlsSocket)
        big = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: many TLS records
        sender = threading.Thread(target=client.send_array, args=(big,))
        sender.start()
        out = np.empty_like(big)
        server.recv_into(out)
        sender.join(10)
        assert np.array_equal(out, big)
        server.send_bytes(b"pong", KIND_CONTROL)
        assert client.recv_bytes() == (KIND_CONTROL, b"pong")
        assert not server.peer_gone()
        client.close()
        while not server.peer_gone():  # seen soon (the test's timeout bounds the wait)
            time.sleep(0.01)
    finally:
        client.close()
        server.close()


def test_tls_client_refuses_a_certificate_with_another_fingerprint(tls: WireSecurity) -> None:
    other = WireSecurity.for_job("tls")  # another job's certificate on the server
    client, server = fixtures.pair(2.0, client_kw={"security": tls}, server_kw={"security": other})
    assert isinstance(client, HandshakeError) and "fingerprint" in str(client), client
    assert isinstance(server, HandshakeError), server


@pytest.mark.parametrize("mode", ["tls", "mac"])
def test_mesh_ring_allreduce_over_tls_and_mac(mode: str, tls: WireSecurity) -> None:
    security = tls if mode == "tls" else MAC
    listeners, addresses = fixtures.open_listeners(2)
    results: list[Any] = [None, None]

    def body(rank: int) -> None:
        try:
            with Mesh(
                rank,
                2,
                listeners[rank],
                addresses,
                fixtures.SECRET,
                fixtures.JOB,
                0,
                5.0,
                security=security,
            ) as mesh:
                # Both ranks send to and receive from each other at once, from two
                # threads on one connection: OpenSSL needs those calls serialised.
                for size, chunk in ((10_007, 4096), (4 << 20, 1 << 20)):
                    buf = np.full(size, rank + 1.0, np.float32)
                    make_allreduce("ring", mesh, chunk_bytes=chunk).allreduce_(buf)
                    results[rank] = buf
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for r in results:
        assert isinstance(r, np.ndarray), r
        assert np.all(r == 3.0)


# ----------------------------------------------------------------------------- stamps, deadlines


def test_a_stamped_frame_on_an_unshaped_connection_is_delivered_at_once() -> None:
    client, server = _pair(None, timeout=600.0)
    assert server.shaper is None
    try:
        stamp = time.time_ns() + 3600 * 10**9  # "deliver in an hour": past the test's timeout
        frame = _header(seq=0, flags=FLAG_STAMPED, stamp=stamp)
        client._sock.sendall(frame + np.ones(4, np.float32).tobytes())
        out = np.empty(4, np.float32)
        server.recv_into(out)  # at once: no link emulation here, the stamp is ignored
        assert out.tolist() == [1, 1, 1, 1]
    finally:
        client.close()
        server.close()


class _Clock:
    """The connection's clock (:mod:`time` in wire/connection.py), moved only by the
    stand-in sockets below: one ``step`` per byte they move."""

    def __init__(self, step: float) -> None:
        self.now = 1000.0
        self.step = step

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock(step=1.0)
    monkeypatch.setattr(connection_module, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


class _StandInSocket:
    """The parts of a socket a :class:`Connection` uses, for a peer that moves one byte
    per call, each call ``clock.step`` after the last: well within the per-call timeout,
    far too slow for the whole frame's deadline."""

    def __init__(self, clock: _Clock, incoming: bytes = b"") -> None:
        self.clock = clock
        self.incoming = incoming
        self.received = 0  # bytes the connection read
        self.sent = 0  # bytes the connection wrote
        self.timeout = 0.0

    def settimeout(self, timeout: float) -> None:
        self.timeout = timeout

    def getsockopt(self, *args: int) -> int:
        return 0

    def recv_into(self, view: Any, nbytes: int = 0) -> int:
        if self.received == len(self.incoming) or not len(view):
            return 0
        self.clock.now += self.clock.step
        view[0] = self.incoming[self.received]
        self.received += 1
        return 1

    def recvmsg_into(self, buffers: list[Any]) -> tuple[int, list[Any], int, None]:
        first = next(b for b in buffers if len(b))
        return self.recv_into(first), [], 0, None

    def send(self, data: Any) -> int:
        self.clock.now += self.clock.step
        self.sent += 1
        return 1

    def sendmsg(self, buffers: Any) -> int:
        return self.send(buffers)

    def sendall(self, data: Any) -> None:
        view = memoryview(data)
        while len(view):
            view = view[self.send(view) :]

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("via", ["recv_into", "recv_bytes"])
def test_a_peer_trickling_bytes_hits_the_whole_frame_deadline(via: str, clock: _Clock) -> None:
    frame = _header(seq=0) + np.ones(4, np.float32).tobytes()
    sock: Any = _StandInSocket(clock, frame)  # one byte a second
    conn = Connection(sock, peer_rank=0, my_rank=1, stats=CommStats(), timeout=1.5)
    with pytest.raises(PeerLostError, match="did not complete in time") as info:
        if via == "recv_into":
            conn.recv_into(np.empty(4, np.float32))
        else:
            conn.recv_bytes()
    assert info.value.rank == 0
    # given up 1.5 s (on the connection's clock) after the first byte, not at the frame's end
    assert sock.received == 3 and len(frame) == 104


def test_a_peer_reading_slowly_hits_the_whole_frame_deadline_on_send(clock: _Clock) -> None:
    clock.step = 0.05  # the peer reads 20 bytes a second
    sock: Any = _StandInSocket(clock)
    conn = Connection(sock, peer_rank=1, my_rank=0, stats=CommStats(), timeout=0.5)
    with pytest.raises(PeerLostError, match="did not complete in time"):
        conn.send_array(np.zeros(50, np.float32))  # 288 bytes at 20 B/s: 14 s on main
    # given up at the frame's deadline (0.5 s and change): after 11 of its 288 bytes
    assert sock.sent == 11
