"""The pre-auth gate: strangers must not delay authenticated clients.

Every sparktrain listener (the driver's services, the parameter-server shards, a
rank's mesh listener) is reachable by anything that can open a TCP connection. Until a
client proves the job secret it is a *stranger*, and a stranger must cost the listener
next to nothing: a dozen silent connections must not stall a stage.

:class:`PreauthGate` enforces that:

* the accept thread only accepts and registers the raw socket in a selector. A
  stranger that stays silent costs no thread; one whose first bytes are not the
  protocol's (garbage) is closed at once. Only a client that spoke the protocol gets a
  thread of its own for the handshake, so no client ever waits for another;
* each handshake has a short deadline (:data:`PREAUTH_DEADLINE_S`), however long the
  caller's comm timeout;
* the unauthenticated connections are bounded in total (:data:`MAX_PENDING`) and per
  source address (:data:`MAX_PENDING_PER_SOURCE`). When a bound is reached the OLDEST
  pending connection (of that source, or of all) is dropped, never the new one: a flood
  cannot lock real clients out, it can at most drop a real client's half-finished
  handshake, which the client retries (:func:`sparktrain.comm.handshake.connect`);
* a connection leaves the registry the moment its MAC verifies (the handshake calls
  the ``authenticated`` callback before sending the verdict), so a proven client is
  never dropped; it is handed to ``on_ready`` on its handshake thread.

The gate knows nothing about the handshake itself (:mod:`sparktrain.comm.handshake` does):
owners pass a ``handshake(sock, deadline, authenticated)`` function.

Executor-side code: this module never imports pyspark.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

PREAUTH_DEADLINE_S = 3.0
"""How long a client has to complete the handshake. A real client sends its hello as
soon as it is connected and its MAC one round trip later (milliseconds, even on a
loaded host); a stranger gets no more than this of a handshake slot."""

MAX_PENDING = 128
"""Unauthenticated connections one listener keeps at once. Above it the oldest is
dropped. Large enough for every rank of a big job to handshake at once (each takes
milliseconds), small enough that a flood costs bounded threads and descriptors (a
thread only for a connection that sent the protocol's first bytes)."""

MAX_PENDING_PER_SOURCE = 32
"""Unauthenticated connections one source address keeps at once; above it that source's
oldest is dropped. A single flooding host therefore never fills :data:`MAX_PENDING`
and never evicts other hosts' handshakes; many executors of one host still fit."""

T = TypeVar("T")

Handshake = Callable[[socket.socket, float, Callable[[], bool]], T]
"""``handshake(sock, deadline, authenticated)``: serve the handshake on ``sock`` before
``deadline`` (``time.monotonic()``); call ``authenticated()`` once the client's proof
verified (it returns False if the gate already dropped the socket); return the
authenticated result, or raise (and close ``sock``)."""

# --------------------------------------------------------------------------- test hook

_observer: Callable[[str, str], None] | None = None


def set_test_observer(observer: Callable[[str, str], None] | None) -> None:
    """TEST-ONLY hook: ``observer(kind, text)`` is called, in this process, with
    ``("listener", address)`` whenever a gate starts serving a listener (the driver's
    services and parameter-server shards) and with ``("rendezvous", message)`` for each
    rank's message of a completed rendezvous round, before the ranks get the answer
    (the attack tests learn the mesh listeners from it). ``None`` removes it. Never
    set in production; an observer that raises is logged and ignored."""
    global _observer
    _observer = observer


def notify_observer(kind: str, text: str) -> None:
    """Tell the test observer (if any) about ``text``; see :func:`set_test_observer`."""
    observer = _observer
    if observer is None:
        return
    try:
        observer(kind, text)
    except Exception:  # a test hook must never break a service
        log.exception("the pre-auth test observer failed")


# --------------------------------------------------------------------------- the gate


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    source: str
    since: float
    started: bool = False  # its handshake thread runs (else it waits in the selector)


class PreauthGate(Generic[T]):
    """Accepts on ``listener`` and runs each handshake off the accept thread.

    The gate's thread (the owner's, in :meth:`serve` or a loop of :meth:`step`) only
    accepts and watches the raw sockets in a selector: a stranger that stays silent
    costs no thread and is closed at its deadline; one whose first bytes are not
    ``first_bytes`` (what every client sends first, e.g. the hello magic) is closed at
    once. A socket that spoke correctly gets a thread of its own for ``handshake``
    (see :data:`Handshake`), which turns it into an authenticated result;
    ``on_ready(result)`` then runs on that thread (it may serve the client there, or
    hand it on). ``on_reject(exc)`` is told about every handshake that failed
    (optional, e.g. for an error message later). End the gate with :meth:`close`; the
    owner closes the listener. ``poll_s`` bounds how long a step waits, so that the
    owner's loop notices it should stop.
    """

    def __init__(
        self,
        listener: socket.socket,
        *,
        name: str,
        handshake: Handshake[T],
        on_ready: Callable[[T], None],
        on_reject: Callable[[BaseException], None] | None = None,
        first_bytes: bytes = b"",
        deadline_s: float = PREAUTH_DEADLINE_S,
        max_pending: int = MAX_PENDING,
        max_per_source: int = MAX_PENDING_PER_SOURCE,
        poll_s: float = 0.2,
    ) -> None:
        if deadline_s <= 0 or max_pending < 1 or max_per_source < 1 or poll_s <= 0:
            raise ValueError("the pre-auth deadline, caps and poll interval must be positive")
        self._listener = listener
        self.name = name
        self._handshake = handshake
        self._on_ready = on_ready
        self._on_reject = on_reject
        self._first_bytes = bytes(first_bytes)
        self.deadline_s = deadline_s
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, _Pending] = OrderedDict()  # oldest first
        self._ids = itertools.count()
        self._closed = False
        listener.setblocking(False)  # the selector says when; accept() never waits
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)
        self.dropped = 0
        """Pending connections dropped to make room (for tests and logs)."""

    # ----------------------------------------------------------------- the gate's thread

    def serve(self, done: Callable[[], bool]) -> None:
        """Run :meth:`step` until ``done()`` or :meth:`close`; then drop every pending
        stranger."""
        try:
            while not self._closed and not done():
                try:
                    self.step()
                except OSError as exc:
                    if self._closed or done():
                        return
                    log.warning("%s: accept failed: %s", self.name, exc)
                    time.sleep(0.05)  # e.g. out of descriptors: let handshakes finish
        finally:
            self._drop_all()
            self._sel.close()

    def step(self) -> None:
        """Wait at most ``poll_s`` (less if a deadline comes first), then accept new
        connections, start the handshakes of those that spoke and close those that
        spoke wrongly or stayed silent too long. Raises ``OSError`` if the listener
        failed. Call it from one thread only."""
        wait = self.poll_s
        with self._lock:
            waiting = [p.since for p in self._pending.values() if not p.started]
        if waiting:
            wait = min(wait, max(0.0, min(waiting) + self.deadline_s - time.monotonic()))
        for key, _ in self._sel.select(wait):
            if self._closed:
                return
            if key.data is None:
                self._accept_queued()
            else:
                self._spoke(*key.data)
        self._expire()

    def _accept_queued(self) -> None:
        for _ in range(self.max_pending):  # bounded: the rest waits for the next step
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, TimeoutError):
                return
            sock.setblocking(True)
            source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            entry = _Pending(sock, source, time.monotonic())
            key = next(self._ids)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                victims = self._make_room(source)
                self._pending[key] = entry
            for victim in victims:
                self._drop(victim)
            self._sel.register(sock, selectors.EVENT_READ, (key, entry))

    def _make_room(self, source: str) -> list[_Pending]:
        """Unregister (oldest first) what must go before ``source`` adds one; holds the lock."""
        victims: list[_Pending] = []
        same = [k for k, p in self._pending.items() if p.source == source]
        while len(same) >= self.max_per_source:
            victims.append(self._pending.pop(same.pop(0)))
        while len(self._pending) >= self.max_pending:
            victims.append(self._pending.popitem(last=False)[1])
        self.dropped += len(victims)
        if victims:
            log.debug("%s: dropped %d oldest pre-auth connection(s)", self.name, len(victims))
        return victims

    def _spoke(self, key: int, entry: _Pending) -> None:
        """``entry`` is readable: its first bytes decide between a thread and the door."""
        with self._lock:
            if key not in self._pending:  # dropped earlier in this step, or by close()
                return
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(entry.sock)
        want = self._first_bytes
        try:
            first = entry.sock.recv(max(len(want), 1), socket.MSG_PEEK)
        except OSError:
            first = b""
        with self._lock:
            if first and first == want[: len(first)] and key in self._pending:
                entry.started = True
            else:  # closed, reset, or not our protocol: no thread for it
                self._pending.pop(key, None)
        if not entry.started:
            entry.sock.close()
            return
        threading.Thread(
            target=self._run, args=(key, entry), name=f"sparktrain-{self.name}-preauth", daemon=True
        ).start()

    def _expire(self) -> None:
        limit = time.monotonic() - self.deadline_s
        with self._lock:
            late = [k for k, p in self._pending.items() if not p.started and p.since <= limit]
            victims = [self._pending.pop(k) for k in late]
        for victim in victims:
            self._drop(victim)

    def _drop(self, entry: _Pending) -> None:
        """End a pending connection. One still in the selector is this thread's to close;
        a started one is shut down, which wakes its handshake thread, and that thread
        closes it (closing here could hand the descriptor to another socket under it)."""
        if entry.started:
            with contextlib.suppress(OSError):
                entry.sock.shutdown(socket.SHUT_RDWR)
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(entry.sock)
        entry.sock.close()

    # ----------------------------------------------------------------- handshakes

    def _run(self, key: int, entry: _Pending) -> None:
        def authenticated() -> bool:
            with self._lock:
                return self._pending.pop(key, None) is not None

        try:
            result = self._handshake(entry.sock, entry.since + self.deadline_s, authenticated)
        except Exception as exc:  # the handshake closed the socket; a stranger's fault
            log.debug("%s: refused a connection from %s: %s", self.name, entry.source, exc)
            self._forget(key)
            if self._on_reject is not None and not self._closed:
                self._on_reject(exc)
            return
        if self._forget(key):  # the handshake never called authenticated(): not proven
            return
        self._on_ready(result)

    def _forget(self, key: int) -> bool:
        with self._lock:
            entry = self._pending.pop(key, None)
        if entry is not None:
            with contextlib.suppress(OSError):
                entry.sock.close()
        return entry is not None

    # ----------------------------------------------------------------- state

    @property
    def pending(self) -> int:
        """Unauthenticated connections held right now."""
        with self._lock:
            return len(self._pending)

    def pending_from(self, source: str) -> int:
        """Unauthenticated connections from ``source`` held right now."""
        with self._lock:
            return sum(1 for p in self._pending.values() if p.source == source)

    def close(self) -> None:
        """Stop accepting and end every pending connection; idempotent, from any thread
        (the gate's thread leaves :meth:`serve`; a :meth:`step` caller should stop).
        Authenticated connections are their owners' business."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a waiting select()
        self._drop_all()

    def _drop_all(self) -> None:
        with self._lock:
            victims = list(self._pending.values())
            self._pending.clear()
        for victim in victims:
            self._drop(victim)
