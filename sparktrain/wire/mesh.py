"""The mesh: one rank's authenticated connections to its peers, and background senders.

A :class:`Mesh` opens connections lazily (the lower rank of a pair dials, the higher
accepts behind a pre-auth gate), names the lost rank when a peer fails and tears
everything down at once on :meth:`Mesh.abort`. An :class:`AsyncSender` keeps one
connection's outgoing pipe full from a thread of its own while collectives receive.

Executor-side code: this module never imports pyspark.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from sparktrain.errors import CommError, ConfigError, HandshakeError, PeerLostError
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_DATA, MAX_FRAME_BYTES_DEFAULT
from sparktrain.wire.handshake import (
    check_secret,
    connect,
    first_bytes,
    first_size,
    serve_accepted,
)
from sparktrain.wire.link import LinkProfile
from sparktrain.wire.listen import parse_address
from sparktrain.wire.preauth import PreauthGate
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.stats import CommStats

log = logging.getLogger(__name__)

_NOTICE_SECONDS = 0.5  # how long an abort may spend telling peers which rank was lost

DIAL_TIMEOUT_FRACTION = 0.5
"""Share of the comm timeout a mesh allows for dialing a peer (see Mesh.connect_all)."""


class AsyncSender:
    """Sends arrays on one connection from a background thread, in order.

    Lets a collective keep the outgoing pipe full while its calling thread receives
    and reduces (socket calls and numpy ufuncs release the GIL). The arrays handed to
    :meth:`put` must not be modified until :meth:`flush` returns.
    """

    def __init__(
        self, conn: Connection, on_error: Callable[[CommError], object] | None = None
    ) -> None:
        self.conn = conn
        self._on_error = on_error
        self._queue: queue.SimpleQueue[tuple[np.ndarray, int] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._error: CommError | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        q = self._queue
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self._error is not None or self._stopped:
                continue  # drop work after a failure, but keep releasing flush() waiters
            arr, kind = item
            try:
                self.conn.send_array(arr, kind)
            except CommError as exc:
                self._error = exc
                if self._on_error is not None:
                    try:
                        self._on_error(exc)
                    except Exception:  # never let the callback kill the drain loop
                        log.exception("sender error callback failed")

    def put(self, arr: np.ndarray, kind: int = KIND_DATA) -> None:
        """Queue ``arr`` to be sent after everything queued before it."""
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise CommError(f"the sender to rank {self.conn.peer_rank} was closed")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"sparktrain-send-{self.conn.peer_rank}", daemon=True
            )
            self._thread.start()
        self._queue.put((arr, kind))

    def flush(self) -> None:
        """Wait until everything queued is on the wire; raise the sender's error if any.

        Bounded: every send has the connection's socket timeout.
        """
        thread = self._thread
        if thread is not None and not self._stopped:
            done = threading.Event()
            self._queue.put(done)
            while not done.wait(0.1):
                if self._stopped or not thread.is_alive():
                    break
        if self._error is not None:
            raise self._error
        if self._stopped:
            raise CommError(f"the sender to rank {self.conn.peer_rank} was closed")

    def close(self) -> None:
        """Stop the thread (pending arrays are dropped); idempotent."""
        self._stopped = True
        if self._thread is not None:
            self._queue.put(None)


# --------------------------------------------------------------------------- mesh


class Mesh:
    """Authenticated connections from one rank to its peers, opened lazily.

    ``addresses[r]`` is rank ``r``'s listener address (gathered by the caller, e.g.
    with ``BarrierTaskContext.allGather``). The lower rank of a pair dials, the higher
    rank accepts: a background thread accepts and files incoming connections by the
    rank their handshake proved, so ranks may ask for connections in any order
    without deadlock.

    Any communication failure inside a collective should go through :meth:`abort`:
    it tells the peers which rank was lost (when the stream allows), closes every
    connection so that neighbours fail at once instead of waiting for their timeout,
    and makes every later call raise the same, original error.

    ``link`` emulates a slow link on every connection of the mesh (see
    :mod:`sparktrain.wire.link`); ``None`` leaves them unshaped. ``security`` protects
    every connection (frame MACs or TLS, :mod:`sparktrain.wire.security`).

    The mesh owns ``listener`` once constructed (:meth:`close` closes it). Run one
    collective at a time per mesh: connections carry sequenced frames, so two
    threads interleaving collectives on the same peers would corrupt both.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        listener: socket.socket,
        addresses: Sequence[str],
        secret: bytes,
        job_id: str,
        attempt: int,
        timeout: float,
        stats: CommStats | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
        link: LinkProfile | None = None,
        *,
        security: WireSecurity | None = None,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is out of range for world size {world_size}")
        if len(addresses) != world_size:
            raise ConfigError(
                f"got {len(addresses)} peer addresses for a world of {world_size}: gather one "
                "listener address per rank, in rank order"
            )
        if timeout <= 0:
            raise ConfigError(f"the comm timeout must be > 0 seconds, got {timeout}")
        if max_frame_bytes <= 0:
            raise ConfigError(f"max_frame_bytes must be > 0, got {max_frame_bytes}")
        check_secret(secret)
        for addr in addresses:
            parse_address(addr)
        self.rank = rank
        self.world_size = world_size
        self.addresses = list(addresses)
        self.timeout = timeout
        self.stats = stats if stats is not None else CommStats()
        self.max_frame_bytes = max_frame_bytes
        self.link = link
        """The emulated link every connection's sends cross (``None``: unshaped)."""
        self._listener = listener
        self._security = security
        self._secret = bytes(secret)
        self._job_id = job_id
        self._attempt = attempt
        self._cond = threading.Condition()
        self._conns: dict[int, Connection] = {}
        self._senders: dict[int, AsyncSender] = {}
        self._rejections: list[str] = []
        self._failure: CommError | None = None
        self._aborted = threading.Event()  # set once abort() told the peers, or on close
        self._closed = False
        self._acceptor: threading.Thread | None = None
        # Handshakes run off the accept thread with a short deadline, and strangers are
        # capped (who got least far evicted first): a flood cannot keep lower ranks out.
        self._gate = PreauthGate(
            listener,
            name=f"mesh-{rank}",
            handshake=self._handshake,
            on_ready=self._adopt,
            on_reject=self._on_rejected,
            first_bytes=first_bytes(self._security),
            first_size=first_size(self._security),
        )
        if rank > 0:  # rank 0 has no lower rank to dial it
            self._acceptor = threading.Thread(
                target=self._accept_loop, name=f"sparktrain-accept-{rank}", daemon=True
            )
            self._acceptor.start()

    def __repr__(self) -> str:
        return f"<Mesh rank {self.rank}/{self.world_size} peers {sorted(self._conns)}>"

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failure(self) -> CommError | None:
        """The error that aborted this mesh, if any."""
        return self._failure

    # ----------------------------------------------------------------- accepting

    def _accept_loop(self) -> None:
        # Every lower rank connected: nobody else may dial us (pending strangers dropped).
        self._gate.serve(done=self._all_lower_connected)

    def _all_lower_connected(self) -> bool:
        with self._cond:
            return self._closed or all(r in self._conns for r in range(self.rank))

    def _handshake(
        self, sock: socket.socket, deadline: float, authenticated: Callable[[], bool]
    ) -> Connection:
        """Run by the pre-auth gate on a thread of its own, with its short deadline."""
        return serve_accepted(
            sock,
            secret=self._secret,
            job_id=self._job_id,
            attempt=self._attempt,
            my_rank=self.rank,
            deadline=deadline,
            stats=self.stats,
            accept_rank=lambda rank: authenticated() and self._may_dial_me(rank),
            timeout=self.timeout,
            max_frame_bytes=self.max_frame_bytes,
            link=self.link,
            security=self._security,
        )

    def _on_rejected(self, exc: BaseException) -> None:
        # A client that spoke the protocol but was refused (stale attempt, wrong job) is
        # worth a warning; silence and garbage are strangers: logged quietly, as a flood
        # of them would bury everything else.
        spoke = isinstance(exc, HandshakeError) and str(exc).startswith("rejected a client")
        log.log(logging.WARNING if spoke else logging.DEBUG, "rank %d: %s", self.rank, exc)
        with self._cond:  # the last few, for the error message if a peer never arrives
            self._rejections = [*self._rejections[-7:], str(exc)]

    def _adopt(self, conn: Connection) -> None:
        with self._cond:
            if self._closed or conn.peer_rank in self._conns:
                conn.close()
                return
            self._conns[conn.peer_rank] = conn
            self._cond.notify_all()

    def _may_dial_me(self, rank: int) -> bool:
        with self._cond:
            return 0 <= rank < self.rank and rank not in self._conns

    # ----------------------------------------------------------------- connections

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ConfigError(
                f"rank {self.rank} cannot connect to rank {peer} in a world of {self.world_size}"
            )

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise CommError(f"the mesh of rank {self.rank} is closed")

    def connection(self, peer: int) -> Connection:
        """The connection to ``peer``, established on first use.

        Raises :class:`PeerLostError` naming ``peer`` if it cannot be reached (or, for
        a lower rank, does not dial in) within the timeout.
        """
        self._check_peer(peer)
        self._raise_if_unusable()
        conn = self._conns.get(peer)
        if conn is not None:
            return conn
        self.connect_all((peer,))
        return self._conns[peer]

    def connect_all(self, peers: Iterable[int]) -> None:
        """Establish the connections to all ``peers`` at once (dials run in parallel).

        Used by collectives before they start, so that a missing rank is named by all
        its neighbours after one timeout, instead of a chain of ranks each timing out
        while waiting for the previous one.

        Waiting for a lower rank to dial in may take the whole timeout (that rank may
        legitimately reach its first collective late). Dialing gets only half of it:
        the peer's listener exists before addresses are gathered and its mesh answers
        handshakes at once, so a dial that takes long means the peer is gone. Failing
        it early lets this rank's abort notice reach neighbours that are already
        waiting for data from it, before their own timeout blames this rank.
        """
        wanted = sorted(set(peers))
        for peer in wanted:
            self._check_peer(peer)
        self._raise_if_unusable()
        missing = [p for p in wanted if p not in self._conns]
        if not missing:
            return
        now = time.monotonic()
        deadline = now + self.timeout
        dial_deadline = now + self.timeout * DIAL_TIMEOUT_FRACTION
        errors: dict[int, CommError] = {}
        dials = [p for p in missing if p > self.rank]

        def dial(peer: int) -> None:
            try:
                conn = connect(
                    self.addresses[peer],
                    secret=self._secret,
                    job_id=self._job_id,
                    attempt=self._attempt,
                    my_rank=self.rank,
                    peer_rank=peer,
                    timeout=max(dial_deadline - time.monotonic(), 0.001),
                    stats=self.stats,
                    max_frame_bytes=self.max_frame_bytes,
                    link=self.link,
                    security=self._security,
                )
            except CommError as exc:
                errors[peer] = exc
                return
            conn.set_timeout(self.timeout)  # the dial had only part of it
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns[peer] = conn
                self._cond.notify_all()

        threads = []
        if len(dials) == 1:
            dial(dials[0])
        else:
            for peer in dials:
                t = threading.Thread(target=dial, args=(peer,), daemon=True)
                t.start()
                threads.append(t)
        waits = [p for p in missing if p < self.rank]
        with self._cond:
            while not self._closed and not all(p in self._conns for p in waits):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            rejections = list(self._rejections)
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0) + 1.0)
        for peer in waits:
            if peer not in self._conns and peer not in errors:
                note = f"; rejected clients: {rejections[-3:]}" if rejections else ""
                errors[peer] = PeerLostError(
                    peer,
                    f"it did not connect to rank {self.rank}'s listener at "
                    f"{self.addresses[self.rank]} within {self.timeout:g} s{note}",
                )
        for peer in dials:
            if peer not in self._conns and peer not in errors:
                errors[peer] = PeerLostError(peer, "the dial did not finish in time")
        if errors:
            self._raise_if_unusable()
            raise errors[min(errors)]

    def sender(self, peer: int) -> AsyncSender:
        """The background sender on the connection to ``peer`` (created on first use)."""
        sender = self._senders.get(peer)
        if sender is None or sender.conn.closed:
            sender = AsyncSender(self.connection(peer), on_error=self.abort)
            self._senders[peer] = sender
        return sender

    # ----------------------------------------------------------------- teardown

    def abort(self, cause: CommError) -> CommError:
        """Tear the mesh down after ``cause``; returns the error callers should raise.

        The first failure wins: if another thread already aborted the mesh (e.g. the
        sender thread saw the peer vanish), this returns that original error, so the
        rank named is the one that was really lost rather than a neighbour that shut
        its sockets in reaction.
        """
        with self._cond:
            first = self._failure is None and not self._closed
            if self._failure is None:
                self._failure = cause
            failure = self._failure
            conns = list(self._conns.values())
        if not first:
            # Another thread is telling the peers: let it finish before the error
            # propagates (and before anyone closes the sockets under it).
            self._aborted.wait(_NOTICE_SECONDS + 0.5)
            return failure
        try:
            lost = failure.rank if isinstance(failure, PeerLostError) else self.rank
            for sender in list(self._senders.values()):
                sender.close()
            # Tell the others (when no frame is half-sent), so they name the lost rank.
            notice_deadline = time.monotonic() + _NOTICE_SECONDS
            for conn in conns:
                wait = max(0.0, min(0.2, notice_deadline - time.monotonic()))
                if conn.peer_rank != lost:
                    conn.notify_abort(lost, wait)
            self._close_now()
        finally:
            self._aborted.set()
        return failure

    def close(self) -> None:
        """Close every connection, the senders and the listener; idempotent."""
        if self._failure is not None:
            self._aborted.wait(_NOTICE_SECONDS + 0.5)  # let abort notices go out first
        self._close_now()

    def _close_now(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.values())
            self._cond.notify_all()
        self._aborted.set()  # closed: no abort notice will be sent any more
        for sender in list(self._senders.values()):
            sender.close()
        for conn in conns:
            conn.close()
        self._gate.close()  # wakes the accept loop at once, drops pending strangers
        with contextlib.suppress(OSError):
            self._listener.close()
        acceptor = self._acceptor
        if acceptor is not None and acceptor is not threading.current_thread():
            acceptor.join(1.0)
