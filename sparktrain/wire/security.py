"""Wire security: per-frame MACs and TLS with an ephemeral, pinned per-job certificate.

The handshake (:mod:`sparktrain.wire.handshake`) proves that both ends know the job secret,
but without more the frames that follow carry no integrity: sequence numbers are
predictable, so an on-path attacker could inject or alter frames. Two defences, chosen
per job by ``TrainConfig.encryption`` and ``TrainConfig.frame_integrity``:

* **Frame MAC** (``frame_integrity``): every frame carries a 16-byte tag right after
  its header, AES-256-GMAC over the header (which holds the sequence number) and the
  payload, under a key per connection and direction derived from the handshake (the
  job secret and both fresh nonces), with the sequence number as the GCM nonce. A frame
  whose tag does not verify is a :class:`~sparktrain.errors.FrameError` that closes the
  connection. GMAC runs on AES-NI/PCLMUL at well over 10 GB/s (HMAC-SHA256 at ~1.4 GB/s
  would cost the ring most of its bandwidth); see docs/security.md for the measured cost.
* **TLS** (``encryption = "tls"``): every socket runs TLS (stdlib :mod:`ssl`). The driver
  makes a self-signed certificate for the job (:meth:`WireSecurity.for_job`); the PEM
  cert and key and the certificate's SHA-256 fingerprint travel with the job secret.
  Clients do not trust any CA or host name: they pin the fingerprint. The HMAC
  handshake still runs, inside TLS. TLS already authenticates every record, so frames
  carry no extra MAC then.

``frame_integrity = "auto"`` (the default) decides per connection: frame MACs on unless
the connection runs over a loopback address, where no frame leaves the host. Both ends
decide from the same address (the client from the address it reached, the server from
the address it was reached on: :meth:`WireSecurity.for_connection`), so they agree
without a word; where a NAT or port forward makes them see different addresses, the
handshake refuses the mismatch with an error that says to set ``true`` or ``false``.

A :class:`WireSecurity` is a small frozen, picklable value; ``connect``/``accept``/
``Mesh``/``DriverService`` take it as ``security=`` (``None``: plaintext, no MAC).

Executor-side code: this module never imports pyspark.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import selectors
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sparktrain.errors import ConfigError, HandshakeError

Buffer = bytes | bytearray | memoryview

TAG_BYTES = 16
"""Bytes of a frame MAC (the GCM tag)."""

MODE_MAC = 1
MODE_TLS = 2
"""Bits of the security mode a hello announces (so a mismatch gets a clear error)."""

AUTO = "auto"
"""``frame_mac``/``frame_integrity`` value: MACs on every connection not over loopback."""

FrameMacSetting = bool | str
"""``True``, ``False`` or :data:`AUTO`."""


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address as sockets report it, or ``localhost``) is loopback:
    127.0.0.0/8, ``::1``, or an IPv4-mapped loopback (``::ffff:127.0.0.1``). A name
    other than ``localhost`` is not resolved here: it counts as not loopback."""
    text = host.strip().strip("[]").split("%", 1)[0]  # brackets, IPv6 scope id
    if text.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def resolve_frame_mac(setting: FrameMacSetting, hosts: Iterable[str]) -> bool:
    """Whether frames carry MACs under ``setting`` on a connection (or job) whose
    addresses are ``hosts``: ``True``/``False`` as given; :data:`AUTO` on unless every
    address is loopback (an empty list counts as not loopback: nothing proves it)."""
    if setting is True or setting is False:
        return setting
    if setting != AUTO:
        raise ConfigError(f"frame_integrity must be true, false or 'auto', got {setting!r}")
    seen = list(hosts)
    return not seen or not all(is_loopback_host(h) for h in seen)


@dataclass(frozen=True)
class WireSecurity:
    """How a job's connections are protected; travels next to the job secret.

    ``frame_mac``: MAC every frame (``True``), none (``False``), or :data:`AUTO`: MACs
    on every connection not over loopback, decided per connection by
    :meth:`for_connection` (ignored under TLS, which authenticates every record).
    ``tls_cert_pem``/``tls_key_pem``/``tls_fingerprint``: the job's ephemeral certificate
    (PEM bytes) and the SHA-256 of its DER form (hex); empty when TLS is off.
    """

    frame_mac: FrameMacSetting = False
    tls_cert_pem: bytes = field(default=b"", repr=False)
    tls_key_pem: bytes = field(default=b"", repr=False)
    tls_fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.frame_mac is not True and self.frame_mac is not False and self.frame_mac != AUTO:
            raise ConfigError(
                f"frame_integrity must be true, false or 'auto', got {self.frame_mac!r}"
            )

    @classmethod
    def for_job(
        cls, encryption: str = "none", frame_integrity: FrameMacSetting = False
    ) -> WireSecurity:
        """The security of a new job (on the driver): makes the TLS certificate if asked."""
        if encryption == "none":
            return cls(frame_mac=frame_integrity)
        if encryption == "tls":
            cert, key, fingerprint = make_certificate()
            return cls(
                frame_mac=frame_integrity,
                tls_cert_pem=cert,
                tls_key_pem=key,
                tls_fingerprint=fingerprint,
            )
        raise ConfigError(f"encryption must be 'none' or 'tls', got {encryption!r}")

    def to_text(self) -> str:
        """JSON text (PEM as text), for channels that carry strings only (benchmarks)."""
        return json.dumps(
            {
                "frame_mac": self.frame_mac,
                "cert": self.tls_cert_pem.decode("ascii"),
                "key": self.tls_key_pem.decode("ascii"),
                "fingerprint": self.tls_fingerprint,
            }
        )

    @classmethod
    def from_text(cls, text: str) -> WireSecurity:
        """The inverse of :meth:`to_text`."""
        d = json.loads(text)
        return cls(
            frame_mac=AUTO if d["frame_mac"] == AUTO else bool(d["frame_mac"]),
            tls_cert_pem=str(d["cert"]).encode("ascii"),
            tls_key_pem=str(d["key"]).encode("ascii"),
            tls_fingerprint=str(d["fingerprint"]),
        )

    @property
    def tls(self) -> bool:
        """Whether connections run over TLS."""
        return bool(self.tls_fingerprint)

    @property
    def macs_frames(self) -> bool:
        """Whether frames carry a MAC (TLS authenticates its records itself). An
        unresolved :data:`AUTO` counts as on: see :meth:`for_connection`."""
        return self.frame_mac is not False and not self.tls

    def for_connection(self, host: str) -> WireSecurity:
        """This security as one connection runs it, :data:`AUTO` resolved for the
        connection's address ``host``: the address the client reached, which is the
        address the server was reached on (so both ends agree)."""
        if self.frame_mac != AUTO:
            return self
        return dataclasses.replace(self, frame_mac=resolve_frame_mac(AUTO, [host]))

    def authenticated(self) -> WireSecurity:
        """This security with every frame authenticated: MACs on unless TLS already
        authenticates every record (for services whose bytes a peer unpickles)."""
        if self.tls or self.frame_mac is True:
            return self
        return dataclasses.replace(self, frame_mac=True)

    @property
    def mode(self) -> int:
        """The mode bits a hello announces."""
        return (MODE_MAC if self.macs_frames else 0) | (MODE_TLS if self.tls else 0)

    def describe(self) -> str:
        """Human-readable mode, for error messages."""
        return describe_mode(self.mode)

    # ----------------------------------------------------------------- TLS

    def wrap_client(self, sock: socket.socket, what: str) -> ssl.SSLSocket:
        """Run the TLS client handshake on ``sock`` (its timeout applies) and pin the
        server's certificate to the job's fingerprint; ``what`` names the peer."""
        tls = _client_context().wrap_socket(sock, do_handshake_on_connect=False)
        tls.do_handshake()
        der = tls.getpeercert(binary_form=True)
        seen = hashlib.sha256(der).hexdigest() if der else ""
        if not _same(seen, self.tls_fingerprint):
            tls.close()
            raise HandshakeError(
                f"{what} presented a TLS certificate with fingerprint {seen[:16] or 'none'}..., "
                f"not the job's {self.tls_fingerprint[:16]}...: refusing it (a stale address "
                "from another job, or someone in between)"
            )
        return tls

    def wrap_server(self, sock: socket.socket) -> ssl.SSLSocket:
        """Run the TLS server handshake on an accepted ``sock`` (its timeout applies)."""
        tls = _server_context(self).wrap_socket(
            sock, server_side=True, do_handshake_on_connect=False
        )
        tls.do_handshake()
        return tls


def describe_mode(mode: int) -> str:
    """``"TLS"``, ``"frame MACs"`` or ``"plaintext"`` for announced mode bits."""
    if mode & MODE_TLS:
        return "TLS (encryption='tls')"
    if mode & MODE_MAC:
        return "frame MACs (frame_integrity=true, or 'auto' off loopback)"
    return (
        "plaintext without frame MACs (encryption='none', frame_integrity=false, or "
        "'auto' over loopback)"
    )


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


# --------------------------------------------------------------------------- frame MAC


class FrameMac:
    """Seals and checks frames of one connection: one key per direction.

    The GCM nonce is the frame's sequence number, never reused under one key: each
    connection and direction has its own key (derived from fresh handshake nonces) and
    sequence numbers only grow. The tag is that of AES-GCM over the header as plaintext
    and the payload as associated data (no ciphertext is sent): a GMAC over both.
    """

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send = AESGCM(send_key)
        self._recv = AESGCM(recv_key)

    @staticmethod
    def _nonce(seq: int) -> bytes:
        return seq.to_bytes(12, "little")

    def seal(self, seq: int, header: Buffer, payload: Buffer) -> bytes:
        """The tag of an outgoing frame."""
        return self._send.encrypt(self._nonce(seq), bytes(header), payload)[-TAG_BYTES:]

    def verify(self, seq: int, header: Buffer, payload: Buffer, tag: Buffer) -> bool:
        """Whether ``tag`` is the peer's tag of this incoming frame."""
        want = self._recv.encrypt(self._nonce(seq), bytes(header), payload)[-TAG_BYTES:]
        return hmac.compare_digest(want, bytes(tag))


# --------------------------------------------------------------------------- certificates


def make_certificate() -> tuple[bytes, bytes, str]:
    """A fresh self-signed certificate for one job: ``(cert_pem, key_pem, sha256_hex)``.

    An ECDSA P-256 key; valid from an hour ago (clock skew) for 30 days. Nobody checks
    its name or issuer: clients pin its fingerprint.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sparktrain job")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
    return cert_pem, key_pem, fingerprint


_contexts: dict[str, ssl.SSLContext] = {}
_contexts_lock = threading.Lock()


def _client_context() -> ssl.SSLContext:
    with _contexts_lock:
        ctx = _contexts.get("client")
        if ctx is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            # No CA, no host name: the certificate is pinned by fingerprint (wrap_client).
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            _contexts["client"] = ctx
        return ctx


def _server_context(security: WireSecurity) -> ssl.SSLContext:
    """One server context per job certificate and process (loading it is not free)."""
    with _contexts_lock:
        ctx = _contexts.get(security.tls_fingerprint)
        if ctx is not None:
            return ctx
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        # No post-handshake session tickets: nothing but frames after the handshake, as
        # a sender and a receiver thread share one connection (nobody resumes anyway).
        ctx.num_tickets = 0
        # ssl loads a certificate chain only from a file: a private one, removed at once.
        fd, path = tempfile.mkstemp(prefix="sparktrain-tls-", suffix=".pem")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(security.tls_key_pem + b"\n" + security.tls_cert_pem)
            ctx.load_cert_chain(path)
        except ssl.SSLError as exc:
            raise ConfigError(f"the job's TLS certificate cannot be loaded: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        _contexts[security.tls_fingerprint] = ctx
        return ctx


# --------------------------------------------------------------------------- shared TLS socket


class LockedTlsSocket:
    """An established TLS socket that a sending and a receiving thread may share.

    A connection is full duplex: a background sender writes while the caller reads
    (a ring of two ranks sends to and receives from the same peer). OpenSSL forbids
    concurrent calls on one SSL object (they corrupt the stream: "EOF occurred in
    violation of protocol"), so every call here runs under one lock on a non-blocking
    socket, and the waits for the network (selectors, bounded by the timeout) happen
    outside the lock. Offers what :class:`~sparktrain.wire.connection.Connection` uses.
    """

    def __init__(self, sock: ssl.SSLSocket, timeout: float) -> None:
        self.tls = sock
        self._timeout = timeout
        self._lock = threading.Lock()
        sock.setblocking(False)
        # One selector per direction (one thread each at a time), made once.
        self._waits = {
            selectors.EVENT_READ: selectors.DefaultSelector(),
            selectors.EVENT_WRITE: selectors.DefaultSelector(),
        }
        for event, sel in self._waits.items():
            sel.register(sock, event)

    def settimeout(self, timeout: float) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float:
        return self._timeout

    def fileno(self) -> int:
        return self.tls.fileno()

    def getsockopt(self, level: int, option: int) -> int:
        return self.tls.getsockopt(level, option)

    def _call(self, fn: Callable[[Buffer], int], view: Buffer) -> int:
        deadline = time.monotonic() + self._timeout
        while True:
            with self._lock:
                try:
                    return fn(view)
                except ssl.SSLWantReadError:
                    event = selectors.EVENT_READ
                except ssl.SSLWantWriteError:
                    event = selectors.EVENT_WRITE
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._waits[event].select(remaining):
                raise TimeoutError("timed out")

    def recv_into(self, view: Buffer) -> int:
        """Read at most ``len(view)`` bytes (0 at the end of the stream)."""
        return self._call(self.tls.recv_into, view)

    def send(self, view: Buffer) -> int:
        """Write ``view``; returns the bytes taken (all of them, once written)."""
        return self._call(self.tls.send, view)

    def sendall(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            view = view[self.send(view) :]

    def shutdown(self, how: int) -> None:
        # Raw TCP shutdown (wakes a reader blocked in a select); no TLS close_notify,
        # which would need the lock that reader may be about to take.
        socket.socket.shutdown(self.tls, how)

    def close(self) -> None:
        for sel in self._waits.values():
            with contextlib.suppress(Exception):
                sel.close()
        self.tls.close()
