"""The driver-hosted services' common part: a listener and a pre-auth gate.

The driver serves tasks over the same authenticated wire as the collectives: rank 0's
progress (:mod:`sparktrain.metrics`), the barrier stage's rendezvous
(:mod:`sparktrain.launch.rendezvous`) and tree_aggregate's weights
(:mod:`sparktrain.launch.weights_server`). Each binds to the driver's own host and
proves the job secret in the handshake with every client. The accept thread only
accepts: each handshake runs on a thread of its own under the pre-auth gate
(:mod:`sparktrain.comm.preauth`: a deadline of
:data:`~sparktrain.comm.preauth.PREAUTH_DEADLINE_S`, capped strangers, the oldest
dropped), so silent or garbage-sending strangers never delay an authenticated client.
That thread then serves the client with :meth:`DriverService.handle`.
:meth:`DriverService.stop` ends the accept loop at once.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from sparktrain.comm.connection import Connection
from sparktrain.comm.handshake import DRIVER_RANK, first_bytes, serve_accepted
from sparktrain.comm.listen import address_of, open_listener
from sparktrain.comm.preauth import PreauthGate, notify_observer
from sparktrain.comm.security import WireSecurity
from sparktrain.comm.stats import CommStats

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
"""The socket timeout an authenticated client's connection starts with, until
:meth:`DriverService.handle` sets its own (e.g. for the request that follows the
handshake). The handshake itself has the gate's short pre-auth deadline."""


class DriverService:
    """Subclasses implement :meth:`handle`; start the loop with :meth:`start`."""

    name = "service"

    def __init__(
        self,
        host: str,
        *,
        secret: bytes,
        job_id: str,
        attempt: int,
        security: WireSecurity | None = None,
    ) -> None:
        self._listener = open_listener(host)
        self.address = address_of(self._listener)
        self._secret, self._job_id, self._attempt = secret, job_id, attempt
        self._security = security  # frame MACs / TLS, as the job's tasks use them
        self._stopping = threading.Event()
        self._gate = PreauthGate(
            self._listener,
            name=self.name,
            handshake=self._handshake,
            on_ready=self.handle,
            first_bytes=first_bytes(security),
        )
        self._thread = threading.Thread(
            target=self._gate.serve,
            args=(self._stopping.is_set,),
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

    def _handshake(
        self, sock: socket.socket, deadline: float, authenticated: Callable[[], bool]
    ) -> Connection:
        return serve_accepted(
            sock,
            secret=self._secret,
            job_id=self._job_id,
            attempt=self._attempt,
            my_rank=DRIVER_RANK,
            deadline=deadline,
            stats=CommStats(),
            accept_rank=lambda _rank: authenticated(),
            timeout=HANDSHAKE_TIMEOUT_S,
            security=self._security,
        )

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
