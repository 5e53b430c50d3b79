"""The handshake: a mutual challenge-response before a connection carries frames.

Every connection starts with it: both sides send a fixed-size hello with a fresh 32-byte
nonce, then prove knowledge of the per-job secret with HMAC-SHA256 over the job id, the
attempt, both ranks and both nonces. Nothing but fixed-size, bounded reads happens before
that succeeds, and the whole handshake has a deadline. With frame MACs, both sides then
derive fresh per-connection frame keys from the same inputs (never sent); under
``frame_integrity='auto'`` each side first decides from the connection's address whether
frames carry MACs (:meth:`~sparktrain.wire.security.WireSecurity.for_connection`), and
the hellos' mode bits catch any disagreement. :func:`connect`
is the client side, :func:`accept` and :func:`serve_accepted` the server side; both
return a :class:`~sparktrain.wire.connection.Connection`.

Executor-side code: this module never imports pyspark.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import logging
import os
import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import ParamSpec

from sparktrain.errors import CommError, ConfigError, HandshakeError, PeerLostError
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import MAX_FRAME_BYTES_DEFAULT
from sparktrain.wire.link import LinkProfile
from sparktrain.wire.listen import parse_address, tune_socket
from sparktrain.wire.preauth import hello_received
from sparktrain.wire.security import FrameMac, WireSecurity, describe_mode
from sparktrain.wire.stats import CommStats

log = logging.getLogger(__name__)

DRIVER_RANK = -1
"""The rank the driver uses in handshakes (metrics channel, parameter server)."""

PROTOCOL_VERSION = 2
"""What a hello announces; both ends must agree. 2: frames may take the short header
(``wire/frames.py``) and compressed messages the compact one (``compress/base.py``),
which a version-1 peer would refuse as bad magic."""
SECRET_BYTES = 32

_HELLO_MAGIC = b"STH1"
_MAC_DOMAIN = b"sparktrain-v1"
# magic, protocol version, reserved, claimed rank, nonce
_HELLO = struct.Struct("<4sHHi32s")
_MAC_BYTES = 32
# server verdict: status, server proof (zeros on rejection)
_VERDICT = struct.Struct("<B32s")
_VERDICT_OK = 0
_VERDICT_REASONS = {
    1: "the secret, job id or attempt number differ (is this peer from another job or "
    "an older attempt?)",
    2: "the server did not expect a connection from this rank",
    3: "the protocol versions differ (mixed sparktrain versions on the cluster?)",
    4: "the wire security differs (encryption/frame_integrity must be the same on every "
    "side of a job; with frame_integrity='auto' both ends must see the connection's "
    "address alike: behind a NAT or port forward, set frame_integrity to true or false)",
}


class AcceptTimeout(CommError, TimeoutError):
    """Nobody connected to a listener within the wait (see :func:`accept`)."""


def check_secret(secret: bytes) -> None:
    """Refuse a job secret that is not exactly :data:`SECRET_BYTES` bytes (ConfigError)."""
    if not isinstance(secret, bytes | bytearray) or len(secret) != SECRET_BYTES:
        got = len(secret) if isinstance(secret, bytes | bytearray) else type(secret).__name__
        raise ConfigError(
            f"the job secret must be exactly {SECRET_BYTES} random bytes (got {got}); "
            "make it with secrets.token_bytes(32) on the driver"
        )


def _mac(
    secret: bytes,
    job_id: str,
    attempt: int,
    client_rank: int,
    server_rank: int,
    client_nonce: bytes,
    server_nonce: bytes,
    role: bytes,
) -> bytes:
    job = job_id.encode("utf-8")
    message = b"".join(
        (
            _MAC_DOMAIN,
            struct.pack("<I", len(job)),
            job,
            struct.pack("<qii", attempt, client_rank, server_rank),
            client_nonce,
            server_nonce,
            role,
        )
    )
    return hmac.new(bytes(secret), message, hashlib.sha256).digest()


class _HandshakeIO:
    """Bounded, deadline-limited reads and writes on a socket before it is trusted."""

    def __init__(self, sock: socket.socket, deadline: float, stats: CommStats) -> None:
        self.sock = sock
        self.deadline = deadline
        self.stats = stats

    def _arm(self) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("handshake deadline passed")
        self.sock.settimeout(remaining)

    def send(self, data: bytes) -> None:
        self._arm()
        self.sock.sendall(data)
        self.stats.add_sent(len(data))

    def recv(self, size: int) -> bytes:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            self._arm()
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise EOFError(f"connection closed after {got} of {size} handshake bytes")
            got += n
            self.stats.add_recv(n)
        return bytes(buf)


def _new_socket(family: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    tune_socket(sock)
    return sock


def _dial(address: str, peer_rank: int, deadline: float) -> socket.socket:
    """Connect to ``address``, retrying while nothing listens there yet."""
    host, port = parse_address(address)
    delay = 0.005
    last: BaseException | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
        except socket.gaierror as exc:
            raise ConfigError(
                f"cannot resolve the address {address!r} of rank {peer_rank}: {exc}"
            ) from exc
        sock = _new_socket(family)
        sock.settimeout(remaining)
        try:
            sock.connect(sockaddr)
            return sock
        except (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError) as exc:
            # The peer's listener may not be accepting yet: retry until the deadline.
            last = exc
            sock.close()
        except OSError as exc:
            sock.close()
            last = exc
            if isinstance(exc, TimeoutError):
                break
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, 0.1)
    why = f"{type(last).__name__}: {last}" if last is not None else "no attempt finished"
    raise PeerLostError(peer_rank, f"could not connect to {address} before the deadline ({why})")


def _frame_mac(
    security: WireSecurity,
    secret: bytes,
    job_id: str,
    attempt: int,
    client_rank: int,
    server_rank: int,
    client_nonce: bytes,
    server_nonce: bytes,
    client_side: bool,
) -> FrameMac | None:
    """This side's frame keys, fresh per connection: HMAC of the secret over the job,
    both ranks, both nonces and the direction (never sent, unlike the proofs)."""
    if not security.macs_frames:
        return None
    keys = [
        _mac(secret, job_id, attempt, client_rank, server_rank, client_nonce, server_nonce, role)
        for role in (b"frame key client->server", b"frame key server->client")
    ]
    to_server, to_client = keys
    return FrameMac(to_server, to_client) if client_side else FrameMac(to_client, to_server)


_PLAIN = WireSecurity()


def _resolved(security: WireSecurity | None, sock: socket.socket, side: str) -> WireSecurity:
    """The connection's security, ``frame_integrity='auto'`` resolved from its address:
    the client's peer address (``getpeername``) is the server's own (``getsockname``),
    so both ends decide alike. A socket that cannot say counts as not loopback."""
    security = security or _PLAIN
    try:
        host = str(getattr(sock, side)()[0])
    except OSError:
        host = ""
    return security.for_connection(host)


class _Peer:
    """What the server side of a handshake proved: the rank, the (maybe TLS) socket and
    the frame keys."""

    __slots__ = ("frame_mac", "rank", "sock")

    def __init__(self, rank: int, sock: socket.socket, frame_mac: FrameMac | None) -> None:
        self.rank, self.sock, self.frame_mac = rank, sock, frame_mac


HANDSHAKE_RETRIES = 20
"""How often a dial is re-run after the server reset or closed it mid-handshake (within
the caller's timeout). A listener under a flood of strangers evicts pending handshakes
(:mod:`sparktrain.wire.preauth`), strangers that got less far first, but it may still be
this client's: a fresh dial then gets through. An authentication *rejection* is never retried."""

_P = ParamSpec("_P")


def _retry_dropped_handshakes(dial: Callable[_P, Connection]) -> Callable[_P, Connection]:
    """Re-run ``dial`` (:func:`connect`) while the server resets or closes the connection
    during the handshake, until the ``timeout`` keyword's deadline; the connection keeps
    the caller's ``timeout``. Other failures (rejections, deadlines) propagate at once."""

    @functools.wraps(dial)
    def retrying(*args: _P.args, **kwargs: _P.kwargs) -> Connection:
        timeout = kwargs.get("timeout")
        if not isinstance(timeout, int | float) or timeout <= 0:
            return dial(*args, **kwargs)  # connect() explains the bad value
        deadline = time.monotonic() + timeout
        pause = 0.01
        for attempt in range(HANDSHAKE_RETRIES + 1):
            try:
                conn = dial(*args, **kwargs)
            except PeerLostError as exc:
                dropped = isinstance(exc.__cause__, EOFError | ConnectionError | ssl.SSLEOFError)
                if not dropped or attempt == HANDSHAKE_RETRIES:
                    raise
                remaining = deadline - time.monotonic() - pause
                if remaining <= 0:
                    raise
                log.debug("handshake dropped by the server, dialing again: %s", exc)
                time.sleep(pause)
                pause = min(pause * 2, 0.2)
                kwargs["timeout"] = remaining
                continue
            if attempt:
                conn.set_timeout(float(timeout))  # the caller's, not what was left of it
            return conn
        raise AssertionError("unreachable")  # the loop returns or raises

    return retrying


@_retry_dropped_handshakes
def connect(
    address: str,
    *,
    secret: bytes,
    job_id: str,
    attempt: int,
    my_rank: int,
    peer_rank: int,
    timeout: float,
    stats: CommStats,
    max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
    link: LinkProfile | None = None,
    security: WireSecurity | None = None,
) -> Connection:
    """Dial ``address`` and run the client side of the handshake.

    ``link`` emulates a slow link on this side's sends (see :mod:`sparktrain.wire.link`).
    ``security`` (:mod:`sparktrain.wire.security`): frame MACs or TLS; ``None`` is
    plaintext without MACs. Both sides of a connection must use the same.

    Connection-refused is retried until ``timeout`` elapses (the peer's listener may
    not be accepting yet); the dial and the handshake share that deadline. Raises
    :class:`PeerLostError` if the peer cannot be reached or stops answering, and
    :class:`HandshakeError` if it answers but authentication fails either way.
    """
    check_secret(secret)
    if timeout <= 0:
        raise ConfigError(f"the comm timeout must be > 0 seconds, got {timeout}")
    deadline = time.monotonic() + timeout
    sock = _dial(address, peer_rank, deadline)
    security = _resolved(security, sock, "getpeername")
    nonce = os.urandom(32)
    mode = security.mode
    try:
        if security.tls:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock = security.wrap_client(sock, f"rank {peer_rank} at {address}")
        io = _HandshakeIO(sock, deadline, stats)
        io.send(_HELLO.pack(_HELLO_MAGIC, PROTOCOL_VERSION, mode, my_rank, nonce))
        magic, version, server_mode, server_rank, server_nonce = _HELLO.unpack(io.recv(_HELLO.size))
        if magic != _HELLO_MAGIC:
            raise HandshakeError(
                f"{address} does not speak the sparktrain protocol (is the address list stale?)"
            )
        if version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"rank {server_rank} at {address} speaks protocol version {version}, this rank "
                f"{PROTOCOL_VERSION}: run the same sparktrain version everywhere"
            )
        if server_rank != peer_rank:
            raise HandshakeError(
                f"{address} belongs to rank {server_rank}, not rank {peer_rank} "
                "(is the address list stale or from another attempt?)"
            )
        if server_mode != mode:
            raise HandshakeError(
                f"rank {peer_rank} at {address} runs {describe_mode(server_mode)}, this rank "
                f"{describe_mode(mode)}: {_VERDICT_REASONS[4]}"
            )
        io.send(_mac(secret, job_id, attempt, my_rank, server_rank, nonce, server_nonce, b"client"))
        status, proof = _VERDICT.unpack(io.recv(_VERDICT.size))
        if status != _VERDICT_OK:
            reason = _VERDICT_REASONS.get(status, f"status {status}")
            raise HandshakeError(f"rank {peer_rank} at {address} rejected this rank: {reason}")
        expected = _mac(
            secret, job_id, attempt, my_rank, server_rank, nonce, server_nonce, b"server"
        )
        if not hmac.compare_digest(proof, expected):
            raise HandshakeError(
                f"rank {peer_rank} at {address} could not prove it knows the job secret"
            )
    except HandshakeError:
        sock.close()
        raise
    except ssl.SSLError as exc:
        sock.close()
        raise HandshakeError(
            f"the TLS handshake with rank {peer_rank} at {address} failed: {exc} (is "
            "encryption='tls' set on every side of the job?)"
        ) from exc
    except (TimeoutError, EOFError, OSError) as exc:
        sock.close()
        raise PeerLostError(
            peer_rank, f"handshake with {address} failed: {type(exc).__name__}: {exc}"
        ) from exc
    frame_mac = _frame_mac(
        security, secret, job_id, attempt, my_rank, server_rank, nonce, server_nonce, True
    )
    return Connection(
        sock,
        peer_rank=peer_rank,
        my_rank=my_rank,
        stats=stats,
        timeout=timeout,
        max_frame_bytes=max_frame_bytes,
        link=link,
        frame_mac=frame_mac,
    )


def _serve_handshake(
    sock: socket.socket,
    *,
    secret: bytes,
    job_id: str,
    attempt: int,
    my_rank: int,
    deadline: float,
    stats: CommStats,
    accept_rank: Callable[[int], bool],
    security: WireSecurity | None = None,
) -> _Peer:
    """Server side of the handshake on an accepted socket; returns the proven peer
    (its rank, the socket to use, wrapped in TLS if asked, and the frame keys)."""
    security = _resolved(security, sock, "getsockname")
    nonce = os.urandom(32)
    mode = security.mode
    try:
        if security.tls:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock = security.wrap_server(sock)
        io = _HandshakeIO(sock, deadline, stats)
        hello = io.recv(_HELLO.size)
        magic, version, client_mode, client_rank, client_nonce = _HELLO.unpack(hello)
        if magic != _HELLO_MAGIC:
            hint = " (it speaks TLS: is encryption='tls' set on its side only?)"
            raise HandshakeError(
                "a client sent bytes that are not a sparktrain hello"
                + (hint if hello[:1] == b"\x16" else "")
            )
        hello_received()  # its gate now evicts it only after strangers that got less far
        io.send(_HELLO.pack(_HELLO_MAGIC, PROTOCOL_VERSION, mode, my_rank, nonce))
        client_mac = io.recv(_MAC_BYTES)
        expected = _mac(
            secret, job_id, attempt, client_rank, my_rank, client_nonce, nonce, b"client"
        )
        status = _VERDICT_OK
        if version != PROTOCOL_VERSION:
            status = 3
        elif not hmac.compare_digest(client_mac, expected):
            status = 1
        elif client_mode != mode:
            status = 4
        elif not accept_rank(client_rank):
            status = 2
        if status != _VERDICT_OK:
            with contextlib.suppress(OSError, TimeoutError):
                io.send(_VERDICT.pack(status, bytes(32)))
            raise HandshakeError(
                f"rejected a client claiming rank {client_rank}: {_VERDICT_REASONS[status]}"
            )
        proof = _mac(secret, job_id, attempt, client_rank, my_rank, client_nonce, nonce, b"server")
        io.send(_VERDICT.pack(_VERDICT_OK, proof))
    except HandshakeError:
        sock.close()
        raise
    except ssl.SSLError as exc:
        sock.close()
        raise HandshakeError(
            f"a client failed the TLS handshake: {exc} (is encryption='tls' set on every side "
            "of the job?)"
        ) from exc
    except (TimeoutError, EOFError, OSError) as exc:
        sock.close()
        raise HandshakeError(
            f"a client did not complete the handshake: {type(exc).__name__}: {exc}"
        ) from exc
    frame_mac = _frame_mac(
        security, secret, job_id, attempt, client_rank, my_rank, client_nonce, nonce, False
    )
    return _Peer(int(client_rank), sock, frame_mac)


def accept(
    listener: socket.socket,
    *,
    secret: bytes,
    job_id: str,
    attempt: int,
    my_rank: int,
    timeout: float,
    stats: CommStats,
    max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
    expect_rank: int | None = None,
    link: LinkProfile | None = None,
    security: WireSecurity | None = None,
) -> Connection:
    """Accept one connection on ``listener`` and run the server side of the handshake.

    Waits for a client at most ``timeout`` seconds, or the listener's own timeout if
    that is shorter (so a serving loop with a short listener timeout can notice it
    should stop); the handshake then has ``timeout`` seconds. Returns a
    :class:`~sparktrain.wire.connection.Connection` whose ``peer_rank`` the client proved.

    A client that fails the handshake (wrong secret/job/attempt, garbage, silence past
    ``timeout``, a rank other than ``expect_rank``, or another ``security``) is closed
    and :class:`HandshakeError` is raised; callers serving many clients catch it and
    keep accepting. If nobody connects in time: :class:`PeerLostError` naming
    ``expect_rank`` if given, else :class:`AcceptTimeout` (a ``CommError`` that is
    also a ``TimeoutError``). ``link`` emulates a slow link on this side's sends (see
    :mod:`sparktrain.wire.link`); ``security`` as for :func:`connect`.
    """
    check_secret(secret)
    if timeout <= 0:
        raise ConfigError(f"the comm timeout must be > 0 seconds, got {timeout}")
    own = listener.gettimeout()
    wait = timeout if own is None or own <= 0 else min(own, timeout)
    try:
        listener.settimeout(wait)
        try:
            sock, _ = listener.accept()
        finally:
            if own is not None and own > 0:
                listener.settimeout(own)
    except TimeoutError:
        if expect_rank is not None:
            raise PeerLostError(expect_rank, f"it did not connect within {wait:g} s") from None
        raise AcceptTimeout(f"no peer connected within {wait:g} s") from None
    except OSError as exc:
        raise CommError(f"the listener failed: {exc}") from exc
    return serve_accepted(
        sock,
        secret=secret,
        job_id=job_id,
        attempt=attempt,
        my_rank=my_rank,
        deadline=time.monotonic() + timeout,
        stats=stats,
        accept_rank=lambda r: expect_rank is None or r == expect_rank,
        timeout=timeout,
        max_frame_bytes=max_frame_bytes,
        link=link,
        security=security,
    )


HELLO_PREFIX = _HELLO_MAGIC
"""What every plaintext client sends first: the pre-auth gates
(:mod:`sparktrain.wire.preauth`) close a connection that starts otherwise before it costs
a thread. Change it with the first bytes of the client's side of the handshake."""

TLS_PREFIX = b"\x16\x03"
"""What a TLS client sends first: a handshake record (content type 22, version 3.x)."""


def first_bytes(security: WireSecurity | None) -> bytes:
    """What a client of a listener with this ``security`` sends first (TLS runs before
    the hello)."""
    return TLS_PREFIX if security is not None and security.tls else HELLO_PREFIX


def first_size(security: WireSecurity | None) -> Callable[[bytes], int]:
    """How many bytes a client's first message has, judged from its first bytes: the
    plaintext hello is fixed-size; TLS's ClientHello is one record, whose 5-byte header
    says its length. The pre-auth gates start a handshake thread only once it is all
    there."""
    if security is not None and security.tls:
        return _tls_record_size
    return lambda head: _HELLO.size


def _tls_record_size(head: bytes) -> int:
    if len(head) < 5:
        return 5  # the header first
    return 5 + int.from_bytes(head[3:5], "big")


def serve_accepted(
    sock: socket.socket,
    *,
    secret: bytes,
    job_id: str,
    attempt: int,
    my_rank: int,
    deadline: float,
    stats: CommStats,
    accept_rank: Callable[[int], bool],
    timeout: float,
    max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
    link: LinkProfile | None = None,
    security: WireSecurity | None = None,
) -> Connection:
    """The server side of the handshake on an already accepted ``sock``, finished
    before ``deadline`` (``time.monotonic()``); returns the
    :class:`~sparktrain.wire.connection.Connection` (with
    ``timeout``) whose ``peer_rank`` the client proved. ``accept_rank(rank)`` runs once
    the client's proof verified, before the verdict is sent. Raises
    :class:`HandshakeError` (``sock`` closed) otherwise. Used by :func:`accept` and by
    the pre-auth gates (:mod:`sparktrain.wire.preauth`)."""
    tune_socket(sock)
    peer = _serve_handshake(
        sock,
        secret=secret,
        job_id=job_id,
        attempt=attempt,
        my_rank=my_rank,
        deadline=deadline,
        stats=stats,
        accept_rank=accept_rank,
        security=security,
    )
    return Connection(
        peer.sock,
        peer_rank=peer.rank,
        my_rank=my_rank,
        stats=stats,
        timeout=timeout,
        max_frame_bytes=max_frame_bytes,
        link=link,
        frame_mac=peer.frame_mac,
    )
