"""Listeners and addresses: where sparktrain processes meet.

Listeners bind the task's own address, never a wildcard address (in any spelling,
IPv4-mapped ones included), and always have a timeout. Addresses travel as
``"host:port"`` strings (IPv6 hosts in brackets).

Executor-side code: this module never imports pyspark.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket

from sparktrain.errors import ConfigError

SOCKET_BUFFER_BYTES = 4 << 20
"""SO_SNDBUF/SO_RCVBUF asked for: large buffers keep loopback and LAN pipes full."""

_UNSPECIFIED_HOSTS = ("", "*")


def _check_bind_host(host: str) -> None:
    if host in _UNSPECIFIED_HOSTS:
        raise ConfigError(
            f"refusing to listen on the wildcard address {host!r}: bind to the task's own "
            "address (e.g. 127.0.0.1 on one machine, the executor's host otherwise)"
        )
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return  # a host name: resolved below
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    if ip.is_unspecified or (mapped is not None and mapped.is_unspecified):  # ::ffff:0.0.0.0
        raise ConfigError(
            f"refusing to listen on the wildcard address {host!r}: bind to the task's own "
            "address (e.g. 127.0.0.1 on one machine, the executor's host otherwise)"
        )


def tune_socket(sock: socket.socket) -> None:
    """Low latency (no Nagle) and big buffers (bandwidth); best effort."""
    for level, opt, value in (
        (socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES),
        (socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES),
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
    ):
        with contextlib.suppress(OSError):
            sock.setsockopt(level, opt, value)


LISTEN_BACKLOG = 1024
"""The kernel's accept queue per listener (capped by ``net.core.somaxconn``). The accept
threads drain it at once (:mod:`sparktrain.wire.preauth`), but a burst of strangers that
fills it makes the kernel drop a real client's SYN, and the client then waits a TCP
retransmission (1 s): measured as a 1-2 s slower fit under the attack test at 64."""


def open_listener(
    host: str, port: int = 0, backlog: int = LISTEN_BACKLOG, timeout: float = 1.0
) -> socket.socket:
    """Open a TCP listener on ``(host, port)`` (port 0: any free port).

    ``host`` must be the task's own address; wildcard addresses ("", "0.0.0.0", "::")
    are refused with :class:`ConfigError` so that nothing listens on interfaces it was
    not meant for. The listener gets a timeout (``timeout`` seconds) so that an
    ``accept`` on it never blocks forever.
    """
    _check_bind_host(host)
    if not 0 <= port <= 65535:
        raise ConfigError(f"listener port {port} is out of range 0..65535")
    if timeout <= 0:
        raise ConfigError(f"listener timeout must be > 0 seconds, got {timeout}")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve listener host {host!r}: {exc}") from exc
    family, _, _, _, sockaddr = infos[0]
    for _, _, _, _, candidate in infos:  # after resolution, a wildcard is still refused
        _check_bind_host(str(candidate[0]))
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune_socket(sock)  # accepted sockets inherit the buffer sizes (window scaling)
        sock.bind(sockaddr)
        sock.listen(backlog)
        sock.settimeout(timeout)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock


def address_of(listener: socket.socket) -> str:
    """The ``"host:port"`` peers dial to reach ``listener`` (IPv6 hosts in brackets)."""
    name = listener.getsockname()
    host, port = str(name[0]), int(name[1])
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def parse_address(addr: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6-host]:port"``) into ``(host, port)``."""
    hint = "expected 'host:port', e.g. '127.0.0.1:40123' or '[::1]:40123'"
    if not isinstance(addr, str) or ":" not in addr:
        raise ConfigError(f"bad peer address {addr!r}: {hint}")
    host, _, port_text = addr.rpartition(":")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ConfigError(f"bad peer address {addr!r}: {hint}")
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"bad peer address {addr!r}: put IPv6 hosts in brackets; {hint}")
    if not host or host in _UNSPECIFIED_HOSTS:
        raise ConfigError(f"bad peer address {addr!r}: the host is empty; {hint}")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"bad peer address {addr!r}: the port is not a number; {hint}") from None
    if not 1 <= port <= 65535:
        raise ConfigError(f"bad peer address {addr!r}: port {port} is out of range 1..65535")
    return host, port


class ServiceHost(str):
    """A host the driver's services listen on, carrying the port range they may take
    (``driver_services_ports``; None: any free port). A plain ``str`` everywhere else,
    so it passes through every service's ``host`` argument."""

    ports: tuple[int, int] | None

    def __new__(cls, host: str, ports: tuple[int, int] | None = None) -> ServiceHost:
        made = super().__new__(cls, host)
        made.ports = ports
        return made


def open_service_listener(host: str) -> socket.socket:
    """:func:`open_listener` on ``host``, on the first free port of its range when it is
    a :class:`ServiceHost` with one."""
    ports = getattr(host, "ports", None)
    if ports is None:
        return open_listener(host)
    low, high = ports
    for port in range(low, high + 1):
        try:
            return open_listener(host, port)
        except ConfigError as exc:
            cause = exc.__cause__
            if isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE:
                continue  # taken: the next port of the range
            raise
    raise ConfigError(
        f"every port of driver_services_ports={low}-{high} on {host} is in use: widen the "
        "range (each fit takes about four ports, more with ps shards)"
    )
