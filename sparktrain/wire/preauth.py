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
* the unauthenticated connections are bounded in total (:data:`MAX_PENDING`), per
  address prefix (:data:`MAX_PENDING_PER_PREFIX`, see :func:`address_prefix`) and per
  source address (:data:`MAX_PENDING_PER_SOURCE`). At a bound the new connection is
  always admitted (a flood cannot lock real clients out) and one already pending goes:
  the one with the least progress (silent, then mid-hello, then waiting for its proof),
  from the most crowded prefix, accepted first (:class:`PendingTable`). A real client
  sends its hello with its connection and its proof a round trip after the challenge,
  so a flood of strangers that never finish a hello never evicts it; a stranger that
  does finish one is still older than a real client at that stage, and if a real
  client's handshake is dropped all the same, the client dials again
  (:func:`sparktrain.wire.handshake.connect`);
* a connection leaves the registry the moment its MAC verifies (the handshake calls
  the ``authenticated`` callback before sending the verdict), so a proven client is
  never dropped; it is handed to ``on_ready`` on its handshake thread.

The gate knows nothing about the handshake itself (:mod:`sparktrain.wire.handshake` does):
owners pass a ``handshake(sock, deadline, authenticated)`` function, which calls
:func:`hello_received` when the client's hello is complete.

Executor-side code: this module never imports pyspark.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

PREAUTH_DEADLINE_S = 3.0
"""How long a client has to complete the handshake. A real client sends its hello as
soon as it is connected and its MAC one round trip later (milliseconds, even on a
loaded host); a stranger gets no more than this of a handshake slot."""

MAX_PENDING = 128
"""Unauthenticated connections one listener keeps at once. Large enough for every rank
of a big job to handshake at once (each takes milliseconds), small enough that a flood
costs bounded threads and descriptors (a thread only for a connection that sent the
protocol's first bytes)."""

MAX_PENDING_PER_PREFIX = 96
"""Unauthenticated connections one address prefix (:func:`address_prefix`) keeps at
once: :data:`MAX_PENDING` less a source's cap. A flood from one subnet, or from one
host's many loopback addresses, never holds the whole table, so clients from elsewhere
always find room without evicting anyone. Not lower: a prefix over its cap churns (each
newcomer evicts one, which the flooder dials again), and at 64 the attack tests' mild
flood of 100 connections per listener measured a tree_aggregate fit 1.15-1.22x slower
(0.86-1.05x with no prefix cap)."""

MAX_PENDING_PER_SOURCE = 32
"""Unauthenticated connections one source address keeps at once. A single flooding
address never fills its prefix's share; many executors of one host still fit."""

HELLO_GRACE_S = 0.1
"""A connection that sent nothing yet but is younger than this ranks as mid-hello
(:data:`SPOKE`) for eviction: a real client sends its hello right after its connect
returns, but under a flood the gate may accept it (and evict for the next newcomer)
before those bytes land. Past it, silence marks a stranger."""

PREFIX_BITS_V4 = 24
"""IPv4 sources are grouped by /24: a host that takes extra addresses (aliases) can
usually only take them in its own subnet, and /24 is the smallest common LAN subnet, so
one attacker's addresses share a group while other hosts' rarely do."""

PREFIX_BITS_V6 = 64
"""IPv6 sources are grouped by /64: every host is handed a whole /64 (SLAAC, privacy
addresses) and can use any address of it, so a /64 is at most one LAN."""

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


# --------------------------------------------------------------------------- the policy

ARRIVED = 0
"""Stage of a connection that sent nothing yet (it waits in the gate's selector)."""
SPOKE = 1
"""Stage of a connection whose first bytes are the protocol's but whose first message is
not complete yet."""
HELLO = 2
"""Stage of a connection whose complete first message arrived (the hello; with TLS, the
ClientHello record) or whose handshake reported a complete, well-formed hello
(:func:`hello_received`): its handshake thread runs, and the client's proof is due
within a round trip or two. Anyone can send a hello, so this is progress, not proof;
the protocol lets a client prove the secret only by the MAC over the server's nonce, and
once that verified the connection is no longer pending at all: nothing evicts it."""


def address_prefix(source: str) -> str:
    """The group ``source`` (an IP address) is capped in: its IPv4 /:data:`PREFIX_BITS_V4`
    or IPv6 /:data:`PREFIX_BITS_V6` network; every loopback address (127.0.0.0/8, ::1) is
    one group, ``"loopback"``, and anything else (not an IP address) is its own group."""
    prefix = _PREFIXES.get(source)
    if prefix is None:
        if len(_PREFIXES) >= _PREFIX_CACHE:  # a flood of addresses: start over, bounded
            _PREFIXES.clear()
        prefix = _PREFIXES[source] = _address_prefix(source)
    return prefix


_PREFIXES: dict[str, str] = {}  # parsing costs more than the rest of an accept
_PREFIX_CACHE = 4096


def _address_prefix(source: str) -> str:
    try:
        ip = ipaddress.ip_address(source.partition("%")[0])  # drop an IPv6 zone (fe80::1%eth0)
    except ValueError:
        return source
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:10.0.0.5 is the IPv4 host 10.0.0.5
    if ip.is_loopback:  # all of 127.0.0.0/8 is this host, and any local user binds any of it
        return "loopback"
    bits = PREFIX_BITS_V4 if ip.version == 4 else PREFIX_BITS_V6
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


@dataclass(eq=False)
class Slot:
    """What the eviction policy knows of one unauthenticated connection."""

    source: str
    since: float  # accepted at (time.monotonic())
    stage: int = ARRIVED
    prefix: str = ""  # address_prefix(source) unless given

    def __post_init__(self) -> None:
        if not self.prefix:
            self.prefix = address_prefix(self.source)


S = TypeVar("S", bound=Slot)


class PendingTable(Generic[S]):
    """The unauthenticated connections of one gate, and who goes when a cap is reached.

    Three caps: ``max_pending`` in all, ``max_per_prefix`` per address prefix
    (:func:`address_prefix`), ``max_per_source`` per address. A newcomer is always
    admitted (a flood must not lock real clients out); room is made by evicting, within
    the group over its cap, the connection with the least progress (:data:`ARRIVED`
    for longer than :data:`HELLO_GRACE_S`, before :data:`SPOKE`, before :data:`HELLO`),
    then, when the whole table is full, from the prefix holding the most, then the
    stalest (accepted first); the newcomer's ``since`` is the time they are judged at.

    A real client sends its hello with its connection and its proof one round trip
    after the server's challenge, so it spends milliseconds in each stage: strangers
    that stall at a stage are older there, and a flood of strangers that never complete
    a hello cannot evict a client whose hello did. Pure bookkeeping (no sockets); not
    thread-safe (the gate holds its lock).
    """

    def __init__(self, max_pending: int, max_per_source: int, max_per_prefix: int) -> None:
        if min(max_pending, max_per_source, max_per_prefix) < 1:
            raise ValueError("the pre-auth caps must be positive")
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self.max_per_prefix = max_per_prefix
        self._slots: dict[int, S] = {}  # insertion order: oldest first
        self._sources: Counter[str] = Counter()
        self._prefixes: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def values(self) -> list[S]:
        """The pending slots, oldest first."""
        return list(self._slots.values())

    def items(self) -> list[tuple[int, S]]:
        """The pending slots with their keys, oldest first."""
        return list(self._slots.items())

    def from_source(self, source: str) -> int:
        """Slots held for the address ``source``."""
        return self._sources[source]

    def from_prefix(self, prefix: str) -> int:
        """Slots held for the address prefix ``prefix`` (see :func:`address_prefix`)."""
        return self._prefixes[prefix]

    def admit(self, key: int, slot: S) -> list[S]:
        """Add ``slot`` under ``key``; returns the slots evicted to make room for it
        (already removed), per source first, then per prefix, then in all."""
        victims: list[S] = []
        now = slot.since
        while self._sources[slot.source] >= self.max_per_source:
            victims.append(self._evict(now, source=slot.source))
        while self._prefixes[slot.prefix] >= self.max_per_prefix:
            victims.append(self._evict(now, prefix=slot.prefix))
        while len(self._slots) >= self.max_pending:
            victims.append(self._evict(now))
        self._slots[key] = slot
        self._sources[slot.source] += 1
        self._prefixes[slot.prefix] += 1
        return victims

    def pop(self, key: int) -> S | None:
        """Remove ``key`` (proven, failed or closed); None if it is gone already."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._sources[slot.source] -= 1
            self._prefixes[slot.prefix] -= 1
            if not self._sources[slot.source]:
                del self._sources[slot.source]
            if not self._prefixes[slot.prefix]:
                del self._prefixes[slot.prefix]
        return slot

    def clear(self) -> list[S]:
        """Remove and return every slot."""
        slots = list(self._slots.values())
        self._slots.clear()
        self._sources.clear()
        self._prefixes.clear()
        return slots

    def _evict(self, now: float, source: str | None = None, prefix: str | None = None) -> S:
        """Pop the victim among the slots of ``source``, else of ``prefix``, else all:
        least progress (a silent one within :data:`HELLO_GRACE_S` counts as mid-hello),
        then the most crowded prefix, then the stalest. Slots are in accept order, so in
        one source or prefix the first silent one past its grace is the victim and the
        scan stops there: the common case under a flood, and it keeps an accept cheap."""
        one_prefix = source is not None or prefix is not None
        best_key, best = -1, (HELLO + 1, 0, 0.0)
        for key, slot in self._slots.items():
            if (source is not None and slot.source != source) or (
                prefix is not None and slot.prefix != prefix
            ):
                continue
            stage = slot.stage
            if stage == ARRIVED and now - slot.since < HELLO_GRACE_S:
                stage = SPOKE  # its hello may be on the way
            rank = (stage, -self._prefixes[slot.prefix], slot.since)
            if rank < best:
                best_key, best = key, rank
                if stage == ARRIVED and one_prefix:
                    break
        victim = self.pop(best_key)
        assert victim is not None  # the caps are >= 1: the group over its cap is not empty
        return victim


# --------------------------------------------------------------------------- the gate

_handshake_thread = threading.local()  # the running handshake's progress hook, per thread


def hello_received() -> None:
    """Tell the gate running this handshake that the client's complete, well-formed hello
    arrived (stage :data:`HELLO`, evicted only after every connection that has not got
    that far). Called by the server side of the handshake
    (:func:`sparktrain.wire.handshake.serve_accepted`); a no-op outside a gate's
    handshake thread."""
    hook = getattr(_handshake_thread, "hello", None)
    if hook is not None:
        hook()


@dataclass(eq=False)
class _Pending(Slot):
    sock: socket.socket = field(kw_only=True)
    started: bool = field(default=False, kw_only=True)  # its handshake thread runs
    lowat: bool = field(default=False, kw_only=True)  # SO_RCVLOWAT raised: wakes when complete


MAX_FIRST_MESSAGE = 1 << 15
"""A first message claiming more bytes than this is not a client's (a TLS record is at
most 16 KiB and change, the plaintext hello 44 bytes): closed at once."""

_HEAD_BYTES = 64  # peeked at once: the protocol, and all of a plaintext hello (44 bytes)


class PreauthGate(Generic[T]):
    """Accepts on ``listener`` and runs each handshake off the accept thread.

    The gate's thread (the owner's, in :meth:`serve` or a loop of :meth:`step`) only
    accepts and watches the raw sockets in a selector: a stranger that stays silent
    costs no thread and is closed at its deadline; one whose first bytes are not
    ``first_bytes`` (what every client sends first, e.g. the hello magic) is closed at
    once. A socket that spoke correctly gets a thread of its own for ``handshake``
    (see :data:`Handshake`), which turns it into an authenticated result;
    ``on_ready(result)`` then runs on that thread (it may serve the client there, or
    hand it on). ``first_size(head)``, if given, is how many bytes the client's whole
    first message has, judged from its first bytes: the thread then starts only once
    they all arrived (a stranger that stops mid-hello costs no thread either; waiting
    needs ``SO_RCVLOWAT``, else the thread starts on the first bytes).
    ``on_reject(exc)`` is told about every handshake that failed
    (optional, e.g. for an error message later). End the gate with :meth:`close`; the
    owner closes the listener. ``poll_s`` bounds how long a step waits, so that the
    owner's loop notices it should stop. The caps and who is evicted at them:
    :class:`PendingTable` (``max_per_prefix`` None: :data:`MAX_PENDING_PER_PREFIX`).
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
        first_size: Callable[[bytes], int] | None = None,
        deadline_s: float = PREAUTH_DEADLINE_S,
        max_pending: int = MAX_PENDING,
        max_per_source: int = MAX_PENDING_PER_SOURCE,
        max_per_prefix: int | None = None,
        poll_s: float = 0.2,
    ) -> None:
        if max_per_prefix is None:  # read now, not at import: tests may lift it
            max_per_prefix = MAX_PENDING_PER_PREFIX
        if deadline_s <= 0 or poll_s <= 0:
            raise ValueError("the pre-auth deadline, caps and poll interval must be positive")
        self._table: PendingTable[_Pending] = PendingTable(
            max_pending, max_per_source, max_per_prefix
        )
        self._listener = listener
        self.name = name
        self._handshake = handshake
        self._on_ready = on_ready
        self._on_reject = on_reject
        self._first_bytes = bytes(first_bytes)
        self._first_size = first_size
        self.deadline_s = deadline_s
        self.max_pending = max_pending
        self.max_per_source = max_per_source
        self.max_per_prefix = max_per_prefix
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self._gate_thread: threading.Thread | None = None
        """The thread in :meth:`serve`, which alone closes pending sockets while it runs."""
        listener.setblocking(False)  # the selector says when; accept() never waits
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)
        self.dropped = 0
        """Pending connections dropped to make room (for tests and logs)."""
        self.dropped_at: Counter[int] = Counter()
        """The same, by the stage they had reached (:data:`ARRIVED`, :data:`SPOKE`,
        :data:`HELLO`)."""

    # ----------------------------------------------------------------- the gate's thread

    def serve(self, done: Callable[[], bool]) -> None:
        """Run :meth:`step` until ``done()`` or :meth:`close`; then drop every pending
        stranger."""
        self._gate_thread = threading.current_thread()
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
            self._gate_thread = None

    def step(self) -> None:
        """Wait at most ``poll_s`` (less if a deadline comes first), then accept new
        connections, start the handshakes of those that spoke and close those that
        spoke wrongly or stayed silent too long. Raises ``OSError`` if the listener
        failed. Call it from one thread only."""
        wait = self.poll_s
        with self._lock:
            waiting = [p.since for p in self._table.values() if not p.started]
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
        # a client that waited in the backlog has its hello in by now: looked at below
        for _ in range(self.max_pending):  # bounded: the rest waits for the next step
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, TimeoutError):
                return
            sock.setblocking(False)  # until its handshake thread starts: peeks never wait
            source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
            entry = _Pending(source, time.monotonic(), sock=sock)
            key = next(self._ids)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                victims = self._table.admit(key, entry)
                self._count_drops(victims)
            for victim in victims:
                self._drop(victim)
            # a real client's hello comes with its connection: look at once, so that it
            # is never taken for a silent stranger (the first to go) while it waits
            if not self._look(key, entry):
                self._sel.register(sock, selectors.EVENT_READ, (key, entry))

    def _count_drops(self, victims: list[_Pending]) -> None:
        """Count what :meth:`PendingTable.admit` evicted; holds the lock."""
        self.dropped += len(victims)
        self.dropped_at.update(v.stage for v in victims)
        if victims:
            log.debug("%s: dropped %d pre-auth connection(s)", self.name, len(victims))

    def _spoke(self, key: int, entry: _Pending) -> None:
        """``entry`` is readable: its first bytes decide between a thread and the door."""
        with self._lock:
            if key not in self._table:  # dropped earlier in this step, or by close()
                return
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(entry.sock)
        if not self._look(key, entry):  # nothing to read after all: keep waiting
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.register(entry.sock, selectors.EVENT_READ, (key, entry))

    def _look(self, key: int, entry: _Pending) -> bool:
        """Peek at the first bytes of ``entry`` (not in the selector): start its handshake
        thread once its first message is complete, close it if they are not the
        protocol's (or it closed). False: keep waiting for (the rest of) it."""
        want = self._first_bytes
        try:
            head = entry.sock.recv(max(len(want), _HEAD_BYTES), socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            head = b""
        complete: bool | None = None  # None: to the door
        if head and head[: len(want)] == want[: len(head)]:
            complete = self._complete(entry, head)
        with self._lock:
            if key not in self._table:
                complete = None  # dropped meanwhile (close())
            elif complete is None:
                self._table.pop(key)  # closed, reset, or not our protocol: no thread for it
            else:  # a complete first message is as far as a stranger gets without the secret
                entry.stage = HELLO if complete and self._first_size is not None else SPOKE
                entry.started = complete
        if complete is None:
            entry.sock.close()
            return True
        if not complete:
            return False
        entry.sock.setblocking(True)  # the handshake's reads have deadlines of their own
        threading.Thread(
            target=self._run, args=(key, entry), name=f"sparktrain-{self.name}-preauth", daemon=True
        ).start()
        return True

    def _complete(self, entry: _Pending, head: bytes) -> bool | None:
        """Whether the first message that starts with ``head`` has fully arrived; if not,
        the socket's ``SO_RCVLOWAT`` is raised to its size, so that the selector wakes
        once it has (or at EOF). None: it claims a size no client sends."""
        if self._first_size is None:
            return True  # the owner did not say: the thread waits for the rest
        size = self._first_size(head)
        if size > MAX_FIRST_MESSAGE:
            return None
        have = len(head)
        if size > have == _HEAD_BYTES:  # more may be there than the first peek asked for
            try:
                have = len(entry.sock.recv(size, socket.MSG_PEEK))
            except OSError:
                have = 0
        try:
            if have >= size:
                if entry.lowat:  # blocking reads would wait for that many bytes too
                    entry.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                return True
            entry.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, size)
        except (OSError, AttributeError):  # no SO_RCVLOWAT here: a thread waits instead
            return True
        entry.lowat = True
        return False

    def _expire(self) -> None:
        limit = time.monotonic() - self.deadline_s
        with self._lock:
            late = [k for k, p in self._table.items() if not p.started and p.since <= limit]
            victims = [v for v in map(self._table.pop, late) if v is not None]
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
                return self._table.pop(key) is not None

        def hello() -> None:
            with self._lock:
                if key in self._table:
                    entry.stage = HELLO

        _handshake_thread.hello = hello
        try:
            result = self._handshake(entry.sock, entry.since + self.deadline_s, authenticated)
        except Exception as exc:  # the handshake closed the socket; a stranger's fault
            log.debug("%s: refused a connection from %s: %s", self.name, entry.source, exc)
            self._forget(key)
            if self._on_reject is not None and not self._closed:
                self._on_reject(exc)
            return
        finally:
            _handshake_thread.hello = None
        if self._forget(key):  # the handshake never called authenticated(): not proven
            return
        self._on_ready(result)

    def _forget(self, key: int) -> bool:
        with self._lock:
            entry = self._table.pop(key)
        if entry is not None:
            with contextlib.suppress(OSError):
                entry.sock.close()
        return entry is not None

    # ----------------------------------------------------------------- state

    @property
    def pending(self) -> int:
        """Unauthenticated connections held right now."""
        with self._lock:
            return len(self._table)

    def pending_from(self, source: str) -> int:
        """Unauthenticated connections from ``source`` held right now."""
        with self._lock:
            return self._table.from_source(source)

    def close(self) -> None:
        """Stop accepting and end every pending connection; idempotent, from any thread
        (the gate's thread leaves :meth:`serve`; a :meth:`step` caller should stop).
        Authenticated connections are their owners' business."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a waiting select()
        gate = self._gate_thread
        if gate is not None and gate is not threading.current_thread() and gate.is_alive():
            # serve() drops them as it leaves: closing a socket here, under its step,
            # would hand that step a dead descriptor to peek at or to register
            return
        self._drop_all()

    def _drop_all(self) -> None:
        with self._lock:
            victims = self._table.clear()
        for victim in victims:
            self._drop(victim)
