"""Issue 31: frame MACs on by default off loopback (``frame_integrity = "auto"``), every
frame's MAC checked (abort notices too), and the payload service whose bytes a task
unpickles authenticated whatever ``frame_integrity`` says (frame MACs and an HMAC of the
blob under the job secret, checked before unpickling)."""

from __future__ import annotations

import dataclasses
import pickle
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sparktrain.config import TrainConfig, apply_overrides
from sparktrain.driver.services.payload_server import PayloadServer
from sparktrain.errors import ConfigError, FrameError, HandshakeError, PeerLostError
from sparktrain.task.payload_client import ServedTask, fetch_payload
from sparktrain.wire import KIND_ABORT, CommStats, Connection, accept, connect, open_listener
from sparktrain.wire.frames import FRAME_HEADER, MAX_NDIM
from sparktrain.wire.listen import address_of
from sparktrain.wire.security import (
    AUTO,
    TAG_BYTES,
    WireSecurity,
    is_loopback_host,
    resolve_frame_mac,
)

from . import fixtures

pytestmark = pytest.mark.timeout(60)

MAC = WireSecurity(frame_mac=True)
HOST = fixtures.HOST


def _pair(security: WireSecurity | None) -> tuple[Connection, Connection]:
    client, server = fixtures.pair(
        2.0, client_kw={"security": security}, server_kw={"security": security}
    )
    assert isinstance(client, Connection), client
    assert isinstance(server, Connection), server
    return client, server


# ----------------------------------------------------------------------- abort notices


def _forged_abort(length: int) -> bytes:
    """An abort notice naming rank 7 that claims ``length`` payload bytes, with a zero
    tag (an on-path attacker knows no frame key)."""
    dims = [7 + 2] + [0] * (MAX_NDIM - 1)
    header = FRAME_HEADER.pack(b"STF1", KIND_ABORT, 0, 1, 0, 0, length, *dims)
    return header + bytes(TAG_BYTES) + bytes(length)


@pytest.mark.parametrize("via", ["recv_bytes", "recv_into"])
def test_a_forged_abort_claiming_a_payload_names_no_rank(via: str) -> None:
    client, server = _pair(MAC)
    try:
        client._sock.sendall(_forged_abort(4))
        with pytest.raises(FrameError, match="abort notice"):
            if via == "recv_bytes":
                server.recv_bytes()
            else:
                server.recv_into(np.empty(1, np.float32))
        assert server.closed
    finally:
        client.close()
        server.close()


def test_a_genuine_abort_notice_still_names_the_lost_rank() -> None:
    client, server = _pair(MAC)
    try:
        assert client.notify_abort(7)
        with pytest.raises(PeerLostError, match="lost contact with rank 7"):
            server.recv_bytes()
    finally:
        client.close()
        server.close()


# ----------------------------------------------------------------------- auto


def test_auto_macs_frames_unless_every_address_is_loopback() -> None:
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "::ffff:127.0.0.1", "localhost"):
        assert is_loopback_host(host), host
        assert resolve_frame_mac(AUTO, [host]) is False, host
    for host in ("192.0.2.2", "10.0.0.5", "fd00::2", "fe80::1%eth0", "worker-3.example", ""):
        assert not is_loopback_host(host), host
        assert resolve_frame_mac(AUTO, [host]) is True, host
    assert resolve_frame_mac(AUTO, ["127.0.0.1", "10.0.0.5"]) is True  # one is enough
    assert resolve_frame_mac(AUTO, []) is True  # nothing proves loopback
    # explicit settings are kept as given, whatever the addresses
    assert resolve_frame_mac(False, ["10.0.0.5"]) is False
    assert resolve_frame_mac(True, ["127.0.0.1"]) is True
    with pytest.raises(ConfigError, match="true, false or 'auto'"):
        resolve_frame_mac("yes", ["127.0.0.1"])


def test_frame_integrity_defaults_to_auto_and_keeps_true_and_false() -> None:
    assert TrainConfig().frame_integrity == "auto"
    assert TrainConfig.from_dict({"frame_integrity": True}).frame_integrity is True
    assert TrainConfig.from_dict({"frame_integrity": "false"}).frame_integrity is False
    assert TrainConfig.from_dict({"frame_integrity": "auto"}).frame_integrity == "auto"
    for cli, want in (("auto", "auto"), ("true", True), ("false", False), ('"true"', True)):
        values = apply_overrides({}, [f"frame_integrity={cli}"])  # sparktrain train --set
        assert TrainConfig.from_dict(values).frame_integrity == want, cli
    with pytest.raises(ConfigError, match="frame_integrity"):
        TrainConfig(frame_integrity="sometimes")
    assert WireSecurity.for_job("none", TrainConfig().frame_integrity).frame_mac == AUTO


def _own_non_loopback_address() -> str | None:
    """An address of this host that is not loopback (the source address towards a
    documentation network: a UDP connect sends nothing), or None."""
    for target in ("192.0.2.1", "198.51.100.1", "10.255.255.1"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))
                mine = str(probe.getsockname()[0])
        except OSError:
            continue
        if not is_loopback_host(mine):
            return mine
    return None


def _auto_pair(host: str) -> tuple[Connection, Connection]:
    """A client and a server, both with ``frame_integrity='auto'``, over ``host``."""
    auto = WireSecurity(frame_mac=AUTO)
    listener = open_listener(host)
    got: list[Any] = []

    def serve() -> None:
        try:
            got.append(
                accept(
                    listener,
                    secret=fixtures.SECRET,
                    job_id=fixtures.JOB,
                    attempt=0,
                    my_rank=1,
                    timeout=5.0,
                    stats=CommStats(),
                    security=auto,
                )
            )
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        client = connect(
            address_of(listener),
            secret=fixtures.SECRET,
            job_id=fixtures.JOB,
            attempt=0,
            my_rank=0,
            peer_rank=1,
            timeout=5.0,
            stats=CommStats(),
            security=auto,
        )
    finally:
        t.join(10)
        listener.close()
    assert isinstance(got[0], Connection), got
    return client, got[0]


def test_auto_connections_agree_per_address() -> None:
    """Both ends of an 'auto' connection decide alike: plain over loopback, MACs over an
    address that is not (when this host has one), and a tampered frame is refused there."""
    client, server = _auto_pair(HOST)
    try:
        assert client._mac is None and server._mac is None
        client.send_array(np.arange(4, dtype=np.float32))
        out = np.empty(4, np.float32)
        server.recv_into(out)
        assert out.tolist() == [0, 1, 2, 3]
    finally:
        client.close()
        server.close()
    host = _own_non_loopback_address()
    if host is None:
        pytest.skip("this host has no address that is not loopback")
    client, server = _auto_pair(host)
    try:
        assert client._mac is not None and server._mac is not None
        client.send_array(np.arange(4, dtype=np.float32))
        out = np.empty(4, np.float32)
        server.recv_into(out)
        assert out.tolist() == [0, 1, 2, 3]
        forged = FRAME_HEADER.pack(b"STF1", 1, 10, 1, 0, 1, 16, 4, *[0] * (MAX_NDIM - 1))
        client._sock.sendall(forged + bytes(TAG_BYTES) + bytes(16))
        with pytest.raises(FrameError, match="MAC does not verify"):
            server.recv_into(out)
    finally:
        client.close()
        server.close()


# ----------------------------------------------------------------------- payload service

UNPICKLED: list[str] = []


def _mark_unpickled() -> str:
    UNPICKLED.append("ran")
    return "an attacker's object"


class _Evil:
    """Runs ``_mark_unpickled`` when unpickled: stands for arbitrary code."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_mark_unpickled, ())


def _task(batches: Iterator[Any]) -> Iterator[Any]:
    yield from batches


@pytest.fixture
def payloads() -> Iterator[PayloadServer]:
    # frame_integrity=false for the job: the service authenticates its frames anyway
    served = PayloadServer(
        HOST, secret=fixtures.SECRET, job_id="payload-mac", security=WireSecurity(frame_mac=False)
    )
    try:
        yield served
    finally:
        served.stop()


def test_the_payload_service_macs_its_frames_whatever_frame_integrity_says(
    payloads: PayloadServer,
) -> None:
    ref = payloads.add(b"x" * 1000, what="a test payload", timeout=5.0, remedy="")
    assert ref.security is not None and ref.security.macs_frames
    assert fetch_payload(ref, rank=0) == b"x" * 1000
    # a client speaking plain frames (what an unauthenticated stream would be) is refused
    with pytest.raises(HandshakeError, match="wire security differs"):
        fetch_payload(dataclasses.replace(ref, security=WireSecurity(frame_mac=False)), rank=0)


def test_a_tampered_task_blob_is_refused_before_unpickling(payloads: PayloadServer) -> None:
    UNPICKLED.clear()
    size = 4096  # both pickles padded alike (pickle stops at its STOP opcode)
    genuine = pickle.dumps(_task).ljust(size, b"\0")
    ref = payloads.add(genuine, what="this stage's task", timeout=5.0, remedy="")
    assert list(ServedTask(ref)(iter([1, 2]))) == [1, 2]  # the genuine blob runs
    # what an attacker who rewrote the stream (or the served bytes) would deliver
    evil = pickle.dumps(_Evil()).ljust(size, b"\0")
    payloads._payloads[ref.key] = np.frombuffer(evil, dtype=np.uint8)
    with pytest.raises(FrameError, match="HMAC"):
        ServedTask(ref)(iter([]))
    assert UNPICKLED == []
