"""The tasks' side of big task payloads (the driver's side, with the why, is
:mod:`sparktrain.launch.payload_server`).

Under Spark Connect a task's closure travels inside one request to the server, which
caps it (``spark.connect.grpc.maxInboundMessageSize``). A payload too big for that (a
model's weights for ``transform``, a barrier stage's pickled task when ``model_fn`` or
``train_fn`` holds a large object) stays on the driver: the closure carries a
:class:`ServedBytes` instead, and the task fetches the bytes from the driver's
:class:`~sparktrain.launch.payload_server.PayloadServer` over an authenticated
connection, in chunks (:mod:`sparktrain.comm.chunked`). :class:`ServedTask` is a barrier
task whose body is such a payload.

Executor-side code: never imports pyspark.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparktrain.comm.chunked import recv_chunked_into
from sparktrain.comm.frames import KIND_CONTROL
from sparktrain.comm.handshake import DRIVER_RANK, connect
from sparktrain.comm.security import WireSecurity
from sparktrain.comm.stats import CommStats
from sparktrain.errors import CommError, ConfigError, HandshakeError

REACH_TIMEOUT_S = 5.0
"""How long a task tries to reach the payload service (dial and handshake) before it
takes it for unreachable, as for the driver's rendezvous
(:data:`sparktrain.launch.rendezvous.REACH_TIMEOUT_S`): the service is listening before
any task starts, so a refusal that lasts is no start-up race."""


@dataclass(frozen=True)
class ServedBytes:
    """A payload the driver serves (what a closure carries instead of it). ``value`` is
    the bytes, fetched when read, as a broadcast's ``value`` is; ``what`` names the
    payload in errors."""

    address: str
    key: str
    nbytes: int
    what: str
    secret: bytes = field(repr=False)
    job_id: str
    attempt: int = 0
    security: WireSecurity | None = field(default=None, repr=False)
    timeout: float = 60.0
    # what to set when the executors cannot reach the service (differs per way in)
    remedy: str = ""

    @property
    def value(self) -> bytes:
        """The payload's bytes, from the driver (one fetch per read)."""
        # Rank 0 in the handshake: the payload is the same for every task and the service
        # asks nothing else of a rank (this module must not ask pyspark for the partition)
        return fetch_payload(self, rank=0)


def fetch_payload(ref: ServedBytes, *, rank: int) -> bytes:
    """The bytes ``ref`` names, from the driver's payload service. A service this task
    cannot reach is a :class:`~sparktrain.errors.ConfigError` that says what to set."""
    try:
        conn = connect(
            ref.address,
            secret=ref.secret,
            job_id=ref.job_id,
            attempt=ref.attempt,
            my_rank=rank,
            peer_rank=DRIVER_RANK,
            timeout=min(ref.timeout, REACH_TIMEOUT_S),
            stats=CommStats(),
            security=ref.security,
        )
    except HandshakeError:
        raise
    except CommError as exc:
        mib = ref.nbytes / 2**20
        raise ConfigError(
            f"{ref.what} ({mib:.1f} MiB) is too big for Spark Connect's request cap, so the "
            f"tasks fetch it from the driver's service at {ref.address}, which this executor "
            f"could not reach ({exc}). {ref.remedy}"
        ) from exc
    with conn:
        conn.set_timeout(ref.timeout)  # every frame of the transfer
        conn.send_bytes(json.dumps({"key": ref.key}).encode(), KIND_CONTROL)
        _, status = conn.recv_bytes(KIND_CONTROL, max_bytes=4096)
        reply = json.loads(status)
        if "error" in reply:
            raise CommError(f"the driver's payload service: {reply['error']}")
        step = int(reply["chunk_bytes"])
        if int(reply["nbytes"]) != ref.nbytes or not 0 < step <= conn.max_frame_bytes:
            raise CommError(f"the driver's payload service sent a bad header: {reply}")
        out = np.empty(ref.nbytes, dtype=np.uint8)
        recv_chunked_into(conn, out, step)
    return out.tobytes()


@dataclass(frozen=True)
class ServedTask:
    """A barrier task whose pickled body (``functools.partial(_arrow_task, spec, entry)``)
    the driver serves: fetched and unpickled in the task, then run on its batches."""

    body: ServedBytes

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        # cloudpickle's output loads with pickle; the bytes come only from the driver this
        # job's secret authenticated, the origin of the closure Spark itself unpickles
        task = pickle.loads(self.body.value)
        return task(batches)
