"""An authenticated connection: frames sent and received with deadlines.

After the handshake (:mod:`sparktrain.wire.handshake`) a :class:`Connection` carries
frames (:mod:`sparktrain.wire.frames`). Arrays are sent from a memoryview and received
with ``recv_into`` straight into preallocated memory: no pickle, no intermediate copy.

* Every socket has a timeout; a peer that dies, hangs or resets surfaces as
  :class:`~sparktrain.errors.PeerLostError` naming its rank. Once a frame has started,
  the whole frame (header and payload) has a deadline too, on receive and on send, so
  a peer trickling bytes cannot hold a rank forever (:data:`FRAME_RATE_FLOOR`).
* With a :class:`~sparktrain.wire.security.WireSecurity`, frames carry a MAC keyed from
  the handshake, or the connection runs over TLS with a pinned per-job certificate (see
  :mod:`sparktrain.wire.security`).
* Every byte is counted in a :class:`~sparktrain.wire.stats.CommStats`.
* A connection given a ``link`` (:mod:`sparktrain.wire.link`) emulates a slow link: its
  sends are paced at the link's bandwidth and stamped with a delivery time (in the
  header: wire/frames.py) that the receiver waits for. A receiver without
  a link ignores stamps (else a peer could hold it for a timeout per frame).

Executor-side code: this module never imports pyspark.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sparktrain.errors import ConfigError, FrameError, PeerLostError
from sparktrain.wire.frames import (
    CODE_DTYPES,
    DTYPE_CODES,
    FRAME_HEADER,
    FRAME_MAGIC,
    HEADER_BYTES,
    KIND_ABORT,
    KIND_DATA,
    MAX_FRAME_BYTES_DEFAULT,
    MAX_NDIM,
    PREFIX_BYTES,
    Header,
    header_bytes,
    header_size,
    pack_header,
    unpack_header,
)
from sparktrain.wire.link import LinkProfile, LinkShaper
from sparktrain.wire.security import TAG_BYTES, FrameMac, LockedTlsSocket
from sparktrain.wire.stats import CommStats

log = logging.getLogger(__name__)

FRAME_RATE_FLOOR = 1 << 20
"""Bytes/s a frame must at least move at once started: a frame of ``n`` payload bytes
must be read (or written) whole within ``timeout + n / FRAME_RATE_FLOOR`` seconds of its
first byte, whatever the per-call socket timeout allows (checked between socket calls, so
a frame fails at the latest one per-call timeout after that)."""

# sendmsg/recvmsg_into let header and payload share one syscall (not on Windows).
_SCATTER_GATHER = hasattr(socket.socket, "sendmsg") and hasattr(socket.socket, "recvmsg_into")

# Errors that mean "the other end is gone or unreachable".
_LOST = (TimeoutError, ConnectionError, OSError)


class _FrameDeadline(TimeoutError):
    """A started frame did not finish within its whole-frame deadline."""


def _byte_view(arr: np.ndarray) -> memoryview:
    """A flat byte memoryview of a C-contiguous array, without copying."""
    return arr.reshape(-1).view(np.uint8).data


class Connection:
    """An authenticated, framed connection to one peer.

    Made by :func:`~sparktrain.wire.handshake.connect` or
    :func:`~sparktrain.wire.handshake.accept`, never directly. One thread may send
    while another receives (the socket is full duplex); sends are serialised by a
    lock, receives must come from one thread at a time.

    Any timeout, reset or end-of-stream raises :class:`PeerLostError` naming
    ``peer_rank``; any malformed frame raises :class:`FrameError`. Both close the
    connection: after an error the byte stream is out of step and cannot be reused.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        peer_rank: int,
        my_rank: int,
        stats: CommStats,
        timeout: float,
        max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
        link: LinkProfile | None = None,
        frame_mac: FrameMac | None = None,
    ) -> None:
        # ssl sockets have no sendmsg/recvmsg_into (nor MSG_PEEK), and one thread may
        # send while another receives: a TLS socket goes behind a lock (security.py).
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._sock: Any = sock
        if isinstance(sock, ssl.SSLSocket):
            self._sock = LockedTlsSocket(sock, timeout)
        self.peer_rank = peer_rank
        self.my_rank = my_rank
        self.stats = stats
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self._sock.settimeout(timeout)
        self._send_lock = threading.Lock()
        self._send_seq = 0
        self._recv_seq = 0
        self._recv_lock = threading.Lock()
        # With a MAC, the tag follows the header (before the payload): the "sealed" header.
        # Headers come in two sizes (wire/frames.py): the buffers hold the larger; a
        # receiver reads the prefix first (the smallest sealed header), then the rest.
        self._mac = frame_mac
        self._tag_bytes = TAG_BYTES if frame_mac is not None else 0
        self._sealed_bytes = HEADER_BYTES + self._tag_bytes
        self._prefix_bytes = PREFIX_BYTES + self._tag_bytes
        self._send_header = bytearray(self._sealed_bytes)  # only touched under _send_lock
        self._send_header_view = memoryview(self._send_header)
        self._recv_header = bytearray(self._sealed_bytes)
        self._recv_header_view = memoryview(self._recv_header)
        self._recv_head: Header | None = None  # the header being received, once decoded
        self._gather = _SCATTER_GATHER and not self._tls
        self._frame_deadline = 0.0  # monotonic deadline of the frame being received
        self._closed = False
        self._closing = threading.Event()  # wakes link-emulation waits on close()
        self._loss: str | None = None  # why the connection died, repeated by later calls
        self.shaper: LinkShaper | None = None
        """The emulated link this side's sends cross (``link`` given), else ``None``."""
        if link is not None and not link.unshaped:
            self.shaper = LinkShaper(link, seed=(link.seed, my_rank + 2, peer_rank + 2))
        self._recv_due_ns = 0  # delivery stamp of the frame being received (0: none)
        try:
            self.send_buffer_bytes = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except OSError:
            self.send_buffer_bytes = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Connection rank {self.my_rank} -> rank {self.peer_rank} ({state})>"

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """True once the connection was closed (by :meth:`close` or after an error)."""
        return self._closed

    def peer_gone(self) -> bool:
        """True if the peer has closed or reset its end; never blocks, consumes nothing.

        For a server holding a connection that should stay silent (a task waiting on a
        reply): data waiting to be read, or nothing at all, means the peer is there.
        """
        if self._closed:
            return True
        try:
            # poll first: a socket with a timeout would wait that long inside recv.
            # selectors, not select.select: that fails for descriptors >= 1024, which a
            # long-lived driver (a notebook) soon has.
            with selectors.DefaultSelector() as sel:
                sel.register(self._sock, selectors.EVENT_READ)
                if not sel.select(0):
                    return False
            if self._tls:  # ssl refuses MSG_PEEK: peek at the raw stream on a twin fd
                with socket.socket(fileno=os.dup(self._sock.fileno())) as raw:
                    return raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            return self._sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except (ValueError, OSError):  # closed under us, reset
            return True

    def set_timeout(self, timeout: float) -> None:
        """Change the per-operation socket timeout (seconds, > 0; never unbounded)."""
        if not timeout > 0:
            raise ConfigError(f"a connection timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        with contextlib.suppress(OSError):
            self._sock.settimeout(timeout)

    # ----------------------------------------------------------------- failures

    def _lost(self, what: str, exc: BaseException | None) -> PeerLostError:
        """Close and build the PeerLostError for a failed socket operation."""
        if self._loss is not None:
            detail = self._loss  # later calls repeat the first cause
        elif self._closed:
            detail = f"the connection was closed on this side (while {what})"
        else:
            if isinstance(exc, _FrameDeadline):
                detail = (
                    f"the frame did not complete in time while {what} (a started frame has "
                    f"the comm timeout, {self.timeout:g} s, plus 1 s per MiB of payload)"
                )
            elif isinstance(exc, TimeoutError):
                detail = f"no progress for {self.timeout:g} s while {what}"
            elif exc is None:
                detail = f"the peer closed the connection while {what}"
            else:
                detail = f"{type(exc).__name__} while {what}: {exc}"
            self._loss = detail
        self.close()
        return PeerLostError(self.peer_rank, detail)

    def _bad_frame(self, detail: str) -> FrameError:
        message = f"bad frame from rank {self.peer_rank}: {detail}; connection closed"
        if self._loss is None:
            self._loss = f"the connection was closed after a {message}"
        self.close()
        return FrameError(message)

    # ----------------------------------------------------------------- sending

    def _frame_header(
        self,
        kind: int,
        code: int,
        shape: Sequence[int],
        nbytes: int,
        seq: int,
        due_ns: int = 0,
        payload: memoryview | bytes = b"",
    ) -> memoryview:
        """Pack the header, in the form that applies (wire/frames.py), and with a MAC its
        tag over header and ``payload``; returns the sealed header's bytes."""
        view = self._send_header_view
        size = pack_header(view, kind, code, shape, nbytes, seq, due_ns)
        if self._mac is not None:
            view[size : size + TAG_BYTES] = self._mac.seal(seq, view[:size], payload)
        return view[: size + self._tag_bytes]

    def _pause(self, until: float) -> float:
        """Sleep until monotonic time ``until`` or until the connection closes; returns
        the seconds slept (bounded: ``until`` comes from the link model)."""
        remaining = until - time.monotonic()
        if remaining <= 0:
            return 0.0
        self._closing.wait(remaining)
        return max(0.0, remaining - max(0.0, until - time.monotonic()))

    def _frame_budget(self, nbytes: int) -> float:
        """Seconds a started frame of ``nbytes`` payload bytes may take as a whole."""
        return self.timeout + nbytes / FRAME_RATE_FLOOR

    @staticmethod
    def _check_deadline(deadline: float) -> None:
        """Raise once a started frame is past its whole-frame deadline.

        Checked between socket calls (the socket's timeout is shared by the sending and
        the receiving thread, so it is never cut): a frame fails at the latest one
        per-call timeout after its deadline.
        """
        if deadline > 0 and time.monotonic() > deadline:
            raise _FrameDeadline("the whole-frame deadline passed")

    def _send_views(self, views: list[memoryview], deadline: float) -> None:
        """Write ``views`` in order, whole, within ``deadline`` (monotonic)."""
        sock = self._sock
        views = [v for v in views if len(v)]
        while views:
            self._check_deadline(deadline)
            gather = self._gather and len(views) > 1  # header + payload in one syscall
            sent = sock.sendmsg(views) if gather else sock.send(views[0])
            while sent and views:
                first = len(views[0])
                if sent >= first:
                    sent -= first
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def _send_frame(
        self, kind: int, code: int, shape: Sequence[int], payload: memoryview, raw: int
    ) -> None:
        if self._closed:
            raise self._lost("sending", None)
        nbytes = len(payload)
        if nbytes > self.max_frame_bytes:
            raise FrameError(
                f"refusing to send a {nbytes}-byte frame to rank {self.peer_rank}: the cap is "
                f"{self.max_frame_bytes} bytes; send it in smaller pieces"
            )
        shaper = self.shaper
        release = 0.0
        with self._send_lock:
            due_ns = 0
            if shaper is not None:
                # Book the frame on the emulated link and stamp its delivery time; the
                # bytes go out now and the receiver holds them until then (wire/link.py).
                size = header_bytes(code, shape, nbytes, self._send_seq, stamped=True)
                booking = shaper.book(size + nbytes)
                release = booking.release
                due_ns = time.time_ns() + max(1, round((booking.due - time.monotonic()) * 1e9))
            header = self._frame_header(kind, code, shape, nbytes, self._send_seq, due_ns, payload)
            try:
                deadline = time.monotonic() + self._frame_budget(nbytes)
                self._send_views([header, payload], deadline)
            except _LOST as exc:
                if not isinstance(exc, TimeoutError):
                    notice = self._peek_abort_notice()
                    if notice is not None:
                        self.close()
                        raise notice from exc
                raise self._lost(f"sending a {nbytes}-byte frame", exc) from exc
            self._send_seq += 1
        self.stats.add_sent(len(header) + nbytes, raw, 1)
        if shaper is not None:
            # Outside the send lock, so an abort notice can still go out meanwhile.
            shaper.add_hold(self._pause(release))

    def send_array(self, arr: np.ndarray, kind: int = KIND_DATA) -> None:
        """Send one C-contiguous array as a frame, from its memory (no copy).

        ``KIND_DATA`` frames count ``arr.nbytes`` in ``stats.raw_bytes_sent``.
        """
        if not isinstance(arr, np.ndarray) or not arr.flags.c_contiguous:
            raise FrameError(
                "send_array needs a C-contiguous numpy array; use np.ascontiguousarray"
            )
        code = DTYPE_CODES.get(arr.dtype)
        if code is None:
            raise FrameError(f"dtype {arr.dtype} cannot be sent on the wire")
        if arr.ndim > MAX_NDIM:
            raise FrameError(f"arrays of more than {MAX_NDIM} dimensions cannot be sent")
        payload = _byte_view(arr)
        self._send_frame(kind, code, arr.shape, payload, arr.nbytes if kind == KIND_DATA else 0)

    def send_bytes(self, payload: bytes, kind: int) -> None:
        """Send a small byte string (e.g. JSON) as one frame of kind ``kind``."""
        view = memoryview(payload).cast("B")
        raw = len(view) if kind == KIND_DATA else 0
        self._send_frame(kind, DTYPE_CODES[np.dtype(np.uint8)], (len(view),), view, raw)

    def notify_abort(self, lost_rank: int, wait: float = 0.0) -> bool:
        """Best effort: tell the peer this rank is aborting because ``lost_rank`` was lost.

        Only sent if no other thread is in the middle of a frame (waiting at most
        ``wait`` seconds for it), so the stream stays well formed. Returns whether the
        notice went out.
        """
        if self._closed:
            return False
        got_lock = (
            self._send_lock.acquire(timeout=wait) if wait > 0 else self._send_lock.acquire(False)
        )
        if not got_lock:
            return False
        try:
            # dtype code 0: the long form, whose shape slot names the rank (wire/frames.py)
            header = self._frame_header(KIND_ABORT, 0, (lost_rank + 2,), 0, self._send_seq)
            self._sock.settimeout(min(self.timeout, 0.5))
            self._sock.sendall(header)
            self._send_seq += 1
        except _LOST as exc:
            log.debug("abort notice to rank %d not sent: %r", self.peer_rank, exc)
            return False
        finally:
            self._send_lock.release()
        self.stats.add_sent(len(header), 0, 1)
        return True

    def _peek_abort_notice(self) -> PeerLostError | None:
        """After a failed send: did the peer leave an abort notice before it closed?

        A rank that aborts tells its peers which rank was really lost, then closes. A
        peer that was only sending to it sees a broken pipe; the notice is still in the
        receive buffer, and naming the lost rank beats naming the messenger. (Not over
        TLS: ssl cannot peek.) A notice always takes the long form.
        """
        if self._closed or self._tls or not self._recv_lock.acquire(blocking=False):
            return None
        size = self._sealed_bytes
        try:
            self._sock.settimeout(0.0)  # a peek must not wait
            data = self._sock.recv(size, socket.MSG_PEEK)
        except OSError:
            return None
        finally:
            self._recv_lock.release()
            with contextlib.suppress(OSError):
                self._sock.settimeout(self.timeout)
        if len(data) < size:
            return None
        fields = FRAME_HEADER.unpack(data[:HEADER_BYTES])
        magic, kind, seq, length = fields[0], fields[1], fields[5], fields[6]
        if magic != FRAME_MAGIC or kind != KIND_ABORT or seq != self._recv_seq or length:
            return None
        if self._mac is not None and not self._mac.verify(
            fields[5], data[:HEADER_BYTES], b"", data[HEADER_BYTES:]
        ):
            return None  # a forged notice: keep the error this side saw
        return self._abort_error(tuple(fields[7 : 7 + min(fields[3], MAX_NDIM)]))

    def _abort_error(self, shape: tuple[int, ...]) -> PeerLostError:
        lost = shape[0] - 2 if len(shape) == 1 else self.peer_rank
        if lost == self.peer_rank:
            detail = f"rank {self.peer_rank} aborted the collective after an error of its own"
        else:
            detail = f"rank {self.peer_rank} reported that it lost contact with rank {lost}"
        return PeerLostError(lost, detail)

    # ----------------------------------------------------------------- receiving

    def _recv_exact(self, view: memoryview, what: str) -> None:
        """Read ``view`` whole. The frame's deadline starts with its first byte, here or
        in the caller's first read."""
        got, total = 0, len(view)
        sock = self._sock
        try:
            while got < total:
                self._check_deadline(self._frame_deadline)
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise self._lost(what, None)
                got += n
                if self._frame_deadline <= 0:
                    self._frame_deadline = time.monotonic() + self._frame_budget(0)
        except _LOST as exc:
            raise self._lost(what, exc) from exc
        finally:
            self.stats.add_recv(got)

    def _extend_deadline(self, length: int) -> None:
        """The header announced ``length`` payload bytes: allow time for them too."""
        self._frame_deadline += length / FRAME_RATE_FLOOR

    def _finish_header(self, payload: memoryview, spilled: int) -> int:
        """The prefix of a sealed header is in ``_recv_header``: learn the header's size
        from it and read the rest. ``spilled`` bytes past the prefix were read into
        ``payload`` already (one syscall for a header and its payload): those belong to
        the header first, and what is left of them moves to the payload's start.
        Returns the payload bytes already read."""
        header = self._recv_header_view
        try:
            size = header_size(header[:PREFIX_BYTES])
        except FrameError as exc:
            raise self._bad_frame(str(exc)) from None
        self._recv_head = None
        first, sealed = self._prefix_bytes, size + self._tag_bytes
        need = sealed - first
        if need <= 0:
            return spilled
        take = min(spilled, need)
        if take:
            header[first : first + take] = payload[:take]
            if spilled > take:
                payload[: spilled - take] = bytes(payload[take:spilled])
            spilled -= take
        if take < need:
            self._recv_exact(header[first + take : sealed], "reading a frame header")
        return spilled

    def _check_header(self, kind: int | None) -> tuple[int, int, int, tuple[int, ...]]:
        """Validate the header in ``_recv_header``; returns (kind, code, length, shape)."""
        try:
            head = unpack_header(self._recv_header_view)
        except FrameError as exc:
            raise self._bad_frame(str(exc)) from None
        self._recv_head = head
        got_kind, code, length, shape = head.kind, head.code, head.length, head.shape
        if head.seq != self._recv_seq:
            raise self._bad_frame(
                f"sequence number {head.seq}, expected {self._recv_seq} (replayed or lost frame)"
            )
        if got_kind == KIND_ABORT:
            # A notice carries no payload: one that claims some is no genuine notice, and
            # its tag (over the header only) must verify before it may name any rank.
            if length != 0:
                raise self._bad_frame(
                    f"an abort notice claiming a {length}-byte payload (notices carry none)"
                )
            self._verify_mac(b"")
            self.close()
            raise self._abort_error(shape)
        if kind is not None and got_kind != kind:
            raise self._bad_frame(f"kind {got_kind}, expected {kind}")
        if length > self.max_frame_bytes:
            raise self._bad_frame(
                f"payload of {length} bytes exceeds the {self.max_frame_bytes}-byte cap"
            )
        dtype = CODE_DTYPES.get(code)
        if dtype is None:
            raise self._bad_frame(f"unknown dtype code {code}")
        count = 1
        for dim in shape:
            count *= dim
        if count * dtype.itemsize != length:
            raise self._bad_frame(f"shape {shape} of {dtype} does not match length {length}")
        self._recv_due_ns = head.stamp
        self._recv_seq += 1
        return got_kind, code, length, shape

    def _verify_mac(self, payload: memoryview | bytes | bytearray) -> None:
        """Check the tag of the frame just read (header in ``_recv_header``)."""
        mac = self._mac
        if mac is None:
            return
        head = self._recv_head
        if head is None:  # never: _check_header decoded it first
            raise self._bad_frame("a MAC to check before its header was decoded")
        sealed = self._recv_header_view
        size = head.size
        if not mac.verify(head.seq, sealed[:size], payload, sealed[size : size + TAG_BYTES]):
            raise self._bad_frame(
                f"frame {head.seq}'s MAC does not verify (forged or altered in transit)"
            )

    def _await_delivery(self, length: int) -> None:
        """Hold the frame just read until its stamped delivery time (emulated link).

        Only on a connection with a link of its own: without one, a stamp is ignored
        (an authenticated peer could otherwise hold this side a timeout per frame).
        Bounded: at most the comm timeout plus the frame's worst case under this side's
        own link profile, so a skewed clock or a bogus stamp cannot hang the receiver.
        """
        due_ns, self._recv_due_ns = self._recv_due_ns, 0
        shaper = self.shaper
        if due_ns <= 0 or shaper is None:
            return
        wait = (due_ns - time.time_ns()) / 1e9
        if wait <= 0:
            return
        cap = self.timeout + shaper.profile.max_delivery_s(HEADER_BYTES + length)
        if wait > cap:
            log.warning(
                "rank %d: a frame from rank %d is stamped %.3g s ahead; holding it %.3g s "
                "(do the hosts' clocks differ?)",
                self.my_rank,
                self.peer_rank,
                wait,
                cap,
            )
            wait = cap
        slept = self._pause(time.monotonic() + wait)
        shaper.add_wait(slept)
        if self._closed:
            raise self._lost("holding a frame on the emulated link", None)

    def recv_into(self, out: np.ndarray, kind: int = KIND_DATA) -> None:
        """Receive one frame straight into ``out`` (C-contiguous, writable): no copy.

        The frame's kind, dtype and byte length must match ``out`` (its shape may
        differ, e.g. 2-D sent into 1-D), else :class:`FrameError`. On any error the
        contents of ``out`` are unspecified.
        """
        with self._recv_lock:
            self._frame_deadline = 0.0  # set by the frame's first byte
            self._recv_into(out, kind)

    def _recv_into(self, out: np.ndarray, kind: int) -> None:
        if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
            raise FrameError("recv_into needs a writable, C-contiguous numpy array")
        want_code = DTYPE_CODES.get(out.dtype)
        if want_code is None:
            raise FrameError(f"dtype {out.dtype} cannot be received from the wire")
        if self._closed:
            raise self._lost("receiving", None)
        payload = _byte_view(out)
        nbytes = len(payload)
        prefix = self._recv_header_view[: self._prefix_bytes]
        sock = self._sock
        # Read the header's prefix (+ tag) and the payload with one syscall when possible
        # (latency of small frames); a longer header's rest lands in the payload and is
        # moved back (_finish_header). The prefix is no longer than the smallest frame;
        # bytes read past a frame that turns out to be shorter than expected are lost,
        # but such a frame is an error that closes the connection.
        try:
            if nbytes and self._gather:
                got = sock.recvmsg_into([prefix, payload])[0]
            else:
                got = sock.recv_into(prefix)
        except _LOST as exc:
            raise self._lost("waiting for a frame", exc) from exc
        if got == 0:
            raise self._lost("waiting for a frame", None)
        self._frame_deadline = time.monotonic() + self._frame_budget(0)
        self.stats.add_recv(got)
        if got < len(prefix):
            self._recv_exact(prefix[got:], "reading a frame header")
            got = len(prefix)
        have = self._finish_header(payload, got - len(prefix))
        _, code, length, _ = self._check_header(kind)
        if code != want_code:
            raise self._bad_frame(f"dtype {CODE_DTYPES[code]}, expected {out.dtype}")
        if length != nbytes:
            raise self._bad_frame(f"{length} payload bytes, expected {nbytes}")
        self._extend_deadline(length)
        if have < nbytes:
            self._recv_exact(payload[have:], f"reading a {nbytes}-byte payload")
        self._verify_mac(payload)
        self._await_delivery(length)
        self.stats.add_recv(0, 1)

    def recv_bytes(self, kind: int | None = None, max_bytes: int = 16 << 20) -> tuple[int, bytes]:
        """Receive one frame as bytes; returns ``(kind, payload)``.

        With ``kind`` given, a frame of another kind is a :class:`FrameError`. A frame
        longer than ``max_bytes`` is rejected before anything is allocated.
        """
        with self._recv_lock:
            self._frame_deadline = 0.0  # set by the frame's first byte
            return self._recv_bytes(kind, max_bytes)

    def _recv_bytes(self, kind: int | None, max_bytes: int) -> tuple[int, bytes]:
        if self._closed:
            raise self._lost("receiving", None)
        self._recv_exact(self._recv_header_view[: self._prefix_bytes], "waiting for a frame")
        self._finish_header(memoryview(b""), 0)
        got_kind, _, length, _ = self._check_header(kind)
        if length > max_bytes:
            raise self._bad_frame(f"payload of {length} bytes exceeds the {max_bytes}-byte limit")
        self._extend_deadline(length)
        payload = bytearray(length)
        if length:
            self._recv_exact(memoryview(payload), f"reading a {length}-byte payload")
        self._verify_mac(payload)
        self._await_delivery(length)
        self.stats.add_recv(0, 1)
        return got_kind, bytes(payload)

    def close(self) -> None:
        """Close the socket; idempotent, safe from any thread (wakes a blocked receiver)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
