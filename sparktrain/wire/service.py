"""The driver-hosted services' common part: a listener and a pre-auth gate.

The driver serves tasks over the same authenticated wire as the collectives: rank 0's
progress (:mod:`sparktrain.driver.services.metrics_server`), the barrier stage's rendezvous
(:mod:`sparktrain.driver.services.rendezvous`), tree_aggregate's weights
(:mod:`sparktrain.strategies.tree_aggregate.driver_weights`), rank 0's trained state
(:mod:`sparktrain.driver.services.state_receiver`) and the parameter-server shards
(:mod:`sparktrain.strategies.ps.server`). Each binds to the driver's own host and proves the job
secret in the handshake with every client. The accept thread only accepts: each
handshake runs on a thread of its own under the pre-auth gate
(:mod:`sparktrain.wire.preauth`: a deadline of
:data:`~sparktrain.wire.preauth.PREAUTH_DEADLINE_S`, capped strangers, those that got
least far evicted first), so silent or garbage-sending strangers never delay an
authenticated client. That thread then serves the client with :meth:`DriverService.handle`.
:meth:`DriverService.stop` ends the accept loop at once.

A service that lives across stage attempts (a parameter-server shard) passes its
attempt as a callable, read when each handshake starts; :meth:`DriverService.admit`
closes a connection whose attempt is no longer current once its handshake is done.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import MAX_FRAME_BYTES_DEFAULT
from sparktrain.wire.handshake import DRIVER_RANK, first_bytes, first_size, serve_accepted
from sparktrain.wire.link import LinkProfile
from sparktrain.wire.listen import address_of, open_service_listener
from sparktrain.wire.preauth import PreauthGate, notify_observer
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.stats import CommStats

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
"""The socket timeout an authenticated client's connection starts with, until
:meth:`DriverService.handle` sets its own (e.g. for the request that follows the
handshake). The handshake itself has the gate's short pre-auth deadline."""


class DriverService:
    """Subclasses implement :meth:`handle`; start the loop with :meth:`start`.

    ``attempt`` is the stage attempt clients must prove: an int, or a callable returning
    the current one. ``name`` (default: the class's) names the threads and logs.
    ``stats`` is shared by every connection (default: a fresh
    :class:`~sparktrain.wire.stats.CommStats` per connection); ``link`` and
    ``max_frame_bytes`` shape and cap every connection's frames as the tasks' own.
    """

    name = "service"

    def __init__(
        self,
        host: str,
        *,
        secret: bytes,
        job_id: str,
        attempt: int | Callable[[], int],
        security: WireSecurity | None = None,
        name: str | None = None,
        stats: CommStats | None = None,
        link: LinkProfile | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
    ) -> None:
        if name is not None:
            self.name = name
        self._listener = open_service_listener(host)  # its range, if it has one
        self.address = address_of(self._listener)
        self._secret, self._job_id = secret, job_id
        self._attempt = attempt if callable(attempt) else _constant(attempt)
        self._security = security  # frame MACs / TLS, as the job's tasks use them
        self._stats, self._link, self._max_frame_bytes = stats, link, max_frame_bytes
        self._stopping = threading.Event()
        self._gate = PreauthGate(
            self._listener,
            name=self.name,
            handshake=self._handshake,
            on_ready=self._ready,
            first_bytes=first_bytes(security),
            first_size=first_size(security),
        )
        self._thread = threading.Thread(
            target=self._gate.serve,
            args=(self._turn,),
            name=f"sparktrain-{self.name}",
            daemon=True,
        )

    def start(self) -> None:
        """Start accepting (call once, after the subclass set up its own state)."""
        self._thread.start()
        notify_observer("listener", self.address)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def attempt(self) -> int:
        """The stage attempt a client must prove right now."""
        return self._attempt()

    def _turn(self) -> bool:
        """The gate's ``done()``, asked before each turn of the accept loop (at least
        every poll interval): True once stopping, else runs :meth:`tick`."""
        if self._stopping.is_set():
            return True
        self.tick()
        return False

    def tick(self) -> None:
        """Housekeeping on the accept thread, at least every gate poll interval
        (e.g. expiring reconnect graces). Default: nothing."""

    def _handshake(
        self, sock: socket.socket, deadline: float, authenticated: Callable[[], bool]
    ) -> tuple[int, Connection]:
        attempt = self.attempt  # read when the handshake starts: a new attempt counts at once
        return attempt, serve_accepted(
            sock,
            secret=self._secret,
            job_id=self._job_id,
            attempt=attempt,
            my_rank=DRIVER_RANK,
            deadline=deadline,
            stats=self._stats if self._stats is not None else CommStats(),
            accept_rank=lambda _rank: authenticated(),
            timeout=HANDSHAKE_TIMEOUT_S,
            max_frame_bytes=self._max_frame_bytes,
            link=self._link,
            security=self._security,
        )

    def _ready(self, accepted: tuple[int, Connection]) -> None:
        attempt, conn = accepted
        if self.admit(conn, attempt):
            self.handle(conn)
        else:
            conn.close()

    def admit(self, conn: Connection, attempt: int) -> bool:
        """Whether to serve ``conn``, whose client proved stage ``attempt`` (False: it is
        closed). Default: if that attempt is still the current one (a new attempt may
        have begun during the handshake). A subclass that keeps its clients'
        connections may take ``conn`` here."""
        if attempt == self.attempt:
            return True
        log.warning(
            "%s: refused rank %d of stage attempt %d (now %d)",
            self.name,
            conn.peer_rank,
            attempt,
            self.attempt,
        )
        return False

    def handle(self, conn: Connection) -> None:
        """Serve one authenticated client (on its handshake's thread, one per client)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop accepting, drop pending strangers and close the listener; idempotent.
        Subclasses close their own connections first."""
        self._stopping.set()
        self._gate.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def _constant(value: int) -> Callable[[], int]:
    return lambda: value
