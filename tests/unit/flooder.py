"""A half-open flood for the pre-auth gate's flood test (:mod:`tests.unit.test_preauth_flood`).

Run as ``python -m tests.unit.flooder HOST PORT SOURCES PER_SOURCE PARTIAL_HEX MAX_S``: it
keeps ``PER_SOURCE`` connections open from each of ``SOURCES`` loopback addresses, one
per /16 (127.10.0.1, 127.11.0.1, ...: Linux routes all of 127.0.0.0/8 to ``lo``, so a
/24 or /16 grouping of sources would see ``SOURCES`` different networks). Every other
connection sends ``PARTIAL_HEX`` (the protocol's first bytes, never a whole hello) and
then nothing; the others send nothing at all. A connection the server closes is opened
again at once: the flood churns as fast as this process can dial. It prints ``ready``
once every slot was opened once, and stops when its stdin closes or after ``MAX_S``.

A module of its own, standard library only, so it starts in milliseconds in a process of
its own and shares nothing (no GIL, no sparktrain) with the gate it floods.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import sys
import time

CONNECT_WAIT_S = 1.0  # a connect the backlog never took is abandoned and dialed again


def source(i: int) -> str:
    """The ``i``-th flooding address: one per /16 of 127.0.0.0/8."""
    return f"127.{10 + i}.0.1"


def run(host: str, port: int, sources: int, per_source: int, partial: bytes, max_s: float) -> None:
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ, None)
    slots: list[tuple[str, bool]] = [
        (source(i), j % 2 == 1) for i in range(sources) for j in range(per_source)
    ]
    socks: dict[int, tuple[socket.socket, float]] = {}  # slot -> socket, dialed at
    connecting: set[int] = set()
    opened_once = [False] * len(slots)
    ready = False

    def dial(n: int) -> None:
        addr, _ = slots[n]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((addr, 0))
            err = sock.connect_ex((host, port))
        except OSError:
            sock.close()
            return
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            return
        socks[n] = (sock, time.monotonic())
        connecting.add(n)
        sel.register(sock, selectors.EVENT_WRITE, n)

    def close(n: int) -> None:
        sock, _ = socks.pop(n)
        connecting.discard(n)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(sock)
        sock.close()

    deadline = time.monotonic() + max_s
    try:
        while time.monotonic() < deadline:
            for n in range(len(slots)):  # refill every closed slot at once
                if n not in socks:
                    dial(n)
            for key, events in sel.select(0.01):
                n = key.data
                if n is None:  # stdin: closed (or anything) means stop
                    return
                sock, _ = socks[n]
                if events & selectors.EVENT_WRITE:
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        close(n)
                        continue
                    connecting.discard(n)
                    opened_once[n] = True
                    sel.modify(sock, selectors.EVENT_READ, n)
                    if slots[n][1]:
                        with contextlib.suppress(OSError):
                            sock.send(partial)
                    continue
                try:
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # the server closed it: dial again
                    close(n)
            now = time.monotonic()
            for n in [n for n in connecting if now - socks[n][1] > CONNECT_WAIT_S]:
                close(n)
            if not ready and all(opened_once):
                ready = True
                print("ready", flush=True)
    finally:
        for n in list(socks):
            close(n)
        sel.close()


if __name__ == "__main__":
    h, p, s, ps, hexed, m = sys.argv[1:7]
    run(h, int(p), int(s), int(ps), bytes.fromhex(hexed), float(m))
