"""Which TCP listeners a process holds, read from Linux's /proc (no psutil, no ``ss``).

Shared by the tests that check where a listener binds (tests/unit/test_torch_store_bind.py)
and by the accumulator attack's victim process (tests/integration/accumulator_victim.py),
which floods every listener of a Spark driver. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

LISTEN = "0A"  # the TCP state column of /proc/net/tcp{,6}


def _socket_inodes(pid: int | str) -> set[str]:
    inodes = set()
    fds = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):
                target = os.readlink(fds / fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # IPv6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def listeners(pid: int | str = "self") -> list[tuple[str, int]]:
    """``(address, port)`` of every listening TCP socket process ``pid`` holds (IPv4 and
    IPv6; a wildcard shows as ``0.0.0.0`` or ``::``)."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            for line in lines:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == LISTEN and inode in inodes:
                    addr_hex, port_hex = local.split(":")
                    found.append((_address(addr_hex), int(port_hex, 16)))
    return found


def bound_to(port: int, pid: int | str = "self") -> list[str]:
    """The addresses process ``pid`` listens on at ``port`` (empty: none)."""
    return [addr for addr, p in listeners(pid) if p == port]
