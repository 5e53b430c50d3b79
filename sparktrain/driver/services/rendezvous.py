"""The barrier stage's one all-gather, hosted by the driver instead of Spark.

Every barrier stage starts with one all-gather of (listener address, row counts, error)
(:func:`sparktrain.task.meet.rendezvous`). Spark's ``BarrierTaskContext.allGather``
answers on a once-a-second poll: on ``local[2]`` every call takes 1.00 s even when both
tasks arrive together (measured; ``barrier()`` alike), a second on the path to the
first step of every fit. The driver already hosts an authenticated channel per attempt
(progress, parameter server), so it hosts this one too: each task dials the
:class:`RendezvousServer`, proves the job secret in the usual handshake, sends its
message, and gets everyone's messages back as soon as the last rank's arrives
(milliseconds on loopback).

Retries: Spark retries a failed barrier stage by re-running every task under the same
:class:`~sparktrain.task.context.JobSpec` (pyspark does not tell a task its stage
attempt). So a rank that sends again replaces its earlier message, and before a round
completes, waiting tasks whose connection has closed (killed with their stage) are
dropped: a round never mixes a dead task's listener address into a live stage. A task
whose peers never arrive gives up after ``comm_timeout`` with a
:class:`~sparktrain.errors.CommError`: nothing waits forever.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading

from sparktrain.errors import CommError, FrameError, HandshakeError
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_CONTROL
from sparktrain.wire.handshake import DRIVER_RANK, connect
from sparktrain.wire.preauth import notify_observer
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.service import HANDSHAKE_TIMEOUT_S, DriverService
from sparktrain.wire.stats import CommStats

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20
"""A rank's message is a small JSON object; anything larger is refused."""

REACH_TIMEOUT_S = 5.0
"""How long a task tries to reach the driver (connect and handshake) before it takes the
driver for unreachable; waiting for the other ranks may then take ``comm_timeout``."""


class DriverUnreachable(CommError):
    """This task cannot reach the driver's services (a Spark Connect client behind a
    firewall or NAT, say): the stage meets through Spark's barrier ``allGather``."""


class RendezvousServer(DriverService):
    """The driver's end: an all-gather over ``world_size`` ranks of one attempt."""

    name = "rendezvous"

    def __init__(
        self,
        host: str,
        *,
        secret: bytes,
        job_id: str,
        attempt: int,
        world_size: int,
        security: WireSecurity | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        super().__init__(host, secret=secret, job_id=job_id, attempt=attempt, security=security)
        self.world_size = world_size
        self._messages: dict[int, str] = {}
        self._waiting: dict[int, Connection] = {}
        self._lock = threading.Lock()
        self.rounds_completed = 0
        self.start()

    def handle(self, conn: Connection) -> None:
        rank = conn.peer_rank
        try:
            conn.set_timeout(HANDSHAKE_TIMEOUT_S)  # the message follows the handshake
            _, payload = conn.recv_bytes(KIND_CONTROL, max_bytes=MAX_MESSAGE_BYTES)
            request = json.loads(payload)
            message = request["message"]
            if not isinstance(message, str):
                raise ValueError("the message must be a string")
        except (CommError, OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("rendezvous: rank %d sent no usable message: %s", rank, exc)
            conn.close()
            return
        if not 0 <= rank < self.world_size:
            self._answer(conn, {"error": f"rank {rank} is outside world size {self.world_size}"})
            return
        with self._lock:
            previous = self._waiting.pop(rank, None)
            self._messages[rank] = message
            self._waiting[rank] = conn
            # a task killed with its stage (Spark retries a barrier stage as a whole)
            # must not count: its rank's message is stale until the new task sends
            gone = [r for r, c in self._waiting.items() if c.peer_gone()]
            dropped = [self._waiting.pop(r) for r in gone]
            for r in gone:
                del self._messages[r]
            complete = len(self._messages) == self.world_size
            if complete:
                everyone = [self._messages[r] for r in range(self.world_size)]
                waiters = list(self._waiting.values())
                self._messages, self._waiting = {}, {}
                self.rounds_completed += 1
        for old in [previous, *dropped]:
            if old is not None:  # the same rank again, or a dead task: its task is gone
                old.close()
        if complete:
            for text in everyone:  # test-only hook (no observer in production)
                notify_observer("rendezvous", text)
            for waiter in waiters:
                self._answer(waiter, {"messages": everyone})

    @staticmethod
    def _answer(conn: Connection, reply: dict[str, object]) -> None:
        with contextlib.suppress(CommError, OSError):
            conn.send_bytes(json.dumps(reply).encode(), KIND_CONTROL)
        conn.close()

    def stop(self) -> None:
        """Close the listener and every waiting connection; idempotent."""
        self._stopping.set()
        with self._lock:
            waiting = list(self._waiting.values())
            self._messages, self._waiting = {}, {}
        for conn in waiting:
            conn.close()
        super().stop()


def all_gather(
    address: str,
    *,
    secret: bytes,
    job_id: str,
    attempt: int,
    rank: int,
    message: str,
    timeout: float,
    security: WireSecurity | None = None,
) -> list[str]:
    """A task's end: send ``message``, return every rank's message in rank order.

    Raises :class:`DriverUnreachable` when no connection to ``address`` can be made
    within :data:`REACH_TIMEOUT_S`, and :class:`CommError` when the driver refuses this
    task or the other ranks do not all arrive within ``timeout`` seconds.
    """
    try:
        conn = connect(
            address,
            secret=secret,
            job_id=job_id,
            attempt=attempt,
            my_rank=rank,
            peer_rank=DRIVER_RANK,
            timeout=min(timeout, REACH_TIMEOUT_S),
            stats=CommStats(),
            security=security,
        )
    except HandshakeError:
        raise  # the driver answered and refused this task (a stale attempt, say)
    except (CommError, OSError) as exc:
        raise DriverUnreachable(
            f"rank {rank} cannot reach the driver's services at {address}: {exc}"
        ) from exc
    try:
        conn.send_bytes(json.dumps({"message": message}).encode(), KIND_CONTROL)
        conn.set_timeout(timeout)
        try:
            _, payload = conn.recv_bytes(KIND_CONTROL, max_bytes=64 * MAX_MESSAGE_BYTES)
        except CommError as exc:
            raise CommError(
                f"rank {rank}: the other tasks of the stage did not all reach the rendezvous "
                f"within {timeout:g} s (comm_timeout): {exc}. A task that cannot reach the "
                f"driver's services at {address} meets through Spark instead: if only some "
                "executors can reach the driver, set driver_services_host to an address "
                "they all can"
            ) from exc
    finally:
        conn.close()
    try:
        reply = json.loads(payload)
    except ValueError as exc:
        raise FrameError(f"the rendezvous sent a reply that is not JSON: {exc}") from exc
    if "error" in reply:
        raise CommError(f"rank {rank}: the rendezvous refused this task: {reply['error']}")
    messages = reply["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, str) for m in messages):
        raise FrameError("the rendezvous reply holds no list of messages")
    return messages
