"""The driver-hosted services' common part: a listener and an accept loop.

The driver serves tasks over the same authenticated wire as the collectives: rank 0's
progress (:mod:`sparktrain.metrics`), the barrier stage's rendezvous
(:mod:`sparktrain.launch.rendezvous`) and tree_aggregate's weights
(:mod:`sparktrain.launch.weights_server`). Each binds to the driver's own host, proves the
job secret in the handshake with every client, and hands each accepted connection to
:meth:`DriverService.handle` on a thread of its own, so a slow client never holds up
the accept loop. :meth:`DriverService.stop` ends the loop within the listener's
half-second timeout.
"""

from __future__ import annotations

import logging
import threading

from sparktrain.comm import wire
from sparktrain.comm.security import WireSecurity
from sparktrain.errors import CommError

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
"""How long an accepted client has to complete the handshake."""


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
        self._listener = wire.open_listener(host)
        self._listener.settimeout(0.5)  # lets the accept loop notice stop()
        self.address = wire.address_of(self._listener)
        self._secret, self._job_id, self._attempt = secret, job_id, attempt
        self._security = security  # frame MACs / TLS, as the job's tasks use them
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"sparktrain-{self.name}", daemon=True
        )

    def start(self) -> None:
        """Start accepting (call once, after the subclass set up its own state)."""
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn = wire.accept(
                    self._listener,
                    secret=self._secret,
                    job_id=self._job_id,
                    attempt=self._attempt,
                    my_rank=wire.DRIVER_RANK,
                    timeout=HANDSHAKE_TIMEOUT_S,
                    stats=wire.CommStats(),
                    security=self._security,
                )
            except (CommError, OSError) as exc:
                if not isinstance(exc, TimeoutError) and not self._stopping.is_set():
                    log.debug("%s: refused a connection: %s", self.name, exc)
                continue
            threading.Thread(
                target=self.handle, args=(conn,), name=f"sparktrain-{self.name}-in", daemon=True
            ).start()

    def handle(self, conn: wire.Connection) -> None:
        """Serve one authenticated client (on a thread of its own)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop accepting and close the listener; idempotent. Subclasses close their own
        connections first."""
        self._stopping.set()
        self._listener.close()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
