"""Big task payloads from a driver service instead of the closure (Spark Connect).

A classic session ships a model's weights to ``transform``'s tasks in a broadcast, and a
barrier stage's task closure (the job spec, ``model_fn``, ``train_fn``) in the task
binary, neither capped. A Spark Connect client has no broadcasts, and whatever a task
closes over travels inside one gRPC request to the server, which refuses a request
over ``spark.connect.grpc.maxInboundMessageSize`` (128 MiB by default) outright.

So under Connect a payload rides in the closure only while it is small
(:func:`fits_in_closure`: at most half the cap, the other half left for the plan around
it); a larger one stays in this process, registered with a :class:`PayloadServer`
(the same authenticated, pre-auth-gated :class:`~sparktrain.wire.service.DriverService`
and chunked frames as the other driver services), and the closure carries a
:class:`~sparktrain.task.payload_client.ServedBytes` naming it. Each task that needs it
fetches it once. Executors that cannot reach this process fail with an error that says
what to set (:attr:`ServedBytes.remedy`).

A task unpickles what it fetches: this service MACs its frames (or runs TLS) whatever
``frame_integrity`` says, and each reference carries the payload's HMAC under the
secret (:func:`~sparktrain.task.payload_client.payload_digest`), checked before use.

Two users: a barrier stage serves its pickled task for one attempt
(:func:`sparktrain.driver.barrier.launch`), and ``transform`` serves a model's weights
from a process-wide server (:func:`serve_shared`) for as long as the model lives, since
a transformed DataFrame may be evaluated at any later time; that server stops with its
last payload.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import uuid
from typing import Any

import numpy as np

from sparktrain.errors import CommError
from sparktrain.task.payload_client import ServedBytes, ServedTask, payload_digest
from sparktrain.wire.chunked import DEFAULT_CHUNK_BYTES, chunk_bytes_for, send_chunked
from sparktrain.wire.connection import Connection
from sparktrain.wire.frames import KIND_CONTROL
from sparktrain.wire.listen import ServiceHost
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.service import DriverService

log = logging.getLogger(__name__)

CLOSURE_SHARE = 0.5
"""The share of Connect's request cap one payload may take in a closure; the rest is
for the plan around it (the DataFrame's operators, the UDF's other fields)."""


def fits_in_closure(nbytes: int, cap: int | None) -> bool:
    """May a payload of ``nbytes`` travel in a task closure under a request cap of
    ``cap`` bytes (``None``: no cap, a classic session)?"""
    return cap is None or nbytes <= int(cap * CLOSURE_SHARE)


class PayloadServer(DriverService):
    """Serves registered byte payloads by key to this job's authenticated tasks, over
    frames that always carry MACs (or TLS), whatever the job's ``frame_integrity``."""

    name = "payload"

    def __init__(
        self,
        host: str,
        *,
        secret: bytes,
        job_id: str,
        attempt: int = 0,
        security: WireSecurity | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        # what the tasks fetch here they unpickle: always authenticated frames
        security = (security or WireSecurity()).authenticated()
        super().__init__(host, secret=secret, job_id=job_id, attempt=attempt, security=security)
        self._secret = secret
        self._auth: dict[str, Any] = {
            "secret": secret,
            "job_id": job_id,
            "attempt": attempt,
            "security": security,
        }
        self.chunk_bytes = chunk_bytes  # frames of at most this (and the frame cap)
        self._payloads: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self.fetches = 0  # payloads sent whole
        self.sent_bytes = 0
        self.start()

    def add(self, blob: bytes, *, what: str, timeout: float, remedy: str) -> ServedBytes:
        """Serve ``blob`` (until :meth:`discard`); the reference a closure carries."""
        key = uuid.uuid4().hex
        with self._lock:
            self._payloads[key] = np.frombuffer(blob, dtype=np.uint8)  # no copy
        return ServedBytes(
            address=self.address,
            key=key,
            nbytes=len(blob),
            what=what,
            timeout=timeout,
            remedy=remedy,
            digest=payload_digest(self._secret, key, blob),
            **self._auth,
        )

    def discard(self, key: str) -> None:
        """Stop serving one payload (fetches under way finish)."""
        with self._lock:
            self._payloads.pop(key, None)

    @property
    def payloads(self) -> int:
        """How many payloads are being served."""
        with self._lock:
            return len(self._payloads)

    def handle(self, conn: Connection) -> None:
        with conn:
            try:
                _, request = conn.recv_bytes(KIND_CONTROL, max_bytes=1024)
                key = str(json.loads(request)["key"])
                with self._lock:
                    blob = self._payloads.get(key)
                if blob is None:
                    reply = {"error": f"payload {key} is no longer served (its owner is gone)"}
                    conn.send_bytes(json.dumps(reply).encode(), KIND_CONTROL)
                    return
                step = chunk_bytes_for(conn.max_frame_bytes, self.chunk_bytes)
                head = {"nbytes": int(blob.size), "chunk_bytes": step}
                conn.send_bytes(json.dumps(head).encode(), KIND_CONTROL)
                send_chunked(conn, blob, step)
                with self._lock:
                    self.fetches += 1
                    self.sent_bytes += int(blob.size)
            except (CommError, OSError, ValueError, KeyError) as exc:
                log.debug("payload server: a fetch failed: %s", exc)


STAGE_REMEDY = (
    "Set driver_services_host (and driver_services_ports, to open them in a firewall) to "
    "an address of the driver the executors can reach; or raise "
    "spark.connect.grpc.maxInboundMessageSize on the Connect server to more than twice "
    "this size; or keep the task small: pass model_fn as an importable "
    "'package.module:function' string with model_kwargs, and have model_fn or train_fn "
    "load large weights from storage the executors read instead of closing over them"
)


class ClosureShipper:
    """How one barrier stage attempt ships its task function under Spark Connect: as it
    is while its pickle fits in a closure (:func:`fits_in_closure` of ``cap``), else as a
    :class:`~sparktrain.task.payload_client.ServedTask` fetched from a :class:`PayloadServer`
    on ``host``, started on first need with the job's credentials and stopped with
    :meth:`stop`. :meth:`summary` says which way it went (the run summary's
    ``task_closure``)."""

    def __init__(
        self,
        cap: int | None,
        host: str,
        *,
        secret: bytes,
        job_id: str,
        attempt: int,
        security: WireSecurity | None,
        timeout: float,
    ) -> None:
        self.cap = cap
        self.host = host
        self._auth: dict[str, Any] = {
            "secret": secret,
            "job_id": job_id,
            "attempt": attempt,
            "security": security,
        }
        self.timeout = timeout
        self.server: PayloadServer | None = None
        self.closure_bytes = 0
        self.served = False

    def ship(self, task: Any) -> Any:
        """``task`` itself, or a served stand-in for it when its pickle is too big."""
        from pyspark.serializers import CloudPickleSerializer

        # what the Connect client will pickle into the plan (the pickle a served task
        # carries is this same one, so a large task is pickled only once)
        blob = CloudPickleSerializer().dumps(task)
        self.closure_bytes = len(blob)
        if fits_in_closure(len(blob), self.cap):
            self.served = False
            return task
        if self.server is None:
            self.server = PayloadServer(self.host, **self._auth)
        ref = self.server.add(
            blob,
            what="this stage's task (the job spec with model_fn, model_kwargs, train_fn)",
            timeout=self.timeout,
            remedy=STAGE_REMEDY,
        )
        self.served = True
        log.info(
            "Spark Connect: the stage's task pickles to %.1f MiB, over half the server's "
            "request cap (spark.connect.grpc.maxInboundMessageSize: %.0f MiB); the tasks "
            "fetch it from the driver's payload service on %s",
            len(blob) / 2**20,
            (self.cap or 0) / 2**20,
            ref.address,
        )
        return ServedTask(ref)

    def summary(self) -> dict[str, Any]:
        """``{"bytes": the pickled task's size, "via": "closure" or "driver service",
        "fetches": tasks that fetched it}``."""
        fetches = self.server.fetches if self.server is not None else 0
        via = "driver service" if self.served else "closure"
        return {"bytes": self.closure_bytes, "via": via, "fetches": fetches}

    def stop(self) -> None:
        """Stop the payload server, if one was started."""
        if self.server is not None:
            self.server.stop()


_SHARED: dict[tuple[str, tuple[int, int] | None, bool], PayloadServer] = {}
_SHARED_LOCK = threading.Lock()


def serve_shared(
    blob: bytes,
    *,
    host: str,
    ports: tuple[int, int] | None,
    tls: bool,
    what: str,
    timeout: float,
    remedy: str,
) -> ServedBytes:
    """Serve ``blob`` from this process's payload server on ``host`` (``ports``: its port
    range; ``tls``: TLS on its sockets), started on first use: ``transform``'s lazily
    evaluated plans may fetch from it at any time until :func:`discard_shared`. The
    server's secret is its own, not a training job's; it stops when its last payload is
    discarded, so a process that no longer holds large models keeps no listener."""
    key = (host, ports, tls)
    with _SHARED_LOCK:  # held while adding: a discard cannot stop the server in between
        server = _SHARED.get(key)
        if server is None or server.stopping:
            security = WireSecurity.for_job("tls") if tls else None
            server = PayloadServer(
                ServiceHost(host, ports),
                secret=secrets.token_bytes(32),
                job_id=f"payload-{uuid.uuid4().hex[:8]}",
                security=security,
            )
            _SHARED[key] = server
        return server.add(blob, what=what, timeout=timeout, remedy=remedy)


def discard_shared(ref: ServedBytes) -> None:
    """Stop serving ``ref`` on the shared server that serves it (if it still runs); the
    server stops with its last payload."""
    with _SHARED_LOCK:
        for key, server in list(_SHARED.items()):
            if server.address != ref.address:
                continue
            server.discard(ref.key)
            if server.payloads == 0:
                server.stop()
                del _SHARED[key]
