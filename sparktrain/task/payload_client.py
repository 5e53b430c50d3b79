"""The tasks' side of big task payloads (the driver's side, with the why, is
:mod:`sparktrain.driver.services.payload_server`).

Under Spark Connect a task's closure travels inside one request to the server, which
caps it (``spark.connect.grpc.maxInboundMessageSize``). A payload too big for that (a
model's weights for ``transform``, a barrier stage's pickled task when ``model_fn`` or
``train_fn`` holds a large object) stays on the driver: the closure carries a
:class:`ServedBytes` instead, and the task fetches the bytes from the driver's
:class:`~sparktrain.driver.services.payload_server.PayloadServer` over an authenticated
connection, in chunks (:mod:`sparktrain.wire.chunked`). :class:`ServedTask` is a barrier
task whose body is such a payload.

A task unpickles what it fetches, so the bytes are authenticated twice: the service's
frames always carry MACs (or run over TLS) whatever ``frame_integrity`` says, and the
closure's :class:`ServedBytes` carries an HMAC of the payload under the job secret
(:func:`payload_digest`) that the fetched bytes must match before anyone reads them.

Executor-side code: never imports pyspark.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparktrain.errors import CommError, ConfigError, FrameError, HandshakeError
from sparktrain.wire.chunked import recv_chunked_into
from sparktrain.wire.frames import KIND_CONTROL
from sparktrain.wire.handshake import DRIVER_RANK, connect
from sparktrain.wire.security import WireSecurity
from sparktrain.wire.stats import CommStats

_DIGEST_DOMAIN = b"sparktrain-payload-v1"


def payload_digest(secret: bytes, key: str, blob: bytes | memoryview) -> bytes:
    """HMAC-SHA256 under the job ``secret`` of the payload served as ``key``: what the
    closure carries and the fetched bytes must match (binds the bytes to their key, so
    one served payload cannot stand in for another)."""
    mac = hmac.new(bytes(secret), _DIGEST_DOMAIN, hashlib.sha256)
    name = key.encode("utf-8")
    mac.update(len(name).to_bytes(4, "little") + name)
    mac.update(blob)
    return mac.digest()


REACH_TIMEOUT_S = 5.0
"""How long a task tries to reach the payload service (dial and handshake) before it
takes it for unreachable, as for the driver's rendezvous
(:data:`sparktrain.driver.services.rendezvous.REACH_TIMEOUT_S`): the service is listening before
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
    # payload_digest() of the bytes: checked before the bytes are used (or unpickled)
    digest: bytes = field(default=b"", repr=False)
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
    check_digest(ref, out.data)
    return out.tobytes()


def check_digest(ref: ServedBytes, blob: bytes | memoryview) -> None:
    """Refuse bytes that do not carry ``ref``'s HMAC under the job secret (a
    :class:`~sparktrain.errors.FrameError`): they were altered on the way, or the
    address now belongs to another service; nothing may read, let alone unpickle, them."""
    want = payload_digest(ref.secret, ref.key, blob)
    if not ref.digest or not hmac.compare_digest(want, ref.digest):
        raise FrameError(
            f"{ref.what}: the {ref.nbytes} bytes fetched from the driver's payload service "
            f"at {ref.address} do not match the HMAC the task's closure carries (altered in "
            "transit, or another service answered on that address); refusing to use them. "
            "If it repeats, check the network between the executors and the driver, or set "
            'encryption = "tls"'
        )


@dataclass(frozen=True)
class ServedTask:
    """A barrier task whose pickled body (``functools.partial(_arrow_task, spec, entry)``)
    the driver serves: fetched and unpickled in the task, then run on its batches."""

    body: ServedBytes

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        # cloudpickle's output loads with pickle: .value checked the bytes' HMAC under
        # the job secret first (fetch_payload), so they are the driver's, byte for byte
        task = pickle.loads(self.body.value)
        return task(batches)
