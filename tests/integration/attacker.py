"""A hostile process for the attack tests: holds strangers' connections open.

:func:`run` is started in a process of its own (multiprocessing, "spawn"). For every
target address it is sent, it keeps connections open as its :class:`Flood` says. The
default, :data:`MILD`: :data:`SILENT` connections that never send a byte and
:data:`NOISY` connections that send random bytes (1..120 of them: shorter than a hello
waits for the rest, longer is refused at once), from the loopback aliases 127.0.0.2
and up, a closed one opened again after :data:`REFILL_S`. :data:`HALF_OPEN` (issue
31): 4 connections from each of 64 loopback addresses, one per /16, half silent and
half sending the protocol's first bytes but never a whole hello, a closed one opened
again at once. The flood lasts as long as the target listens. A target that
refuses connections (its service stopped) is forgotten. Single-threaded, selectors,
non-blocking connects: a listener that stopped accepting never stalls the attack.
Bounded: at most ``max_s`` seconds, at most :data:`MAX_TARGETS` targets.

A module of its own, not part of :mod:`tests.integration.fixtures`: the spawned process
imports it by name, and it imports only the standard library, so the attacker starts in
milliseconds and shares nothing (no torch, no Spark, no sparktrain) with what it attacks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

SILENT = 50
NOISY = 50
SOURCES = 10  # 127.0.0.2 .. 127.0.0.11
REFILL_S = 0.5  # a closed slot is reopened after this long (a flood, not a busy loop)
PARTIAL_HELLO = b"STH1\x01\x00"  # the hello magic (HELLO_PREFIX), then a stall
CONNECT_WAIT_S = 1.0  # a connect not finished by then is abandoned (backlog full)
MAX_TARGETS = 64
TICK_S = 0.1  # how often closed slots are refilled (the attacker shares the test's CPUs)


@dataclass(frozen=True)
class Flood:
    """What the attacker holds against each target: ``silent`` connections that send
    nothing and ``noisy`` ones that send ``payload`` (None: 1..120 random bytes), spread
    round-robin over ``sources`` addresses (:meth:`source`); a closed one is opened
    again after ``refill_s``."""

    silent: int
    noisy: int
    sources: int
    refill_s: float
    payload: bytes | None = None
    spread: bool = False  # one address per /16 (127.10.0.1, 127.11.0.1, ...), else 127.0.0.2..

    def source(self, i: int) -> str:
        n = i % self.sources
        return f"127.{10 + n}.0.1" if self.spread else f"127.0.0.{2 + n}"


MILD = Flood(SILENT, NOISY, SOURCES, REFILL_S)
HALF_OPEN = Flood(128, 128, 64, 0.0, payload=PARTIAL_HELLO, spread=True)
FLOODS = {"mild": MILD, "half-open": HALF_OPEN}


@dataclass
class _Slot:
    noisy: bool
    source: str
    sock: socket.socket | None = None
    connecting_since: float = 0.0
    refill_at: float = 0.0


@dataclass
class _Target:
    kind: str
    host: str
    port: int
    slots: list[_Slot] = field(default_factory=list)
    refusals: int = 0
    opened: int = 0
    closed_by_server: int = 0


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class _Attack:
    def __init__(self, flood: Flood) -> None:
        self.flood = flood
        self.sel = selectors.DefaultSelector()
        self.targets: list[_Target] = []
        self.done: list[_Target] = []

    def add(self, kind: str, address: str) -> None:
        if len(self.targets) + len(self.done) >= MAX_TARGETS:
            return
        host, port = _split(address)
        target = _Target(kind, host, port)
        flood = self.flood
        for i in range(flood.silent + flood.noisy):
            target.slots.append(_Slot(noisy=i >= flood.silent, source=flood.source(i)))
        self.targets.append(target)
        self.refill(target, time.monotonic())

    def refill(self, target: _Target, now: float) -> None:
        for slot in target.slots:
            if slot.sock is None and slot.refill_at <= now:
                self._open(target, slot, now)

    def _open(self, target: _Target, slot: _Slot, now: float) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((slot.source, 0))
            err = sock.connect_ex((target.host, target.port))
        except OSError:
            sock.close()
            slot.refill_at = now + self.flood.refill_s
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._refused(target, slot, now)
            return
        slot.sock, slot.connecting_since = sock, now
        self.sel.register(sock, selectors.EVENT_WRITE, (target, slot, "connect"))

    def _refused(self, target: _Target, slot: _Slot, now: float) -> None:
        target.refusals += 1
        slot.refill_at = now + max(self.flood.refill_s, 0.05)  # not a busy loop on a refusal

    def _close(self, slot: _Slot, now: float) -> None:
        if slot.sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(slot.sock)
            slot.sock.close()
        slot.sock, slot.refill_at = None, now + self.flood.refill_s

    def on_event(self, target: _Target, slot: _Slot, what: str, now: float) -> None:
        sock = slot.sock
        if sock is None:
            return
        if what == "connect":
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._close(slot, now)
                self._refused(target, slot, now)
                return
            target.opened += 1
            target.refusals = 0
            slot.connecting_since = 0.0
            self.sel.modify(sock, selectors.EVENT_READ, (target, slot, "read"))
            if slot.noisy:
                junk = os.urandom(1 + int.from_bytes(os.urandom(1), "little") % 120)
                with contextlib.suppress(OSError):
                    sock.send(self.flood.payload or junk)
            return
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            target.closed_by_server += 1
            self._close(slot, now)
            if not self.flood.refill_s:  # a flood: dial again at once
                self._open(target, slot, now)

    def tick(self, now: float) -> None:
        for target in list(self.targets):
            for slot in target.slots:  # a connect the backlog never took: try later
                stuck = slot.connecting_since and now - slot.connecting_since > CONNECT_WAIT_S
                if slot.sock is not None and stuck:
                    self._close(slot, now)
            if target.refusals >= 3:  # the service is gone
                for slot in target.slots:
                    self._close(slot, now)
                self.targets.remove(target)
                self.done.append(target)
                continue
            self.refill(target, now)

    def close(self) -> None:
        for target in self.targets:
            for slot in target.slots:
                self._close(slot, 0.0)
        self.sel.close()

    def summary(self) -> list[dict[str, Any]]:
        return [
            {
                "kind": t.kind,
                "address": f"{t.host}:{t.port}",
                "opened": t.opened,
                "closed_by_server": t.closed_by_server,
            }
            for t in [*self.done, *self.targets]
        ]


def run(
    targets: Any, acks: Any, results: Any, stop: Any, max_s: float, flood: str = "mild"
) -> None:
    """The attacker's main loop: ``targets`` yields ``(kind, address, ack)``; when
    ``ack`` is true, ``acks`` gets the address once its connections are under way.
    ``flood`` names the :data:`FLOODS` profile. On ``stop`` (or after ``max_s``) it puts
    a summary per target on ``results``."""
    attack = _Attack(FLOODS[flood])
    deadline = time.monotonic() + max_s
    next_tick = 0.0
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            while True:
                try:
                    kind, address, ack = targets.get_nowait()
                except queue.Empty:
                    break
                attack.add(kind, address)
                if ack:
                    acks.put(address)
            for key, _ in attack.sel.select(0.02):  # short: acks go out promptly
                attack.on_event(*key.data, time.monotonic())
            if time.monotonic() >= next_tick:
                attack.tick(time.monotonic())
                next_tick = time.monotonic() + TICK_S
    finally:
        results.put(attack.summary())
        attack.close()
